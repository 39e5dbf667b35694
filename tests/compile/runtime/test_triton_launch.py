"""The direct-launch and binary-index machinery, checked without a GPU.

On the GPU these paths are exercised end to end by the ``gpu`` tests in
tests/compile/test_compile_gpu.py; here a recording stand-in replaces the compiled binary.
"""

from __future__ import annotations

import pytest
import torch
from fxlite.codegen.runtime.binaries import binary_key
from fxlite.codegen.runtime.launch import (
    Binary,
    DirectLaunch,
    GroupResult,
    TensorSlot,
    fingerprint,
)


class _Compiled:
    """Stands in for Triton's CompiledKernel: records launches through its launcher."""

    def __init__(self, calls: list) -> None:
        self.function, self.packed_metadata, self.calls = "function", "packed", calls

    def run(self, *args: object) -> None:
        self.calls.append(("triton-launcher",) + args)

    def __getitem__(self, grid: tuple):  # Triton's own launch path, hooks and all
        return lambda *args: self.calls.append(("triton", grid) + args)


class _StaticStandIn:
    """Stands in for torch's static launcher with a kernel of params (x, out, n, BLOCK)."""

    keep, extra, num_warps, shared, codes = [0, 1, 2], 1, 4, 0, "OOiO"

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def launch_kernel(self, *args: object) -> None:
        self.calls.append(("static",) + args)

    def function(self, device: int) -> str:
        return f"function{device}"

    def arguments(self, values):
        return tuple(values[i] for i in self.keep) + (None,) * self.extra


def _launch(structure: str, results: list[GroupResult], template: list,
            slots: list[TensorSlot], static: bool = False) -> tuple[DirectLaunch, list]:
    calls: list[tuple] = []
    binary = object.__new__(Binary)
    binary.compiled, binary.checked, binary.key = _Compiled(calls), False, "k"
    binary.static = _StaticStandIn(calls) if static else None
    d = DirectLaunch()
    d.binary, d.hooks = binary, (None, None)
    d.grid, d.device, d.stream_of = (8, 1, 1), 0, lambda device: 1234
    d.template, d.tensor_slots = template, slots
    d.out_specs = [((4,), (1,), torch.float32, torch.device("cpu"))]
    d.results, d.structure = results, structure
    d.fast = d._generate()
    return d, calls


def test_generated_launcher_passes_current_inputs_and_fresh_outputs() -> None:
    x, y = torch.randn(4), torch.randn(4)
    d, calls = _launch("single", [GroupResult("out", 0)], [x, None, 1024, 7, 2.5, float("inf")],
                       [TensorSlot(0, "in", 0), TensorSlot(1, "out", 0), TensorSlot(4, "in", 1)])
    first = d.fast([x, 0.5])
    second = d.fast([y, 1.5])
    assert first is not second and first.shape == (4,)
    grid_and_handles = calls[0][1:10]
    assert grid_and_handles == (8, 1, 1, 1234, "function", "packed", None, None, None)
    # inputs and scalars come from the call, outputs are new, the rest is fixed
    assert calls[0][10] is x and calls[0][11] is first and calls[0][14] == 0.5
    assert calls[1][10] is y and calls[1][11] is second and calls[1][14] == 1.5
    assert calls[0][12:14] == (1024, 7) and calls[0][15] == float("inf")


def test_generated_launcher_allocates_outputs_in_their_layout() -> None:
    """A kernel run in its inputs' memory order returns permuted (channels-last) outputs:
    the prepared launch allocates them with those strides, not contiguous."""
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    d, calls = _launch("single", [GroupResult("out", 0)], [x, None, 1024],
                       [TensorSlot(0, "in", 0), TensorSlot(1, "out", 0)])
    d.out_specs = [(tuple(x.shape), x.stride(), x.dtype, x.device)]
    d.fast = d._generate()
    out = d.fast([x])
    assert out.shape == x.shape and out.stride() == x.stride()
    assert d([x]).stride() == x.stride()  # the general launch too


def test_generated_static_launch_passes_only_runtime_arguments(monkeypatch) -> None:
    import fxlite.codegen.runtime.launch as launch_mod

    monkeypatch.setattr(launch_mod, "_hooks", lambda: (None, None))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234,
                        raising=False)
    x, y = torch.randn(4), torch.randn(4)
    d, calls = _launch("single", [GroupResult("out", 0)], [x, None, 1024, 256],
                       [TensorSlot(0, "in", 0), TensorSlot(1, "out", 0)], static=True)
    first = d.fast([x])
    d.fast([y])
    # function, grid, warps, shared memory, codes, arguments (constexpr BLOCK dropped,
    # a null scratch pointer added), stream
    assert calls[0][:8] == ("static", "function0", 8, 1, 1, 4, 0, "OOiO")
    assert calls[0][8][0] is x and calls[0][8][1] is first and calls[0][8][2:] == (1024, None)
    assert calls[0][9] == 1234 and calls[1][8][0] is y
    general = d([x])  # the general path launches the same way
    assert calls[2][:8] == calls[0][:8] and calls[2][8][0] is x and calls[2][8][1] is general


def test_outputs_without_the_allocator_use_empty_strided(monkeypatch) -> None:
    """Where torch has no argument-free allocator for the device."""
    import fxlite.codegen.runtime.launch as launch_mod

    monkeypatch.setattr(launch_mod, "_ALLOCATE", {})
    x = torch.randn(4)
    d, calls = _launch("single", [GroupResult("out", 0)], [x, None],
                       [TensorSlot(0, "in", 0), TensorSlot(1, "out", 0)])
    out = d.fast([x])
    assert out.shape == x.shape and out.stride() == x.stride() and out is not x
    assert calls[0][11] is out


def test_outputs_use_the_allocator_without_argument_parsing(monkeypatch) -> None:
    """Each output comes from torch's ``_empty_strided_<device>`` (inductor's allocator),
    in its layout, fresh on every call; on CUDA only while the current device is the
    outputs' (it allocates there), the general launch otherwise."""
    import fxlite.codegen.runtime.launch as launch_mod

    made, tensors = [], []

    def allocate(shape, stride, dtype):
        made.append((shape, stride, dtype))
        tensors.append(torch.empty_strided(shape, stride, dtype=dtype))
        return tensors[-1]

    monkeypatch.setattr(launch_mod, "_ALLOCATE", {"cpu": allocate, "cuda": allocate})
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    d, calls = _launch("tuple", [GroupResult("out", 0), GroupResult("out", 1)], [x, None, None],
                       [TensorSlot(0, "in", 0), TensorSlot(1, "out", 0), TensorSlot(2, "out", 1)])
    d.out_specs = [(tuple(x.shape), x.stride(), x.dtype, x.device),
                   ((3,), (1,), torch.int64, x.device)]
    d.fast = d._generate()
    first, second = d.fast([x]), d.fast([x])
    assert made == [((2, 3, 4, 5), x.stride(), torch.float32), ((3,), (1,), torch.int64)] * 2
    assert len(tensors) == 4 and all(a is b for a, b in zip([*first, *second], tensors))
    assert first[0].stride() == x.stride() and first[1].dtype == torch.int64
    assert calls[0][11] is first[0] and calls[1][11] is second[0]
    # CUDA outputs: the current device is checked first
    monkeypatch.setattr(launch_mod.DirectLaunch, "__call__", lambda self, inputs: "general")
    d, calls = _launch("single", [GroupResult("out", 0)], [x, None],
                       [TensorSlot(0, "in", 0), TensorSlot(1, "out", 0)])
    d.out_specs = [((4,), (1,), torch.float32, torch.device("cuda", 1))]
    for current, want in ((0, "general"), (1, None)):
        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda c=current: c, raising=False)
        d.fast = d._generate()
        out = d.fast([x])
        assert out == "general" if want else out is tensors[-1] and calls[-1][11] is out
    assert made[4:] == [((4,), (1,), torch.float32)]


def test_generated_launcher_returns_the_group_structure() -> None:
    x = torch.randn(4)
    d, _ = _launch("tuple", [GroupResult("out", 0), GroupResult("in", 0)], [x, None],
                   [TensorSlot(0, "in", 0), TensorSlot(1, "out", 0)])
    out, same = d.fast([x])
    assert same is x and out.shape == (4,)


def test_hooks_take_the_general_path(monkeypatch) -> None:
    class Chain:  # Triton's HookChain: a non-empty chain wants every launch
        calls = [lambda *a: None]

    import fxlite.codegen.runtime.launch as launch_mod

    monkeypatch.setattr(launch_mod, "_hooks", lambda: (Chain(), Chain()))
    x = torch.randn(4)
    for static in (False, True):
        d, calls = _launch("single", [GroupResult("out", 0)], [x, None, 1024, 256],
                           [TensorSlot(0, "in", 0), TensorSlot(1, "out", 0)], static=static)
        d.hooks = (Chain(), Chain())
        d.fast = d._generate()
        d.fast([x])
        assert calls[0][:2] == ("triton", (8, 1, 1)) and calls[0][2] is x


def testfingerprint_tracks_what_specialization_depends_on() -> None:
    x = torch.randn(8, 8)
    assert fingerprint([x, 1.0]) == fingerprint([torch.randn(8, 8), 2.0])
    assert fingerprint([x]) != fingerprint([x.t()])           # strides
    assert fingerprint([x]) != fingerprint([torch.randn(8, 9)])  # sizes
    assert fingerprint([x.flatten()[1:]]) != fingerprint([x.flatten()[:-1]])  # alignment
    assert fingerprint([x, 5]) == fingerprint([x, 6])
    assert fingerprint([x, 5]) != fingerprint([x, 2**40])     # 32- vs 64-bit int


def test_binary_key_changes_with_specialization_not_with_float_values() -> None:
    x = torch.randn(64)
    base = binary_key("src", "pointwise", [x, 64, 0.5], {"BLOCK": 1024}, 4)
    assert base == binary_key("src", "pointwise", [torch.randn(64), 64, 1.5], {"BLOCK": 1024}, 4)
    assert base != binary_key("src", "pointwise", [x, 65, 0.5], {"BLOCK": 1024}, 4)
    assert base != binary_key("src", "pointwise", [x[1:], 64, 0.5], {"BLOCK": 1024}, 4)
    assert base != binary_key("src", "pointwise", [x, 64, 0.5], {"BLOCK": 512}, 4)
    assert base != binary_key("src", "pointwise", [x, 64, 0.5], {"BLOCK": 1024}, 8)
    assert base != binary_key("src2", "pointwise", [x, 64, 0.5], {"BLOCK": 1024}, 4)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_same_values_compares_in_slices_and_finds_one_differing_element(monkeypatch, layout):
    # The direct launch's check compares its output with the general launch's a slice of
    # memory at a time (a whole-tensor comparison made a temporary of the output's size).
    import fxlite.codegen.runtime.launch as launch

    monkeypatch.setattr(launch, "_SLICE", 64)  # many slices on a small tensor
    compares = []
    real = launch._same
    monkeypatch.setattr(launch, "_same", lambda a, b: compares.append(a.numel()) or real(a, b))
    x = torch.randn(2, 8, 6, 5)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = x[:, ::2]  # not dense: sliced as views all the same
    x[0, 0, 0, 0] = float("nan")
    y = x.clone(memory_format=torch.preserve_format)
    assert launch.same_values(x, y)
    assert len(compares) > 1 and max(compares) <= 64
    y[1, 3, 5, 4] = 0.5 + y[1, 3, 5, 4]  # one element off, in the last slices
    assert not launch.same_values(x, y)
    assert launch.same_values(torch.tensor([0.0]), torch.tensor([-0.0]))  # as torch.equal
