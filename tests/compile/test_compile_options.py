"""``fxlite.compile`` takes ``torch.compile``'s whole signature (issue 39), and the
``torch.compiler`` helpers have fxlite counterparts: ``fxlite.reset``,
``fxlite.compiler.disable`` and ``fxlite.compiler.is_compiling``; ``fxlite.explain``
takes both of ``torch._dynamo.explain``'s forms; ``fxlite.export`` blames no
``fullgraph``; kernels of one compiled function never share a name.

Every compiled result is compared with eager over several calls with fresh inputs.
"""

from __future__ import annotations

import copy
import inspect
import os
import warnings

import pytest
import torch

if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from fxlite.codegen import compile as compile_mod
from fxlite.codegen.options import OPTIONS, resolve

import fxlite

pytest.importorskip("triton")

# Masked lanes of the interpreter compute on padding (log(0), x / 0): harmless, but noisy.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(compile_mod, "_warned", set())


def relu_add_mul(x):
    return torch.relu(x + 1) * 2


def calls(compiled, fn, *shapes, times=3):
    """Call ``compiled`` and ``fn`` on fresh inputs ``times`` times; assert equal."""
    for _ in range(times):
        args = [torch.randn(*s) for s in shapes]
        torch.testing.assert_close(compiled(*args), fn(*args))


def fxlite_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "fxlite" in str(w.message)]


# ------------------------------------------------------------------ the signature
def test_signature_is_torch_compiles():
    ours = inspect.signature(fxlite.compile).parameters
    theirs = inspect.signature(torch.compile).parameters
    names = list(theirs)[1:]  # the first is fn / model; an older torch has fewer
    assert [n for n in ours if n in names] == names
    for name, p in list(theirs.items())[1:]:
        assert ours[name].kind == p.kind, name
        if name != "backend":  # fxlite's default backend is its own
            assert ours[name].default == p.default, name


BAD = {
    "fullgraph": (dict(fullgraph="yes"), TypeError, "fullgraph must be True or False"),
    "dynamic": (dict(dynamic="maybe"), TypeError, "dynamic must be None, True or False"),
    "backend": (dict(backend="bogus"), ValueError, "unknown backend 'bogus'"),
    "backend type": (dict(backend=3), ValueError, "backend must be a name or a callable"),
    "mode": (dict(mode="fastest"), ValueError, "unknown mode 'fastest'"),
    "options key": (dict(options={"bogus_knob": True}), ValueError,
                    "unknown option 'bogus_knob'"),
    "options value": (dict(options={"max_autotune": "yes"}), TypeError,
                      "option 'max_autotune' must be True or False"),
    "options type": (dict(options=["max_autotune"]), TypeError, "options must be a dict"),
    "mode and options": (dict(mode="max-autotune", options={"max_autotune": True}),
                         ValueError, "mode or options, not both"),
    "both knobs": (dict(options={"triton.cudagraphs": True, "max_autotune": True}),
                   ValueError, "cannot be combined yet"),
    "name": (dict(name=3), TypeError, "name must be a str or None"),
    "disable": (dict(disable="no"), TypeError, "disable must be True or False"),
    "recompile_limit": (dict(recompile_limit=-1), TypeError, "recompile_limit must be"),
    "isolate_recompiles": (dict(isolate_recompiles=None), TypeError,
                           "isolate_recompiles must be True or False"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_argument_is_one_clear_line(case):
    kwargs, error, text = BAD[case]
    for form in (lambda: fxlite.compile(relu_add_mul, **kwargs),
                 lambda: fxlite.compile(**kwargs)):  # the decorator form fails at once too
        with pytest.raises(error) as info:
            form()
        message = str(info.value)
        assert text in message and "\n" not in message, message


def test_unknown_option_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        fxlite.compile(relu_add_mul, options={"epilogue_fusion": True})
    for key in OPTIONS:
        assert repr(key) in str(info.value)


def test_unknown_backend_lists_dynamos_names():
    with pytest.raises(ValueError) as info:
        fxlite.compile(relu_add_mul, backend="bogus")
    assert "inductor" in str(info.value) and "aot_eager" in str(info.value)


# ------------------------------------------------------------------ what each does
def test_disable_and_eager_return_the_function_itself():
    assert fxlite.compile(relu_add_mul, disable=True) is relu_add_mul
    assert fxlite.compile(disable=True)(relu_add_mul) is relu_add_mul
    assert fxlite.compile(relu_add_mul, backend="eager") is relu_add_mul
    module = torch.nn.Linear(2, 2)
    assert fxlite.compile(module, backend="eager") is module


@pytest.mark.parametrize("dynamic", [None, True, False])
def test_dynamic_is_accepted_and_sizes_may_change(dynamic):
    c = fxlite.compile(relu_add_mul, dynamic=dynamic)
    for n in (3, 5, 8):
        calls(c, relu_add_mul, (n, 4), times=2)
    assert c.kernels and not c.fallbacks


def test_modes_and_options_map_to_fxlites_modes():
    assert resolve(relu_add_mul, mode="max-autotune-no-cudagraphs").mode == "max-autotune"
    assert resolve(relu_add_mul, mode="max-autotune").mode == "max-autotune"
    assert resolve(relu_add_mul, mode="default").mode is None
    assert resolve(relu_add_mul, options={"triton.cudagraphs": True}).mode == "reduce-overhead"
    assert resolve(relu_add_mul, options={"max_autotune": True}).mode == "max-autotune"
    assert resolve(relu_add_mul, options={"max_autotune_pointwise": True}).mode == \
        "max-autotune"
    assert resolve(relu_add_mul, options={"triton.cudagraphs": False}).mode is None
    assert resolve(relu_add_mul, backend="fxlite").backend == "triton"
    assert resolve(relu_add_mul, backend=None).backend == "triton"


@pytest.mark.parametrize("how", [dict(mode="max-autotune-no-cudagraphs"),
                                 dict(options={"triton.cudagraphs": True}),
                                 dict(name="region", isolate_recompiles=True, shapes_spec=None)])
def test_modes_and_options_compile_and_equal_eager(how):
    c = fxlite.compile(relu_add_mul, **how)
    calls(c, relu_add_mul, (4, 8))
    assert len(c.kernels) == 1 and not c.fallbacks


def test_recompile_limit_is_the_compiled_functions():
    c = fxlite.compile(relu_add_mul, recompile_limit=1)
    assert c.recompile_limit == 1
    calls(c, relu_add_mul, (4,))  # one key: recorded once, then replayed
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        x = torch.randn(2, 3, dtype=torch.float64)  # a new key, past the limit
        torch.testing.assert_close(c(x), relu_add_mul(x))
    assert any("recorded 1 times (recompile_limit)" in m for m in fxlite_warnings(record))


def test_a_dynamo_backend_gets_each_segment():
    c = fxlite.compile(relu_add_mul, backend="aot_eager")
    calls(c, relu_add_mul, (4, 8))
    assert c.fallbacks == []


def test_a_dynamo_backend_that_cannot_take_a_segment_falls_back_with_a_clear_warning():
    c = fxlite.compile(relu_add_mul, backend="relu_compile_error_TESTING_ONLY")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        calls(c, relu_add_mul, (4, 8))
    said = fxlite_warnings(record)
    assert len(said) == 1, said
    assert "backend 'relu_compile_error_TESTING_ONLY' cannot compile fxlite's segment graph" \
        in said[0] and "runs in eager PyTorch" in said[0]


# ------------------------------------------------------------------ fxlite.reset
def test_reset_drops_recordings_and_the_function_records_again():
    seen = []

    def counting(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    c = fxlite.compile(relu_add_mul, backend=counting)
    module = fxlite.compile(torch.nn.Linear(4, 4), backend=counting)
    calls(c, relu_add_mul, (4, 8))
    x = torch.randn(2, 4)
    module(x)
    module(x)
    assert len(seen) == 2
    fxlite.reset()
    calls(c, relu_add_mul, (4, 8))
    torch.testing.assert_close(module(x), module._orig_mod(x))
    assert len(seen) == 4  # each recorded (and compiled) once more, then replayed
    assert fxlite.compiler.reset is fxlite.reset


def test_reset_keeps_what_compile_set():
    c = fxlite.compile(relu_add_mul, recompile_limit=2, mode="max-autotune-no-cudagraphs")
    calls(c, relu_add_mul, (4,))
    fxlite.reset()
    assert c.recompile_limit == 2 and c._mode == "max-autotune" and c.__name__ == "relu_add_mul"
    calls(c, relu_add_mul, (4,))
    twin = copy.deepcopy(c)  # (a copy compiles with the same arguments: reset kept them)
    assert twin.recompile_limit == 2 and twin._mode == "max-autotune"


# ------------------------------------------------------------------ fxlite.compiler
def test_disabled_function_runs_eagerly_on_every_call_inside_a_compiled_one():
    log = []

    @fxlite.compiler.disable
    def note(x):
        log.append(float(x.sum()))
        return x * 3

    def f(x):
        return torch.relu(note(x + 1)) * 2

    c = fxlite.compile(f)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i in range(3):
            x = torch.randn(5)
            torch.testing.assert_close(c(x), f(x))
            assert len(log) == 2 * (i + 1)  # once for c, once for f, every call
            assert log[-1] == log[-2]
    said = fxlite_warnings(record)
    assert len(said) == 1 and "calls test_disabled_function_runs_eagerly_on_every_call_" \
        "inside_a_compiled_one.<locals>.note, which fxlite.compiler.disable keeps out" in said[0]
    assert fxlite.compile(note) is note  # compiling it gives it back
    assert note.__name__ == "note"


def test_disable_with_arguments_as_torchs():
    @fxlite.compiler.disable(recursive=False, reason="logs")
    def g(x):
        return x + 1

    assert g._fxlite_disabled and fxlite.compiler.disable(g) is g
    c = fxlite.compile(lambda x: g(x) * 2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        calls(c, lambda x: (x + 1) * 2, (3,))
    assert any("(logs)" in m for m in fxlite_warnings(record))


def test_is_compiling_while_fxlite_records():
    seen = []

    def f(x):
        seen.append(fxlite.compiler.is_compiling())
        return x + 1

    assert not fxlite.compiler.is_compiling()
    c = fxlite.compile(f, backend="python")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # appending to a list: f runs eagerly afterwards
        c(torch.randn(3))
        c(torch.randn(3))
    assert seen[0] is True and not fxlite.compiler.is_compiling()
    f(torch.randn(3))
    assert seen[-1] is False


# ------------------------------------------------------------------ explain, export
def bar(a, b):
    x = a / (torch.abs(a) + 1)
    if b.sum() < 0:
        b = b * -1
    return x * b


def test_explain_takes_both_forms():
    a, b = torch.randn(10), torch.randn(10)
    one = fxlite.explain(bar)(a, b)
    two = fxlite.explain(bar, a, b)
    for report in (one, two):
        assert report.graph_count == 2 and report.graph_break_count == 1
        assert report.break_reasons[0].source == "if b.sum() < 0:"
    assert fxlite.explain(lambda: torch.ones(2) + 1)().graph_count == 1
    assert fxlite.explain(torch.nn.Linear(3, 3))(torch.randn(2, 3)).graph_count == 1


def test_export_blames_no_fullgraph():
    with pytest.raises(fxlite.TraceError) as info:
        fxlite.export(bar, torch.randn(3), torch.randn(3))
    text = str(info.value)
    assert "fullgraph" not in text and text.startswith("export: the function reads a tensor's")
    assert "if b.sum() < 0:" in text
    with pytest.raises(fxlite.TraceError, match=r"^fullgraph=True, but the function reads"):
        fxlite.compile(bar, fullgraph=True)(torch.randn(3), torch.randn(3))


# ------------------------------------------------------------------ names and messages
def test_kernels_of_one_function_have_distinct_names():
    c = fxlite.compile(bar)
    for _ in range(3):
        a, b = torch.randn(10), -torch.rand(10) - 0.1
        torch.testing.assert_close(c(a, b), bar(a, b))
    names = [k.name for k in c.kernels]
    assert len(names) == 3 and len(set(names)) == 3, names
    assert names[0] == "triton_fused_0" and names[-1].startswith("triton_seg1_")


def test_a_call_fxlite_cannot_record_is_worded_as_a_sentence(monkeypatch):
    from fxlite.codegen.capture.recorder import Recorder

    def broken(self, func, args, kwargs):
        raise KeyError("no record for it")

    monkeypatch.setattr(Recorder, "_record", broken)
    c = fxlite.compile(relu_add_mul)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        calls(c, relu_add_mul, (4,))
    said = fxlite_warnings(record)
    assert said and "runs in eager PyTorch: it calls" in said[0]
    assert "which fxlite could not record (KeyError" in said[0]
    assert "it fxlite" not in said[0]
