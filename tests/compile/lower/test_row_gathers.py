"""A roll and the window views around it run as one gather of rows
(``codegen/lower/row_gathers.py``): eager's values over several calls and shapes; where a
link would touch the last dim, the source is not row-major, or the graph needs autograd,
the chain stays."""

from __future__ import annotations

from test_triton_kernels import DEVICE  # isort: skip  (sets TRITON_INTERPRET on CPU)

import pytest
import torch
from fxlite.codegen.lower import row_gathers
from fxlite.codegen.lower.row_gathers import gather_rolled_rows, gather_rows
from fxlite.passes.normalize import normalize
from fxlite.passes.shape_prop import ShapeProp

import fxlite

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _windows(x):  # Swin: shift, then cut into 2x2 windows
    b, h, w, c = x.shape
    x = torch.roll(x * 2, shifts=(-1, -1), dims=(1, 2))
    x = x.view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, 4, c) + 1


def _back(x):  # windows put back, shifted back, and the padding cut off
    n, _, c = x.shape
    x = (x * 2).view(2, 2, 3, 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(2, 4, 6, c)
    x = torch.roll(x, shifts=(1, 1), dims=(1, 2))
    return x[:, :3, :5, :].contiguous() - 1


def _rolled(x):  # a roll alone, over two dims
    return torch.roll(x + 1, (2, -1), (0, 1)) * 3


def _prepared(fn, x):
    gm = fxlite.symbolic_trace(fn)
    ShapeProp(gm).propagate(x)
    return normalize(gm)


def _ops(gm):
    return [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes
            if n.op == "call_function"]


def _read_between(x):
    r = torch.roll(x, (1, 1), (0, 1))  # read twice: the roll alone is the chain
    return r.reshape(-1, 3) + 1, r.view(-1)


CASES = {"windows": (_windows, (2, 4, 6, 3)), "back": (_back, (12, 4, 3)),
         "rolled": (_rolled, (5, 4, 3)), "read_between": (_read_between, (4, 5, 3))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_chain_is_one_gather_with_eagers_values(case):
    fn, shape = CASES[case]
    x = torch.randn(shape)
    gm = gather_rolled_rows(_prepared(fn, x))
    ops = _ops(gm)
    assert "gather_rows" in ops and "roll" not in ops, gm.code
    for _ in range(2):
        x = torch.randn(shape)
        got, want = gm(x), fn(x)
        assert all(t.is_contiguous() for t in (got if isinstance(got, tuple) else [got]))
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _last_dim(x):
    return torch.roll(x, (1, 1), (0, 2)) + 1


def _one_dim(x):
    return torch.roll(x, 1, 0) + 1


def _strided_source(x):
    return torch.roll(x.transpose(0, 1), (1, 1), (0, 1)) + 1


@pytest.mark.parametrize("fn", [_last_dim, _one_dim, _strided_source])
def test_a_chain_that_moves_more_than_rows_or_gains_nothing_stays(fn):
    x = torch.randn(4, 5, 3)
    gm = _prepared(fn, x)
    before = gm.code
    assert gather_rolled_rows(gm).code == before
    torch.testing.assert_close(gm(x), fn(x))


def test_gather_rows_follows_the_shape_of_each_call_and_fails_as_eager_does():
    links = (("roll", (1, -2), (0, 1)), ("reshape", (-1, 1)))
    for shape in [(3, 4, 2), (5, 6, 2), (3, 4, 2)]:
        x = torch.randn(shape)
        torch.testing.assert_close(gather_rows(x, links),
                                   torch.roll(x, (1, -2), (0, 1)).reshape(-1, 2))
    for shape in [(3, 4, 0), (0, 4, 2)]:  # no values: no rows, or rows of nothing
        x = torch.randn(shape)
        want = torch.roll(x, (1, -2), (0, 1)).reshape(shape[0] * shape[1], shape[-1])
        torch.testing.assert_close(gather_rows(x, links), want)
    with pytest.raises(RuntimeError):  # a view eager could not make either
        gather_rows(torch.randn(3, 5, 2), (("reshape", (2, -1, 2, 1)),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shifted_window_attention_compiles_to_eagers_values_in_inference(dtype):
    compiled = fxlite.compile(_windows)
    row_gathers._INDEX.clear()  # the rows found for each shape the gather ran on
    with torch.no_grad():
        for shape in [(2, 4, 6, 3), (2, 4, 6, 3), (1, 6, 4, 3)]:
            x = torch.randn(shape, device=DEVICE, dtype=dtype)
            torch.testing.assert_close(compiled(x), _windows(x), rtol=0, atol=0)
            assert any(key[1] == x.shape for key in row_gathers._INDEX), shape


def test_in_training_the_roll_stays_and_gradients_match():
    compiled = fxlite.compile(_windows)
    row_gathers._INDEX.clear()
    for _ in range(2):
        x = torch.randn(2, 4, 6, 3, device=DEVICE, requires_grad=True)
        ref = x.detach().clone().requires_grad_()
        out, want = compiled(x), _windows(ref)
        torch.testing.assert_close(out, want)
        out.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(x.grad, ref.grad)
    assert not row_gathers._INDEX  # index_select's backward is not deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,width", [(100, 96), (37, 5), (3, 300), (1, 1), (0, 4)])
def test_the_row_kernel_picks_index_selects_rows(dtype, rows, width):
    from fxlite.codegen.kernels.rows import gather_rows_kernel, takes

    x = torch.randn(rows, width, device=DEVICE).to(dtype)
    for _ in range(2):  # the second call on CUDA reuses the first one's binary
        index = torch.randint(0, max(rows, 1), (rows + 3,), device=DEVICE) if rows else \
            torch.zeros(0, dtype=torch.int64, device=DEVICE)
        assert takes(x)  # (a row-major float matrix, on CUDA or under the interpreter)
        got = gather_rows_kernel(x, index)
        torch.testing.assert_close(got, torch.index_select(x, 0, index), rtol=0, atol=0)


def test_rows_the_kernel_does_not_take_are_index_selected(monkeypatch):
    from fxlite.codegen.kernels.rows import takes

    used = []
    monkeypatch.setattr(row_gathers, "gather_rows_kernel",
                        lambda rows, index: used.append(rows.dtype) or
                        torch.index_select(rows, 0, index))

    x = torch.randn(6, 4, device=DEVICE)
    assert not takes(x.t())  # not row-major
    assert not takes(torch.randint(0, 5, (6, 4), device=DEVICE))  # not floats
    assert not takes(torch.randn(6, 0, device=DEVICE))  # rows of nothing
    assert not takes(torch.randn(2, 3, 4, device=DEVICE))  # not a matrix
    links = (("roll", (1,), (0,)), ("reshape", (-1, 1)))
    for y in (torch.randn(5, 3, device=DEVICE).t().contiguous().t(),
              torch.randint(0, 9, (5, 3), device=DEVICE)):
        torch.testing.assert_close(gather_rows(y.contiguous(), links),
                                   torch.roll(y, 1, 0).reshape(-1, 3), rtol=0, atol=0)
    assert used == [torch.float32]  # the float rows went to the kernel, the ints did not


@pytest.mark.parametrize("case", ["windows", "back"])
def test_the_precompile_plans_the_launch_each_gather_makes(case, monkeypatch):
    """Each gather's kernel compiled when the first call reached it, after the parallel
    precompile, one after another (swin_t's first call on an H200: three late compiles of
    ``_gather_rows``). The precompile plans it from the graph's metadata now: the launch it
    plans is the one the call makes."""
    from fxlite.codegen.kernels import rows
    from fxlite.codegen.runtime import precompile as pre

    fn, shape = CASES[case]
    x = torch.randn(shape, device=DEVICE)
    gm = gather_rolled_rows(_prepared(fn, x))
    jobs, _, _, _ = pre._plan(gm, torch.device(DEVICE))
    planned = [job for job in jobs.values() if job[0] is rows._gather_rows]
    made = []
    real = rows._launch
    monkeypatch.setattr(rows, "_launch", lambda *a: made.append(real(*a)) or made[-1])
    torch.testing.assert_close(gm(x), fn(x), rtol=0, atol=0)
    assert len(planned) == len(made) == 1, (planned, made)
    (_, args, grid, constexprs, warps), (want_grid, want_args, want_constexprs) = planned[0], made[0]
    assert grid == want_grid[:1] and constexprs == want_constexprs and warps == rows._WARPS
    # (the precompile compiles with stand-in tensors of each dtype: their sizes are no key)
    assert [a.dtype if isinstance(a, torch.Tensor) else a for a in args] == \
        [a.dtype if isinstance(a, torch.Tensor) else a for a in want_args]
    node = next(n for n in gm.graph.nodes if n.target is gather_rows)
    meta = torch.empty(shape, device="meta") if node.args[0].op == "placeholder" else \
        torch.empty(node.args[0].meta["tensor_meta"].shape, device="meta")
    _, _, meta_args, _, _, _ = gather_rows.planned_launch(gather_rows, (meta, node.args[1]), {})
    assert [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in meta_args] == \
        [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in want_args]
