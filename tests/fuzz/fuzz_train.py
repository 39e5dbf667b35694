"""Random training steps, compiled and eager side by side: results, parameters, gradients,
module buffers and optimizer state compared after every call.

A program is a small model (linear or convolutional layers, norms, activations, some
parameters frozen), a loss, an optimizer (SGD, Adam, AdamW, RMSprop or Adagrad, with
their options) and a step function (``zero_grad`` before or after, gradient clipping,
gradient accumulation over two micro-batches, a learning-rate scheduler, a gradient
norm read into Python, the forward under bfloat16 autocast); a sequence model has a
causal attention layer. Between calls the program
changes what a user changes: the learning rate, which parameters train, train or eval
mode, the batch size. Each is drawn
from ``random.Random(seed)``, so a seed names a program::

    program = draw_train(1234)
    print(program.describe())
    failures = check_train(program, "cpu")   # [] when every call matched eager's

The compiled side is ``fxlite.compile(step)``; the eager side runs ``step`` itself, on a
copy of the model and optimizer made from the same seed. Two more eager copies tell
rounding from error: one in float64, one given each micro-batch in reverse order (the
same sums, rounded in another order); where the compiled side strays from eager's, it
fails only if it strays more than four times as far from float64's as either eager run does.
Under bfloat16 autocast that test is pooled over the call (``_pooled``): fused kernels
round bfloat16 values at other points than eager's ops do, and both eager runs round each
element alike, so key by key the gap is luck; over the call's parameters, or over its
other values, it is not.
"""

from __future__ import annotations

import dataclasses
import math
import random
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TrainProgram", "check_train", "draw_train"]

ACTIVATIONS = ("relu", "gelu", "tanh", "silu", "none")
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad")
CHANGES = ("none", "lr", "freeze", "unfreeze", "eval", "train", "resize")


@dataclasses.dataclass
class TrainProgram:
    """One drawn training step (see the module docstring)."""

    seed: int
    image: bool  # (N, C, H, W) inputs and convolutions, else (N, F) and linears
    layers: list[tuple[str, Any]]
    loss: str  # "ce", "mse" or "square"
    optimizer: str
    options: dict[str, Any]
    zero_first: bool
    set_to_none: bool
    clip: float | None
    accumulate: bool
    scheduler: bool
    read_norm: bool
    frozen: list[int]
    changes: list[str]
    groups: bool = False  # two parameter groups: biases and norms without weight decay
    scale_grads: bool = False  # p.grad.mul_(0.5) between backward and step
    every_other: bool = False  # step and zero_grad on every second call (a Python counter)
    item: bool = False  # the loss returned as loss.item()
    autocast: bool = False  # the forward and loss under torch.autocast(bfloat16)
    sequence: bool = False  # (N, T, F) inputs, a causal attention layer, a mean over T
    calls: int = 7

    def describe(self) -> str:
        """The program in a few lines, for a failure's report."""
        kind = "image" if self.image else "sequence" if self.sequence else "vector"
        return (f"seed {self.seed}: {kind} model "
                f"{self.layers}, loss {self.loss}, {self.optimizer}{self.options}, "
                f"zero_grad {'first' if self.zero_first else 'last'} "
                f"(set_to_none={self.set_to_none}), clip {self.clip}, accumulate "
                f"{self.accumulate}, scheduler {self.scheduler}, read_norm {self.read_norm}, "
                f"frozen {self.frozen}, changes before each call {self.changes}, groups "
                f"{self.groups}, scale_grads {self.scale_grads}, every_other "
                f"{self.every_other}, item {self.item}, autocast {self.autocast}")


def draw_train(seed: int) -> TrainProgram:
    """The training program of ``seed``."""
    r = random.Random(seed)
    image = r.random() < 0.5
    layers: list[tuple[str, Any]] = []
    width = 3 if image else 6
    for _ in range(r.randint(1, 3)):
        out = r.choice((4, 8))
        layers.append(("conv" if image else "linear", (width, out, r.random() < 0.5)))
        width = out
        norm = r.choice(("batch", "layer", "none") if not image else ("batch", "none"))
        if norm == "batch" and not _no_bias_before(layers):
            norm = "none"  # a BatchNorm's bias before it, a shift it takes away
        if norm != "none":
            layers.append((norm, width if norm == "batch" else (width, True)))
        act = r.choice(ACTIVATIONS)
        if act != "none":
            layers.append((act, None))
        if r.random() < 0.3:
            layers.append(("residual", (width, True)))
    if image:
        layers.append(("pool", None))
    layers.append(("linear", (width, 5, True)))
    optimizer = r.choice(OPTIMIZERS)
    options: dict[str, Any] = {"lr": r.choice((1e-2, 1e-3))}
    if r.random() < 0.4:
        options["weight_decay"] = 1e-2
    if optimizer == "sgd" and r.random() < 0.6:
        options["momentum"] = 0.9
        options["nesterov"] = r.random() < 0.5
    if optimizer in ("adam", "adamw") and r.random() < 0.3:
        options["amsgrad"] = True
    if optimizer == "rmsprop" and r.random() < 0.5:
        options["momentum"] = 0.5
        options["centered"] = r.random() < 0.5
    if r.random() < 0.3:
        options["foreach"] = False
    params = sum(2 if kind == "batch" else (1 + spec[-1])
                 for kind, spec in layers if kind in ("conv", "linear", "batch", "layer",
                                                      "residual"))
    frozen = sorted(r.sample(range(params), k=1)) if r.random() < 0.3 else []
    calls = 7  # a key runs fxlite's kernels from its third call: three calls first
    program = TrainProgram(
        seed=seed, image=image, layers=layers, loss=r.choice(("ce", "mse", "square")),
        optimizer=optimizer, options=options, zero_first=r.random() < 0.7,
        set_to_none=r.random() < 0.7, clip=r.choice((None, None, 1.0, 0.05)),
        accumulate=r.random() < 0.2, scheduler=r.random() < 0.3,
        read_norm=r.random() < 0.3, frozen=frozen,
        changes=["none"] * 3 + [r.choice(CHANGES) if r.random() < 0.4 else "none"
                                for _ in range(calls - 3)],
        groups=r.random() < 0.3, scale_grads=r.random() < 0.2,
        every_other=r.random() < 0.2, item=r.random() < 0.2, calls=calls,
        autocast=r.random() < 0.25)
    if not image and r.random() < 0.3:  # drawn last: earlier seeds keep their programs
        program.sequence = True
        layers[:] = [("layer", (s[0] if isinstance(s, tuple) else s, True)) if k == "batch"
                     else (k, s) for k, s in layers]  # (a BatchNorm1d wants (N, C, T))
        layers.insert(1, ("attention", layers[0][1][1]))
        layers.insert(len(layers) - 1, ("seqpool", None))
    return program


def _no_bias_before(layers: list[tuple[str, Any]]) -> bool:
    """No bias on the layers a BatchNorm's input would come through without a
    nonlinearity: the BatchNorm takes away any constant shift, so such a bias has a
    gradient of 0 in exact arithmetic, and in floating point a rounding error of eager's
    or fxlite's own, which Adam or RMSprop scale up to a step of the learning rate's size
    either way (real models have no bias there). False, and ``layers`` as they were,
    where an earlier BatchNorm's bias would be one (no second BatchNorm then)."""
    kept = list(layers)
    for i in range(len(layers) - 1, -1, -1):
        kind, spec = layers[i]
        if kind in ("conv", "linear"):
            layers[i] = (kind, (spec[0], spec[1], False))
        elif kind == "residual":
            layers[i] = (kind, (spec[0], False))
        elif kind == "layer":  # its bias is such a shift too; its weight is not
            layers[i] = (kind, (spec[0], False))
            return True
        elif kind == "batch":
            layers[:] = kept
            return False
        else:
            return True
    return True


class _Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class _Attention(nn.Module):
    """Causal self-attention of two heads with a residual, as a GPT block writes it, with
    biases on its queries and values only. A key bias adds ``q . b`` to every score of a
    query's row, which softmax takes away: its gradient is 0 in exact arithmetic, and in
    floating point a rounding error that RMSprop, Adagrad or Adam scale up to a step of the
    learning rate's size, eager's and fxlite's alike (H200 seeds 30494 and 30539, float32:
    the fused projection's bias, three and four times as far from float64's as eager's)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.bias = nn.Parameter(torch.empty(2, 2, 1, width // 2).uniform_(-0.3, 0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, c = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
        q, v = q + self.bias[0], v + self.bias[1]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(n, t, c))


class _MeanOverTime(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def _layer(kind: str, spec: Any, image: bool) -> nn.Module:
    if kind == "conv":
        return nn.Conv2d(spec[0], spec[1], 3, padding=1, bias=spec[2])
    if kind == "linear":
        return nn.Linear(spec[0], spec[1], bias=spec[2])
    if kind == "batch":
        return nn.BatchNorm2d(spec) if image else nn.BatchNorm1d(spec)
    if kind == "layer":
        return nn.LayerNorm(spec[0], bias=spec[1])
    if kind == "residual":
        inner = nn.Conv2d(spec[0], spec[0], 1, bias=spec[1]) if image else \
            nn.Linear(spec[0], spec[0], bias=spec[1])
        return _Residual(inner)
    if kind == "pool":
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
    if kind == "attention":
        return _Attention(spec)
    if kind == "seqpool":
        return _MeanOverTime()
    return {"relu": nn.ReLU(), "gelu": nn.GELU(), "tanh": nn.Tanh(), "silu": nn.SiLU()}[kind]


def _build(program: TrainProgram, device: str, dtype: torch.dtype = torch.float32
           ) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(program.seed)
    model = nn.Sequential(*[_layer(k, s, program.image) for k, s in program.layers])
    model = model.to(device, dtype)
    for i, p in enumerate(model.parameters()):
        if i in program.frozen:
            p.requires_grad_(False)
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
           "rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad}[program.optimizer]
    if program.groups:
        named = list(model.named_parameters())
        plain = [q for n, q in named if q.dim() <= 1]
        opt = cls([{"params": [q for n, q in named if q.dim() > 1]},
                   {"params": plain, "weight_decay": 0.0}], **program.options)
    else:
        opt = cls(model.parameters(), **program.options)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) \
        if program.scheduler else None
    return model, opt, sched


def _step_fn(program: TrainProgram) -> Any:
    p = program

    def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, torch.bfloat16, enabled=p.autocast):
            out = model(x)
            if p.loss == "ce":
                return F.cross_entropy(out, y)
            if p.loss == "mse":
                return F.mse_loss(out, torch.tanh(y.to(out.dtype).unsqueeze(1).expand_as(out)))
            return (out * out).mean()

    calls = [0]

    def step(model: nn.Module, opt: Any, sched: Any, x: torch.Tensor, y: torch.Tensor
             ) -> tuple[Any, ...]:
        calls[0] += 1
        stepping = not p.every_other or calls[0] % 2 == 0
        if p.zero_first and stepping and not p.every_other:
            opt.zero_grad(set_to_none=p.set_to_none)
        if p.accumulate:
            half = x.shape[0] // 2
            loss = loss_of(model, x[:half], y[:half]) / 2
            loss.backward()
            second = loss_of(model, x[half:], y[half:]) / 2
            second.backward()
            loss = loss + second
        else:
            loss = loss_of(model, x, y)
            loss.backward()
        norm = None
        if p.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                [q for q in model.parameters() if q.grad is not None], p.clip)
        if p.read_norm:
            grads = [q.grad.norm() for q in model.parameters() if q.grad is not None]
            norm = float(torch.stack(grads).norm()) if grads else 0.0
        if p.scale_grads:
            for q in model.parameters():
                if q.grad is not None:
                    q.grad.mul_(0.5)
        if stepping:
            opt.step()
            if sched is not None:
                sched.step()
            if not p.zero_first or p.every_other:
                opt.zero_grad(set_to_none=p.set_to_none)
        return (loss.item() if p.item else loss.detach()), norm

    return step


def _inputs(program: TrainProgram, call: int, batch: int, device: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(program.seed * 100 + call)
    shape = (batch, 3, 6, 6) if program.image else (batch, 5, 6) if program.sequence \
        else (batch, 6)
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, 5, (batch,), generator=g)
    return x.to(device), y.to(device)


def _change(kind: str, model: nn.Module, opt: Any, batch: int) -> int:
    if kind == "lr":
        for group in opt.param_groups:
            group["lr"] = group["lr"] * 0.5
    elif kind == "freeze":
        trained = [q for q in model.parameters() if q.requires_grad]
        if len(trained) > 1:
            trained[0].requires_grad_(False)
    elif kind == "unfreeze":
        for q in model.parameters():
            q.requires_grad_(True)
    elif kind == "eval":
        model.eval()
    elif kind == "train":
        model.train()
    elif kind == "resize":
        return {4: 6, 6: 4, 8: 12, 12: 8}[batch]
    return batch


def _state(model: nn.Module, opt: Any, sched: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, q in model.named_parameters():
        out[f"param {name}"] = q.detach()
        out[f"param {name} requires_grad"] = q.requires_grad
        out[f"grad {name}"] = None if q.grad is None else q.grad.detach()
    for name, b in model.named_buffers():
        out[f"buffer {name}"] = b
    params = list(model.parameters())
    for i, q in enumerate(params):
        for k, v in opt.state.get(q, {}).items():
            out[f"optimizer state {i} {k}"] = v
    for j, group in enumerate(opt.param_groups):
        for k, v in group.items():
            if k != "params":
                out[f"group {j} {k}"] = v
    if sched is not None:
        out["scheduler last_lr"] = sched.get_last_lr()
        out["scheduler last_epoch"] = sched.last_epoch
    out["training"] = model.training
    return out


def _off(got: Any, want: Any, exact: Any, other: Any) -> str | None:
    """Where float32 ``got`` is further from eager's ``want`` than rounding explains:
    None, or how far. Float32 runs stray from the float64 run ``exact`` by rounding, and
    an optimizer can scale a rounding of a tiny gradient up (Adam's and RMSprop's steps,
    RMSprop's momentum), so a gap counts only where ``got`` strays more than four times
    as far from ``exact`` as eager's runs do: ``want``, and ``other``, eager's on the
    batch in another order, whose sums round as another kernel's would."""
    a, b = (torch.as_tensor(v, dtype=torch.float64).cpu() for v in (got, want))
    if torch.allclose(a, b, rtol=1e-3, atol=1e-4, equal_nan=True):
        return None
    gap = (a - b).abs().max().item()
    if exact is None:
        return f"max difference {gap:.3g}"
    t = torch.as_tensor(exact, dtype=torch.float64).cpu()
    ours = (a - t).abs().max().item()
    eagers = max((torch.as_tensor(v, dtype=torch.float64).cpu() - t).abs().max().item()
                 for v in (want, other))
    if ours <= 4 * eagers + 1e-6:
        return None
    return f"max difference {gap:.3g} (from float64's: {ours:.3g}, eager's {eagers:.3g})"


def _level(side: tuple[nn.Module, Any, Any], eager: tuple[nn.Module, Any, Any]) -> None:
    """Copy eager's parameters, gradients, buffers and optimizer state into ``side``'s
    tensors, in place (what fxlite keys stays as it was): each call is then compared
    from the same state, one step's rounding apart, where otherwise two runs' roundings
    compound over the calls, scaled up by an optimizer that divides by a running norm
    (Adam, RMSprop)."""
    (model, opt, _), (model_e, opt_e, _) = side, eager
    with torch.no_grad():
        for q, q_e in zip(model.parameters(), model_e.parameters()):
            q.copy_(q_e)
            if q.grad is not None and q_e.grad is not None:
                q.grad.copy_(q_e.grad)
            state, state_e = opt.state.get(q, {}), opt_e.state.get(q_e, {})
            for k, v in state_e.items():
                mine = state.get(k)
                if isinstance(v, torch.Tensor) and isinstance(mine, torch.Tensor) \
                        and mine.shape == v.shape:
                    mine.copy_(v)
        for b, b_e in zip(model.buffers(), model_e.buffers()):
            b.copy_(b_e)


def _relative(value: Any, exact: Any) -> float:
    """How far ``value`` is from ``exact``, relative to ``exact``'s largest magnitude."""
    a, t = (torch.as_tensor(v, dtype=torch.float64).cpu() for v in (value, exact))
    return (a - t).abs().max().item() / max(t.abs().max().item(), 1e-12)


def _pooled(gaps: list[tuple[str, str, float, float]], where: str) -> list[str]:
    """Under bfloat16 autocast: the keys that ``_off`` would fail (``gaps``: key, its
    report, the compiled side's and eager's relative distance from float64's), failed
    only if over the call's values of that kind (parameters; gradients, optimizer state,
    buffers and results) the compiled side's root-mean-square relative distance from
    float64's is over four times eager's. A fused kernel keeps float32 between ops that
    eager rounds to bfloat16 one by one: per op it is as close to float64's or closer, and
    seeds 700053, 701182, 702457, 703034, 2400617 and 2400854 failed one key each, eager's
    error elsewhere in the call as large as the gap (BENCHMARKS.md, twenty-fifth session)."""
    problems = []
    for pool in (True, False):  # parameters (one step from eager's), and the rest
        group = [g for g in gaps if g[0].startswith("param ") == pool]
        if not any(report for _, report, _, _ in group):
            continue
        ours, eagers = (math.sqrt(sum(g[i] ** 2 for g in group) / len(group)) for i in (2, 3))
        if ours > 4 * eagers + 1e-6:
            problems += [f"{where}: {key}: {report} (over the call's {len(group)} such "
                         f"values, relative distance from float64's: {ours:.3g}, eager's "
                         f"{eagers:.3g})" for key, report, _, _ in group if report]
    return problems


def _differences(got: dict[str, Any], want: dict[str, Any], where: str,
                 exact: dict[str, Any], other: dict[str, Any], pooled: bool = False
                 ) -> list[str]:
    """Where ``got`` (the compiled side's results and state) differs from eager's
    ``want`` by more than rounding (``_off``; ``exact`` and ``other`` are the float64 and
    reordered eager runs'); with ``pooled``, floating-point gaps are judged over the call
    (``_pooled``)."""
    problems: list[str] = []
    gaps: list[tuple[str, str, float, float]] = []
    for key in sorted(set(got) | set(want)):
        a, b = got.get(key, "<missing>"), want.get(key, "<missing>")
        t, o = exact.get(key), other.get(key)

        def pool(report: str) -> None:
            gaps.append((key, report, _relative(a, t), max(_relative(b, t), _relative(o, t))))
        if isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{where}: {key}: {a.dtype}{tuple(a.shape)} against eager's "
                                f"{b.dtype}{tuple(b.shape)}")
                continue
            ok = all(isinstance(v, torch.Tensor) and v.shape == b.shape for v in (t, o))
            off = _off(a, b, t if ok else None, o)
            if pooled and ok and b.is_floating_point():
                pool(off or "")
            elif off:
                problems.append(f"{where}: {key}: {off}")
        elif isinstance(a, float) and isinstance(b, float):
            ok = isinstance(t, float) and isinstance(o, float)
            off = _off(a, b, t if ok else None, o)
            if pooled and ok:
                pool(f"{a} against eager's {b}, {off}" if off else "")
            elif off:
                problems.append(f"{where}: {key}: {a} against eager's {b}, {off}")
        elif isinstance(a, list) and isinstance(b, list) and all(
                isinstance(v, float) for v in a + b) and len(a) == len(b):
            if any(abs(u - v) > 1e-9 + 1e-6 * abs(v) for u, v in zip(a, b)):
                problems.append(f"{where}: {key}: {a} against eager's {b}")
        elif type(a) is not type(b) or (not isinstance(a, torch.Tensor) and a != b):
            problems.append(f"{where}: {key}: {a!r} against eager's {b!r}")
    return problems + _pooled(gaps, where)


def check_train(program: TrainProgram, device: str = "cpu",
                stats: dict[str, int] | None = None) -> list[str]:
    """Failures of the compiled step against eager's, over ``program.calls`` calls
    (empty when every call matched): results, exceptions, parameters, gradients,
    buffers, optimizer and scheduler state. Eager runs in float64 and on the batch in
    another order tell rounding from error (see ``_off``). ``stats`` (if given) counts
    the calls that ran fxlite's kernels and those that ran in eager whole. On CUDA, TF32
    is off while it runs (convolutions differ by algorithm, and fxlite may pick
    channels-last ones: 1e-3 apart, which Adam and RMSprop scale up)."""
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    if device != "cpu":
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return _check_train(program, device, stats)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def _check_train(program: TrainProgram, device: str, stats: dict[str, int] | None
                 ) -> list[str]:
    import fxlite

    step = _step_fn(program)  # each side its own (its Python counter of calls)
    exact_step, other_step = _step_fn(program), _step_fn(program)
    sides = [_build(program, device), _build(program, device)]
    exact_side, other_side = _build(program, device, torch.float64), _build(program, device)
    compiled = fxlite.compile(_step_fn(program))
    failures: list[str] = []
    # micro-batches of 4 or 6: a BatchNorm of two samples gives each +-1 whatever they are,
    # so the gradients before it are rounding errors (seed 288), which RMSprop scales up
    batch = 8 if program.accumulate else 4
    for call in range(program.calls):
        for model, opt, _ in (*sides, exact_side, other_side):
            batch_now = _change(program.changes[call], model, opt, batch)
        batch = batch_now
        x, y = _inputs(program, call, batch, device)
        outs: list[Any] = []
        for fn, (model, opt, sched) in ((step, sides[0]), (compiled, sides[1])):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    outs.append((fn(model, opt, sched, x.clone(), y.clone()), None))
                except Exception as e:  # compared below
                    outs.append((None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            if fn is compiled:
                failures += [f"call {call}: warning: {str(w.message).splitlines()[0][:300]}"
                             for w in caught if "fxlite" in str(w.message)
                             and any(k in str(w.message) for k in ("bug", "Error", "failed"))]
        if stats is not None:
            ran = "calls with kernels" if compiled.kernels else "calls without kernels"
            stats[ran] = stats.get(ran, 0) + 1
        (want, err_e), (got, err_c) = outs
        where = f"call {call} (after {program.changes[call]})"
        if err_e != err_c:
            failures.append(f"{where}: eager raised {err_e}, compiled raised {err_c}")
            break
        if err_e is not None:
            break
        exact = exact_step(*exact_side, x.double(), y)
        half = batch // 2 if program.accumulate else batch  # each micro-batch reversed
        order = torch.cat([torch.arange(half - 1, -1, -1),
                           torch.arange(batch - 1, half - 1, -1)]).to(device)
        other = other_step(*other_side, x[order], y[order])
        failures += _differences(
            {"loss": got[0], "norm": got[1], **_state(*sides[1])},
            {"loss": want[0], "norm": want[1], **_state(*sides[0])}, where,
            {"loss": exact[0], "norm": exact[1], **_state(*exact_side)},
            {"loss": other[0], "norm": other[1], **_state(*other_side)}, program.autocast)
        for side in (sides[1], exact_side, other_side):  # the next call starts level
            _level(side, sides[0])
        if failures:
            break
    return failures
