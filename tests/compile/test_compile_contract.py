"""fxlite.compile's contract on ordinary PyTorch code: never a crash where eager works,
never a silently wrong result (issue: "fxlite.compile is never wrong").

Every test calls the compiled function several times with fresh inputs, benign first and
then the trap, so the first-call checks are never what makes a test pass. Results,
inputs and module state are compared with eager PyTorch after every call.
The contract where Python state is involved is tested in test_compile_python_state.py.
"""

from __future__ import annotations

import copy
import enum
import functools
import threading
import warnings
from typing import Literal

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("triton")

import fxlite.codegen.compile as compile_mod
from fxlite.codegen.runtime.kernel import interpreting

import fxlite

DEVICE = "cpu" if interpreting() else "cuda"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(compile_mod, "_warned", set())


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def same_as_eager(fn, calls, *, grad=False):
    """Compile ``fn`` (a function, or a module compared with a deep copy of itself) and
    check every call of ``calls`` (``(args, kwargs)`` pairs) against eager: results,
    arguments after the call, and module state. Returns the compiled function."""
    eager = copy.deepcopy(fn) if isinstance(fn, nn.Module) else fn
    compiled = fxlite.compile(fn)
    for i, (args, kwargs) in enumerate(calls):
        a_eager, a_comp = copy.deepcopy((args, kwargs)), copy.deepcopy((args, kwargs))
        torch.manual_seed(i)
        with torch.set_grad_enabled(grad):
            want = eager(*a_eager[0], **a_eager[1])
        torch.manual_seed(i)
        with torch.set_grad_enabled(grad), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = compiled(*a_comp[0], **a_comp[1])
        torch.testing.assert_close(got, want, msg=lambda m: f"call {i}: {m}")
        torch.testing.assert_close(a_comp, a_eager, msg=lambda m: f"arguments after call {i}: {m}")
        if isinstance(fn, nn.Module):
            torch.testing.assert_close(fn.state_dict(), eager.state_dict(),
                                       msg=lambda m: f"state after call {i}: {m}")
    return compiled


def repeat(args, n=3, **kwargs):
    return [(args, kwargs)] * n


# ------------------------------------------------------------------ crashes that escaped
class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x, y):
        return nn.CrossEntropyLoss()(self.fc(x), y)  # a module made inside forward


def test_module_created_inside_the_function():
    y = torch.randint(0, 3, (4,), device=DEVICE)
    same_as_eager(Classifier().to(DEVICE), [((rand(4, 8), y), {}), ((rand(4, 8), y), {})])


def test_reshape_by_a_product_of_sizes():
    def flat(x):
        return x.reshape(x.shape[0] * x.shape[1]) * 2

    same_as_eager(flat, [((rand(3, 4),), {}), ((rand(5, 2),), {}), ((rand(3, 4),), {})])


def test_numpy_inside_the_function_is_a_read():
    def via_numpy(x):
        return torch.from_numpy(np.asarray(x.cpu()) * 2).to(x.device) + x

    same_as_eager(via_numpy, [((rand(3),), {}), ((rand(3),), {}), ((rand(3),), {})])


def test_partial_and_builtin_callables():
    def scaled(x, k=1):
        return x * k + 1

    same_as_eager(functools.partial(scaled, k=2), repeat((rand(5),)))
    same_as_eager(torch.relu, repeat((rand(5),)))


class Mode(enum.Enum):
    A = 1


def annotated(x, mode: Literal[Mode.A] = Mode.A) -> torch.Tensor:
    return x + 1


def test_odd_annotations_are_harmless():
    same_as_eager(annotated, repeat((rand(4),)))


class HFStyle(nn.Module):
    """A HuggingFace-style forward: keyword arguments with defaults and **kwargs."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        h = self.proj(input_ids)
        if attention_mask is not None:
            h = h * attention_mask
        if kwargs.get("scale") is not None:
            h = h * kwargs["scale"]
        return {"hidden": h}


def test_keyword_calls_bind_as_python_binds_them():
    ids, mask = rand(2, 8), torch.ones(2, 8, device=DEVICE)
    same_as_eager(HFStyle().to(DEVICE), [
        ((), {"input_ids": ids, "attention_mask": mask}),
        ((), {"input_ids": ids, "attention_mask": mask, "scale": 2.0}),
        ((ids,), {}), ((), {"input_ids": ids, "attention_mask": mask})])


def test_star_args_with_keyword_only_arguments():
    def total(x, *rest, scale=1.0, **extra):
        return (x + sum(rest)) * scale

    same_as_eager(total, [((rand(3), rand(3)), {"scale": 2.0}), ((rand(3),), {}),
                          ((rand(3), rand(3), rand(3)), {"scale": 3.0}),
                          ((rand(3), rand(3)), {"scale": 2.0})])


def test_missing_argument_raises_pythons_type_error():
    with pytest.raises(TypeError):
        fxlite.compile(lambda x, y: x + y)(rand(2))


@pytest.mark.parametrize("kwargs", [{"backend": 42}, {"backend": "no-such-backend"},
                                    {"fullgraph": "yes"}, {"mode": "fast"}],
                         ids=["backend", "backend_name", "fullgraph", "mode"])
def test_bad_options_are_refused(kwargs):
    with pytest.raises((TypeError, ValueError)):
        fxlite.compile(lambda x: x, **kwargs)
    with pytest.raises((TypeError, ValueError)):
        fxlite.compile(**kwargs)


def test_a_class_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"nn\.Linear|Linear\(\.\.\.\)"):
        fxlite.compile(nn.Linear)


def test_recording_in_one_thread_leaves_other_threads_alone():
    # While one thread records, eager module calls in another thread must run normally.
    started, done, errors = threading.Event(), threading.Event(), []

    def slow(x):
        started.set()
        done.wait(5)
        return x + 1

    def other():
        started.wait(5)
        try:
            m = nn.Linear(3, 3)
            m(torch.randn(2, 3))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    torch.testing.assert_close(fxlite.compile(slow)(torch.ones(2)), torch.full((2,), 2.0))
    t.join()
    assert errors == []


def test_fallback_warnings_name_the_users_file(monkeypatch):
    import fxlite.codegen.runtime.kernel as triton_mod

    def boom(*args, **kwargs):
        raise RuntimeError("generator exploded")

    monkeypatch.setattr(triton_mod, "generate_kernel", boom)
    c = fxlite.compile(lambda x: torch.relu(x) * 2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        c(rand(4))
        c(rand(4))
    ours = [w for w in record if "fxlite.compile" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__
    assert "generator exploded" in str(ours[0].message)


# ------------------------------------------------------------------ writes
class StepCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps += 1
        return x * self.steps


def test_buffer_updates_happen_on_every_call():
    same_as_eager(StepCounter().to(DEVICE), repeat((rand(3),), n=4))


class ResultUnused(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, x):
        self.act(x)  # in-place: only its write matters
        return x * 2


@pytest.mark.parametrize("act", [nn.ReLU(inplace=True), nn.SiLU(inplace=True),
                                 nn.ELU(inplace=True), nn.Hardtanh(inplace=True),
                                 nn.LeakyReLU(inplace=True)], ids=lambda a: type(a).__name__)
def test_in_place_activations_keep_their_writes(act):
    c = same_as_eager(ResultUnused(act).to(DEVICE), repeat((rand(3, 4),)))
    assert len(c.kernels) == 1  # functionalized: the write fuses with the mul


def test_writes_through_views_and_aliases():
    def through_view(x):
        v = x[0]
        v.mul_(2)  # writes x through a view
        y = x.view(-1)
        x.add_(1)
        return y * 1.0

    same_as_eager(through_view, repeat((rand(3, 4),)))


@pytest.mark.parametrize("view", [lambda t: t.squeeze(), lambda t: t.view(())],
                         ids=["squeeze", "view"])
def test_a_returned_view_of_a_value_written_later_stays_a_view(view):
    # The fuzzer's seed 7107124: a kernel computed the 0-dim view as a copy of its own,
    # so a write to the base after a graph break (or by the caller) missed it from call 2.
    def after_a_break(x):
        v0 = x * 2
        v1 = view(v0)
        if x.sum() > 0:  # reads a value: two graphs
            pass
        v0[::2] = 1e-3
        return v1

    def both(x):
        v0 = x * 2
        return v0, view(v0)

    same_as_eager(after_a_break, repeat((rand(1),)))
    c = fxlite.compile(both)
    for _ in range(3):
        base, v = c(rand(1))
        base.add_(1)  # the caller writes the base: the view sees it, as eager's does
        assert v.item() == base.item()


class FoldedStack(nn.Module):
    """The fuzzer's seed 7205737: a batch norm in training mode of a value computed from
    sizes alone, which fold_constants folds into a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(2))
        self.register_buffer("var", torch.ones(2))

    def forward(self, x):
        v = x.new_zeros(x.shape[-1:]) + len(x.shape)
        return F.batch_norm(torch.stack([v, v], dim=-1), self.mean, self.var, training=True)


def test_a_value_folded_from_sizes_keeps_its_kernels():
    # The folded value had no shape metadata, so fuse failed and the segment ran in eager.
    c = same_as_eager(FoldedStack().to(DEVICE), repeat((rand(3, 3),)))
    assert not c.fallbacks, c.fallbacks


def test_a_folded_value_read_before_a_write_into_it_keeps_its_kernels():
    # Fuzz seed 9400824: the matmul read the folded value with the later write in it; the
    # kernel check caught the difference and the segment ran its recorded ops
    def f(x):
        v1 = x.new_zeros(x.shape[-1:]) + len(x.shape)
        v2 = v1 @ v1
        v1[-1] = 2.0
        return v1.double() * x, v2

    c = same_as_eager(f, repeat((rand(3),)))
    assert c.kernels and not c.fallbacks, c.fallbacks


def test_an_input_written_and_returned_keeps_its_identity():
    def bump(x):
        x.add_(1)
        return x

    c = fxlite.compile(bump)
    for _ in range(3):
        x = rand(4)
        before = x.clone()
        out = c(x)
        assert out is x and torch.equal(x, before + 1)


# ------------------------------------------------------------------ staleness
class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def test_changes_to_the_module_after_compiling_are_seen():
    m = Hooked().to(DEVICE)
    c = fxlite.compile(m)
    x = rand(2, 4)
    check = lambda: torch.testing.assert_close(c(x), m(x))
    with torch.no_grad():
        check(), check()
        handle = m.register_forward_hook(lambda mod, args, out: out * 10)
        check(), check()
        handle.remove()
        check()
        m.lin = nn.Linear(4, 4).to(DEVICE)  # a replaced submodule
        check()
        m.lin.weight = nn.Parameter(rand(4, 4))  # a replaced parameter
        check()
        m.load_state_dict(Hooked().to(DEVICE).state_dict())  # new values in place
        check(), check()


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("log_scale", torch.zeros(4))
        self.temperature = 1.0

    def forward(self, x):
        return x * self.log_scale.exp() / self.temperature


def test_values_from_buffers_and_attributes_are_not_baked_in():
    m = Scaled().to(DEVICE)
    c = fxlite.compile(m)
    x = rand(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x))
        torch.testing.assert_close(c(x), m(x))
        m.log_scale.fill_(1.0)
        torch.testing.assert_close(c(x), m(x))
        m.temperature = 3.0
        torch.testing.assert_close(c(x), m(x))
        torch.testing.assert_close(c(x), m(x))


def test_closure_values_are_guarded():
    scale = 2.0

    def f(x):
        return x * scale

    c = fxlite.compile(f)
    x = rand(3)
    torch.testing.assert_close(c(x), f(x))
    scale = 5.0  # noqa: F841  (rebinding the cell f reads)
    torch.testing.assert_close(c(x), f(x))


def test_a_parameter_unfrozen_after_the_first_call_gets_its_gradient():
    m = nn.Linear(4, 4).to(DEVICE)
    m.weight.requires_grad_(False)
    c = fxlite.compile(m)
    x = rand(2, 4)
    c(x).sum().backward()
    c(x).sum().backward()
    assert m.weight.grad is None
    m.weight.requires_grad_(True)
    c(x).sum().backward()
    ref = nn.Linear(4, 4).to(DEVICE)
    ref.load_state_dict(m.state_dict())
    ref(x).sum().backward()
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)


def test_a_tensor_requiring_grad_inside_a_dict_keeps_autograd():
    c = fxlite.compile(lambda d: (d["a"] * 2).sum())
    c({"a": rand(3)})
    c({"a": rand(3)})
    a = rand(3).requires_grad_()
    c({"a": a}).backward()
    torch.testing.assert_close(a.grad, torch.full_like(a, 2.0))


# ------------------------------------------------------------------ randomness
def test_random_ops_draw_new_numbers_on_every_call():
    c = fxlite.compile(lambda x: x + torch.randn(4, device=x.device))
    outs = [c(torch.zeros(4, device=DEVICE)) for _ in range(3)]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    g = fxlite.compile(lambda x: torch.rand_like(x) * x)
    outs = [g(torch.ones(4, device=DEVICE)) for _ in range(3)]
    assert not torch.equal(outs[1], outs[2])


def test_random_ops_follow_the_seed_as_eager_does():
    def noisy(x):
        return F.dropout(x, 0.5, training=True) + torch.rand_like(x)

    same_as_eager(noisy, repeat((rand(4, 8),), n=4))


def test_guards_see_changes_made_through_module_methods_only_then_walk():
    # The per-call state check walks the modules only after nn.Module's own methods changed
    # one (an epoch counter); flags that change without a setattr are read every call.
    from fxlite.codegen.capture.guards import StateGuard

    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    guard = StateGuard(m)
    first = guard.key()
    assert guard.key() == first
    changes = [lambda: m.train(not m.training),
               lambda: m[0].weight.requires_grad_(not m[0].weight.requires_grad),
               lambda: setattr(m[1], "eps", m[1].eps * 2),
               lambda: m[0].register_forward_hook(lambda *a: None).remove(),
               lambda: setattr(m[0], "added_later", 1.0)]
    for change in changes:
        before = guard.key()
        change()
        assert guard.key() != before or change is changes[3]  # a removed hook: back as before


def test_a_guard_key_stays_small_and_a_state_seen_before_gives_its_key_back():
    """The walk of a model's modules is a token in the key (hashing the walk itself took
    10 us a call for a 64-module model): equal states, equal keys, even after a change
    and its undoing; a new state, a new key."""
    from fxlite.codegen.capture.guards import StateGuard

    m = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(40)])
    guard = StateGuard(m)
    first = guard.key()
    assert len(repr(first)) < 1500  # not the walk: 80 modules, each with a dozen entries
    m[3][1].momentum = 0.5
    changed = guard.key()
    assert changed != first
    m[3][1].momentum = 0.1  # back as it was
    assert guard.key() == first and hash(guard.key()) == hash(first)
    m[3][1].momentum = 0.5
    assert guard.key() == changed


def test_an_op_that_raises_raises_once_with_eagers_exception():
    # The op's own exception reaches the caller as eager's, on every call; before, the
    # recorder took it for its own failure and ran the op again (a second backward, which
    # raised "backward through the graph a second time" instead).
    def f(x, log):
        y = x.sigmoid()
        y.mul_(2)  # sigmoid saved its output: the backward below raises
        log.append("ran")
        y.sum().backward()

    compiled = fxlite.compile(f)
    for _ in range(3):
        messages = []
        for fn in (f, compiled):
            log = []
            with pytest.raises(RuntimeError) as info:
                fn(rand(4, 8).requires_grad_(), log)
            messages.append(str(info.value).split(":")[0])
            assert log == ["ran"]
        assert messages[0] == messages[1], messages


class _NormThenSvd(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))

    def forward(self, x):
        y = F.batch_norm(x, self.mean, self.var, training=True, momentum=0.1)
        return torch.norm(y, p="nuc", dim=(-2, -1))  # an SVD: raises for an inf


def test_running_stats_updated_before_a_later_op_raises_are_kept():
    # Fuzz seed 7702840: eager updates the running statistics, then the SVD raises. The
    # compiled call moved the update to the end of its graph and, as the SVD raised
    # first, lost it: the buffers differed on every later call.
    eager = _NormThenSvd()
    compiled_module = copy.deepcopy(eager)
    compiled = fxlite.compile(compiled_module)
    good = rand(3, 3)
    bad = good.clone()
    bad[0, 0] = float("inf")
    for x in (good, bad, good, bad):
        outcomes = []
        for fn in (eager, compiled):
            try:
                fn(x.clone())
                outcomes.append(None)
            except Exception as e:
                outcomes.append(type(e))
        assert outcomes[0] == outcomes[1]
        torch.testing.assert_close(compiled_module.mean, eager.mean, equal_nan=True)
        torch.testing.assert_close(compiled_module.var, eager.var, equal_nan=True)


def _raised(f, args, catch):
    """The exception of class ``catch`` that ``f(*args)`` raised, or None."""
    try:
        f(*args)
    except catch as e:
        return e
    return None


def _unused_index(x, idx):
    x[idx]  # unused: eager raises IndexError for an index out of range
    return x * 2


def _unused_index_written(x, idx):
    v = x[idx]  # a copy (an index tensor), written in place and read by nothing else
    v.relu_()
    return x * 2


def _unused_fmod(a, b):
    a.fmod(b)  # unused: eager raises for an integer division by zero
    return a + 1


def _read_for_its_layout(a, b):
    # fuzz seed 7731249: the division's values reach only new_zeros, which reads a layout
    v = torch.div(b, a, rounding_mode="trunc").tanh() + 2
    return v.new_zeros(v.shape[-1:]) + 1


@pytest.mark.parametrize("fn, good, bad", [
    (_read_for_its_layout, lambda: (torch.tensor([1, 2, 3, 4], device=DEVICE),
                                    torch.tensor(5, device=DEVICE)),
     lambda: (torch.tensor([1, 0, 3, 4], device=DEVICE), torch.tensor(5, device=DEVICE))),
    (_unused_index, lambda: (rand(4, 8), torch.tensor([1], device=DEVICE)),
     lambda: (rand(4, 8), torch.tensor([7], device=DEVICE))),
    (_unused_index_written, lambda: (rand(4, 8), torch.tensor([1], device=DEVICE)),
     lambda: (rand(4, 8), torch.tensor([7], device=DEVICE))),
    (_unused_fmod, lambda: (torch.arange(4, device=DEVICE),
                            torch.tensor([1, 2, 3, 4], device=DEVICE)),
     lambda: (torch.arange(4, device=DEVICE), torch.tensor([1, 0, 3, 4], device=DEVICE))),
], ids=["layout_only", "index", "index_written", "fmod"])
def test_an_unused_op_that_raises_raises_as_in_eager(fn, good, bad):
    # Fuzz seed 7604534 and session 30's probe: dead-code elimination dropped the op and
    # its error; such ops are kept as checks, and the good calls still run kernels.
    if DEVICE == "cuda":
        pytest.skip("an index out of range is a device-side assert on CUDA")
    compiled = fxlite.compile(fn)
    for make in (good, bad, good, bad):
        args = make()
        outcomes = [None if e is None else type(e)
                    for e in (_raised(f, args, Exception) for f in (fn, compiled))]
        assert outcomes[0] == outcomes[1], outcomes
        if outcomes[0] is None:
            assert compiled.kernels


def _unused_reshape(x, y):
    x.reshape(9, 1)  # unused: eager raises at any size but 9 elements
    return x.sin()


def _unused_add(x, y):
    x + y  # unused: eager raises where the sizes do not broadcast
    return x.cos() * 2


def _unused_reshape_written(x, y):
    v = x.t().reshape(9, 1)  # a copy (x.t() is not contiguous), written in place only
    v.relu_()
    return x.sin()


@pytest.mark.parametrize("fn", [_unused_reshape, _unused_add, _unused_reshape_written])
def test_an_unused_op_of_the_inputs_raises_at_new_sizes_as_in_eager(fn):
    # Fuzz seed 8516201: a recording that reads no size serves every size, and dead-code
    # elimination had dropped the op whose error the new sizes raise in eager (there, a
    # reshape whose copy only an in-place relu_ read, which functionalize makes pure). A
    # recording with an unused op of its inputs is now one per size; calls of the first
    # size still run kernels.
    compiled = fxlite.compile(fn)
    for shape in ((3, 3), (3, 3), (3, 3), (3, 5), (3, 3), (4, 2)):
        args = (rand(*shape), rand(3, 3))
        outcomes = [None if e is None else str(e)
                    for e in (_raised(f, args, RuntimeError) for f in (fn, compiled))]
        assert outcomes[0] == outcomes[1], (shape, outcomes)
        if shape == (3, 3):
            assert outcomes[0] is None and compiled.kernels
    assert outcomes[0] is not None  # (4, 2) raises in both
