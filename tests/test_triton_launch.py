"""The direct-launch and binary-index machinery, checked without a GPU.

On the GPU these paths are exercised end to end by the ``gpu`` tests in
tests/test_compile.py; here a recording stand-in replaces the compiled binary.
"""

from __future__ import annotations

import torch
from fxlite.codegen.triton_binaries import binary_key
from fxlite.codegen.triton_launch import _DirectLaunch, _fingerprint


def _launch(structure: str, results: list, template: list, slots: list) -> tuple[_DirectLaunch, list]:
    calls: list[tuple] = []
    d = _DirectLaunch()
    d.run = lambda *a: calls.append(a)
    d.function, d.packed, d.hooks, d.compiled = "function", "packed", (None, None), None
    d.grid, d.device, d.stream_of = (8, 1, 1), 0, lambda device: 1234
    d.template, d.tensor_slots = template, slots
    d.out_specs = [((4,), torch.float32, torch.device("cpu"))]
    d.results, d.structure = results, structure
    d.fast = d._generate()
    return d, calls


def test_generated_launcher_passes_current_inputs_and_fresh_outputs() -> None:
    x, y = torch.randn(4), torch.randn(4)
    d, calls = _launch("single", [("out", 0)], [x, None, 1024, 7, 2.5, float("inf")],
                       [(0, "in", 0), (1, "out", 0), (4, "in", 1)])
    first = d.fast([x, 0.5])
    second = d.fast([y, 1.5])
    assert first is not second and first.shape == (4,)
    grid_and_handles = calls[0][:9]
    assert grid_and_handles == (8, 1, 1, 1234, "function", "packed", None, None, None)
    # inputs and scalars come from the call, outputs are new, the rest is fixed
    assert calls[0][9] is x and calls[0][10] is first and calls[0][13] == 0.5
    assert calls[1][9] is y and calls[1][10] is second and calls[1][13] == 1.5
    assert calls[0][11:13] == (1024, 7) and calls[0][14] == float("inf")


def test_generated_launcher_returns_the_group_structure() -> None:
    x = torch.randn(4)
    d, _ = _launch("tuple", [("out", 0), ("in", 0)], [x, None], [(0, "in", 0), (1, "out", 0)])
    out, same = d.fast([x])
    assert same is x and out.shape == (4,)


def test_hooks_take_the_general_path() -> None:
    class Chain:  # Triton's HookChain: a non-empty chain wants every launch
        calls = [lambda *a: None]

    x = torch.randn(4)
    d, calls = _launch("single", [("out", 0)], [x, None], [(0, "in", 0), (1, "out", 0)])
    d.hooks = (Chain(), Chain())
    d.compiled = type("K", (), {"launch_metadata": lambda self, *a: "meta"})()
    d.fast = d._generate()
    d.fast([x])
    assert calls[0][6] == "meta" and isinstance(calls[0][7], Chain)


def test_fingerprint_tracks_what_specialization_depends_on() -> None:
    x = torch.randn(8, 8)
    assert _fingerprint([x, 1.0]) == _fingerprint([torch.randn(8, 8), 2.0])
    assert _fingerprint([x]) != _fingerprint([x.t()])           # strides
    assert _fingerprint([x]) != _fingerprint([torch.randn(8, 9)])  # sizes
    assert _fingerprint([x.flatten()[1:]]) != _fingerprint([x.flatten()[:-1]])  # alignment
    assert _fingerprint([x, 5]) == _fingerprint([x, 6])
    assert _fingerprint([x, 5]) != _fingerprint([x, 2**40])     # 32- vs 64-bit int


def test_binary_key_changes_with_specialization_not_with_float_values() -> None:
    x = torch.randn(64)
    base = binary_key("src", "pointwise", [x, 64, 0.5], {"BLOCK": 1024}, 4)
    assert base == binary_key("src", "pointwise", [torch.randn(64), 64, 1.5], {"BLOCK": 1024}, 4)
    assert base != binary_key("src", "pointwise", [x, 65, 0.5], {"BLOCK": 1024}, 4)
    assert base != binary_key("src", "pointwise", [x[1:], 64, 0.5], {"BLOCK": 1024}, 4)
    assert base != binary_key("src", "pointwise", [x, 64, 0.5], {"BLOCK": 512}, 4)
    assert base != binary_key("src", "pointwise", [x, 64, 0.5], {"BLOCK": 1024}, 8)
    assert base != binary_key("src2", "pointwise", [x, 64, 0.5], {"BLOCK": 1024}, 4)
