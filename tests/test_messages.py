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
