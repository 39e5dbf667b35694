"""Messages a new user meets first: what symbolic_trace says about a wrong kind of root."""

import traceback

import pytest
import torch

import fxlite as fx


def test_symbolic_trace_of_a_module_class_says_build_it_first():
    with pytest.raises(TypeError) as info:
        fx.symbolic_trace(torch.nn.Linear)
    assert str(info.value) == ("symbolic_trace got the module class Linear, not an instance: "
                               "build it first, e.g. symbolic_trace(Linear(...))")


def test_symbolic_trace_of_a_plain_class_names_what_it_traces():
    class Point:
        pass

    with pytest.raises(TypeError, match=r"got the class .*Point; it traces an nn.Module instance"):
        fx.symbolic_trace(Point)


@pytest.mark.parametrize("value, shown", [(42, "int (42)"), ("a" * 80, "str ('aaaa")])
def test_symbolic_trace_of_a_non_callable_says_so_briefly(value, shown):
    with pytest.raises(TypeError) as info:
        fx.symbolic_trace(value)
    message = str(info.value)
    assert message.startswith(f"symbolic_trace expects an nn.Module or a function, not {shown}")
    assert len(message) < 120
    # The traceback stops at the check: a few library frames, not a trip through inspect.
    frames = traceback.extract_tb(info.value.__traceback__)
    assert len(frames) <= 4
    assert not any("inspect" in f.filename for f in frames)


def test_subpackages_are_attributes_of_fxlite():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import fxlite as fx; print(fx.passes.diff.__module__, fx.logs.__name__, "
            "fx.rewrite.explain_no_match.__name__)")
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": ""}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["fxlite.passes.diff", "fxlite.logs", "explain_no_match"]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fx.nope  # noqa: B018
