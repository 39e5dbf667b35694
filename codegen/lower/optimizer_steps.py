"""Optimizer steps as fused multi-tensor kernels.

An eager ``torch.optim.Adam`` step (the default ``foreach`` implementation) runs about a
dozen multi-tensor ops from Python, with every scalar worked out on the host: for
resnet18's 62 parameters that is 0.7 ms of host time per step, longer than a whole
replayed CUDA graph of the forward and backward. ``fused_optimizer_steps`` has a compiled
segment run the update as torch's fused kernels instead (those of ``fused=True``): one
launch per device and dtype for ``Adam``, ``AdamW`` and ``SGD``.

The update is the same formula as eager's, so results agree to rounding (the fused
kernels work out the bias corrections in float32 on the device); they are not
bit-identical. The optimizer's state stays eager's: its ``step`` counts are the same CPU
tensors, advanced on every call, so ``state_dict()``, a scheduler, or handing the
optimizer back to eager code see what they would have. A step the fused kernels cannot
take exactly runs the optimizer's own ``step()``: the first one (it creates the state),
a closure, step hooks, tensor learning rates, ``capturable``/``differentiable``/``fused``
options, sparse or complex gradients, parameters on other devices, and parameters the
kernels cannot walk flat (not dense, as a sliced leaf is, or laid out unlike their
gradient or moments).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from itertools import repeat
from typing import Any

import torch
from fxlite.codegen.capture.guards import tensor_guard

from fxlite.graph_module import GraphModule
from fxlite.tensor_meta import is_dense

__all__ = ["FusedStep", "fused_optimizer_steps"]

_DEVICES = ("cuda", "cpu")  # where torch has fused Adam and SGD kernels
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def fused_optimizer_steps(gm: GraphModule) -> GraphModule:
    """Swap each recorded ``opt.step()`` of an ``Adam``, ``AdamW`` or ``SGD`` for a
    :class:`FusedStep` of the same optimizer. Returns ``gm``, changed in place.

    Before / after::

        step = step_1()            # Adam.step, bound to opt
        step = step_1()            # FusedStep(opt): fused kernels, or Adam.step when it must
    """
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and FusedStep.applies_to(node.target):
            node.target = FusedStep(node.target)
            changed = True
    if changed:
        gm.recompile()
    return gm


class FusedStep:
    """``opt.step()`` for an ``Adam``, ``AdamW`` or ``SGD``, taken with fused kernels
    whenever its options and state allow (see the module docstring), else eagerly.

    Example::

        step = FusedStep(opt.step)
        step()            # the same update as opt.step(), in one launch per device and dtype

    Host time is the point, so what a step needs (the tensor lists, the device copies of
    the step counts) is kept per parameter group in a :class:`_Plan` and only checked on
    each call: the same parameters, gradients of the right kind, the same state tensors,
    and step counts nobody else wrote.
    """

    __name__ = "step"
    __qualname__ = "FusedStep"

    def __init__(self, method: Any) -> None:
        self.method = method
        self.opt = method.__self__
        self.__module__ = type(self.opt).__module__  # a host call, as the optimizer's is
        self._plans: dict[int, list[_Plan]] = {}  # per group: one plan per device and dtype
        self._one = torch.tensor(1.0)  # foreach adds of a CPU tensor: no per-count wrapping

    @staticmethod
    def applies_to(target: Any) -> bool:
        """Whether ``target`` is the unwrapped ``step`` of an Adam, AdamW or SGD."""
        opt = getattr(target, "__self__", None)
        kinds = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
        return type(opt) in kinds and getattr(target, "__func__", None) is type(opt).step

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not self._may_fuse():
            return self.method(*args, **kwargs)
        plans = [self._plans_of(i, group) for i, group in enumerate(self.opt.param_groups)]
        if any(p is None for p in plans):
            return self.method()
        with torch.no_grad():
            for group, group_plans in zip(self.opt.param_groups, plans):
                for plan in group_plans:
                    plan.run(group, self._one)
                    # Not kept to the next step: zero_grad(set_to_none=True) frees them
                    # in eager, and a plan holding them kept a model's size of memory.
                    plan.grads = None
        return None

    def _may_fuse(self) -> bool:
        from torch.optim import optimizer as om

        opt = self.opt
        # A scheduler's wrapper of opt.step only notes that a step ran (the recording
        # call made that note); any other wrapper may do more.
        own = opt.__dict__.get("step")
        overridden = own is not None and not getattr(own, "_wrapped_by_lr_sched", False)
        return not (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                    or om._global_optimizer_pre_hooks or om._global_optimizer_post_hooks
                    or overridden)

    def _plans_of(self, index: int, group: dict) -> list[_Plan] | None:
        """The group's plans, checked (or made again), or None if it must run eagerly."""
        if group.get("fused") or group.get("capturable") or group.get("differentiable") \
                or isinstance(group["lr"], torch.Tensor) \
                or any(isinstance(b, torch.Tensor) for b in group.get("betas", ())):
            return None
        params = group["params"]
        grads = [p.grad for p in params]
        kept = self._plans.get(index)
        if kept is not None and sum(len(plan.index) for plan in kept) == \
                sum(g is not None for g in grads) and \
                all(plan.holds(params, grads, self.opt.state) for plan in kept):
            return kept
        adamw = type(self.opt) is torch.optim.AdamW  # torch before AdamW shared Adam's code
        made = _Plan.make(group, grads, self.opt.state, adamw)
        if made is None:
            self._plans.pop(index, None)
        else:
            self._plans[index] = made
        return made


_ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")
_VERSION = operator.attrgetter("_version")


def _flat_alike(p: torch.Tensor, g: torch.Tensor, moments: list[torch.Tensor]) -> bool:
    """Whether torch's fused kernels step ``p`` right: they walk each tensor's memory
    flat, so ``p`` must be dense and its gradient and moments laid out as it is. A sliced
    parameter (``w[..., ::2]``) or a channels-last one with a row-major gradient was
    stepped wrong (torch 2.13's ``_fused_sgd_`` left the sliced one as it was)."""
    return is_dense(p) and g.stride() == p.stride() \
        and all(m.stride() == p.stride() for m in moments)


def _state_names(group: dict) -> tuple[str, ...]:
    """The state a step of ``group`` reads per parameter (Adam's has betas, SGD's not)."""
    if "betas" in group:
        return (*_ADAM_STATE, "max_exp_avg_sq") if group.get("amsgrad") else _ADAM_STATE
    return ("momentum_buffer",) if group["momentum"] else ()


class _Plan:
    """One fused call: the parameters of one group on one device, of one dtype, that have
    gradients, with their state tensors and the device copies of their step counts."""

    def __init__(self, group: dict, index: list[int], params: list[torch.Tensor],
                 grads: list[torch.Tensor], state: dict, adamw: bool) -> None:
        self.size = len(group["params"])
        self.index = index  # which of the group's parameters (the others: no gradient)
        self.params = params
        self.strides = [p.stride() for p in params]
        self.dtype = params[0].dtype  # (model.double() changes it in place)
        self.grads: list[torch.Tensor] | None = grads  # this step's; None between steps
        # torch's C++ guards over the layouts last checked in Python (see holds)
        self._param_guard: Any = None
        self._grad_guard: Any = None
        self.state = state
        self.slots = [state.get(p) for p in params]  # (state[p] would add an entry)
        self.adam = "betas" in group
        self.decoupled = group.get("decoupled_weight_decay", adamw)
        self.names = _state_names(group)
        self.tensors = {k: [slot[k] for slot in self.slots] for k in self.names}
        if self.adam:
            counts = self.tensors["step"]
            device = params[0].device
            self.mirror = torch.tensor([float(c) for c in counts], dtype=torch.float32,
                                       device=device)
            self.mirrors = list(self.mirror.unbind())
            self.versions = [c._version for c in counts]

    @staticmethod
    def make(group: dict, grads: list[Any], state: dict, adamw: bool) -> list[_Plan] | None:
        """Plans for ``group``, or None if any parameter must be stepped eagerly."""
        adam = "betas" in group
        names = _state_names(group)
        kinds: dict[tuple, list[int]] = defaultdict(list)
        for i, (p, g) in enumerate(zip(group["params"], grads)):
            if g is None:
                continue
            if g.is_sparse or g.dtype != p.dtype or p.dtype not in _FLOATS \
                    or p.device.type not in _DEVICES or g.device != p.device:
                return None
            slot = state.get(p)
            if names and (not slot or any(slot.get(k) is None for k in names)):
                return None  # the first step creates the state: eager's own code does
            if adam and (not isinstance(slot["step"], torch.Tensor)
                         or slot["step"].device.type != "cpu"):
                return None
            if any(slot[k].dtype != p.dtype or slot[k].device != p.device
                   for k in names if k != "step"):
                return None  # moments of another dtype (after model.double()): eager's
            if not _flat_alike(p, g, [slot[k] for k in names if k != "step"]):
                return None
            kinds[(p.device, p.dtype)].append(i)
        params = group["params"]
        return [_Plan(group, index, [params[i] for i in index], [grads[i] for i in index],
                      state, adamw) for index in kinds.values()]

    def holds(self, params: list[torch.Tensor], grads: list[Any], state: dict) -> bool:
        """Whether this plan still describes the group: same parameters, gradients on
        all of its own (new gradient tensors are checked), same state, counts unwritten.

        Every step brings new gradient tensors (``zero_grad(set_to_none=True)``), so
        their layouts are checked on every call: by torch's C++ tensor guard against the
        last ones that passed (:func:`tensor_guard`), and in Python only where that
        guard fails or this torch has none. GPT-2's 148 parameters, new gradients each
        call (``benchmarks/bench_optimizer_check.py``, 2-core CPU, medians of two runs):
        309 and 431 us a check with the Python loops alone, 175 and 193 with the guards."""
        if len(params) != self.size or state is not self.state:
            return False
        index = self.index
        mine_params = [params[i] for i in index]
        if not all(map(operator.is_, mine_params, self.params)):
            return False
        guard = self._param_guard
        if guard is None or not guard.check(*mine_params):
            if any(p.dtype is not self.dtype or p.stride() != stride
                   for p, stride in zip(mine_params, self.strides)):
                return False  # (``p.data = ...`` keeps p and may change its layout)
            self._param_guard = tensor_guard(mine_params)
        mine = [grads[i] for i in index]
        if self.grads is None or not all(map(operator.is_, mine, self.grads)):
            guard = self._grad_guard
            if guard is None or not guard.check(*mine):
                if any(g is None or g.is_sparse or g.dtype is not p.dtype
                       or g.get_device() != p.get_device() or g.stride() != p.stride()
                       for g, p in zip(mine, self.params)):
                    return False
                self._grad_guard = tensor_guard(mine)
            self.grads = mine
        slots = self.slots
        for k in self.names:
            if not all(map(operator.is_, map(dict.get, slots, repeat(k)), self.tensors[k])):
                return False
        if not all(map(operator.is_, map(state.get, self.params), slots)):
            return False
        return not self.adam or list(map(_VERSION, self.tensors["step"])) == self.versions

    def run(self, group: dict, one: torch.Tensor) -> None:
        """The fused update, with ``group``'s current scalars (a scheduler changes lr)."""
        t = self.tensors
        if not self.adam:
            torch._fused_sgd_(self.params, self.grads, t.get("momentum_buffer", []),
                              weight_decay=group["weight_decay"], momentum=group["momentum"],
                              lr=group["lr"], dampening=group["dampening"],
                              nesterov=group["nesterov"], maximize=group["maximize"],
                              is_first_step=False, grad_scale=None, found_inf=None)
            return
        counts = t["step"]
        torch._foreach_add_(counts, one, alpha=1.0)  # eager's CPU counts, as eager does
        self.versions = [c._version for c in counts]
        self.mirror.add_(1)
        fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        fused(self.params, self.grads, t["exp_avg"], t["exp_avg_sq"],
              t.get("max_exp_avg_sq", []), self.mirrors, amsgrad=bool(group.get("amsgrad")),
              lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
              weight_decay=group["weight_decay"], eps=group["eps"],
              maximize=group["maximize"], grad_scale=None, found_inf=None)
