"""More catalog entries (see ``fuzz_catalog``): reductions, views, extern ops, norms,
random ops and other effects, in-place writes and buffer updates, and Python control flow
on tensor values (the graph breaks that cut a recording into segments)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from fuzz_catalog import G, _scalar_kind, unary
from fuzz_programs import Skip, Step

__all__ = ["MORE"]


# ---------------------------------------------------------------------- reductions
def reduction(g: G) -> Step:
    name = g.choice(["sum", "mean", "amax", "amin", "prod", "max", "min", "var", "std"])
    rule = {"sum": "arith", "prod": "arith", "amax": "exact", "amin": "exact", "max": "exact",
            "min": "exact"}.get(name, "inexact")
    a = g.t()
    d, k = g.dim(a), g.keepdim()
    form = g.d.int(0, 3)
    if name in ("max", "min"):
        if form == 0:
            return g.expr(name, f"{a}.{name}()", rule)
        if form == 1:
            return g.expr(name, f"torch.{name}({a}, {d}).values", rule)
        # indices: which of equal values is "first" is discontinuous in the values
        if not g.exact(a):
            raise Skip("indices of an inexact value")
        return g.expr(name, f"{a}.{name}(dim={d}, keepdim={k})[1]", rule)
    if name in ("var", "std"):
        if form == 0:
            return g.expr(name, f"{a}.{name}()", rule)
        if form == 1:
            return g.expr(name, f"torch.{name}({a}, {d}, unbiased=False)", rule)
        return g.expr(name, f"torch.{name}({a}, dim={d}, correction=0, keepdim={k})", rule)
    if form == 0:
        return g.expr(name, f"{a}.{name}()", rule)
    if form == 1:
        return g.expr(name, f"torch.{name}({a}, dim={d}, keepdim={k})", rule)
    if form == 2 and name in ("sum", "mean", "amax", "amin") and g.nd(a) >= 2:
        d2 = (d + 1) % g.nd(a)
        return g.expr(name, f"{a}.{name}(({d}, {d2}))", rule)
    if name in ("sum", "mean", "prod"):
        return g.expr(name, f"{a}.{name}({d}, dtype=torch.float32)", "inexact")
    return g.expr(name, f"{a}.{name}({d}, {k})", rule)


def norm(g: G) -> Step:
    name = g.t(kind="float", min_dim=1)
    shape = tuple(g.sample(name).shape)
    c = shape[-1]
    which = g.d.int(0, 6)
    a, dt = name, g.sample(name).dtype
    if which == 0:
        return g.expr("softmax", g.choice([f"torch.softmax({a}, {g.dim(name)})",
                                           f"{a}.softmax({g.dim(name)})",
                                           f"F.softmax({a}, dim=-1, dtype=torch.float32)"]),
                      "inexact")
    if which == 1:
        return g.expr("log_softmax", g.choice([f"torch.log_softmax({a}, {g.dim(name)})",
                                               f"F.log_softmax({a}, dim=-1)"]), "inexact")
    if which == 2:
        if g.d.bool():
            w, b = g.param((c,), dt), g.param((c,), dt)
            return g.expr("layer_norm", f"F.layer_norm({a}, ({c},), {w}, {b}, eps=1e-3)",
                          "inexact")
        return g.expr("layer_norm", f"F.layer_norm({a}, {name}.shape[-1:])", "inexact")
    if which == 3:
        if g.d.bool():
            w = g.param((c,), dt)
            return g.expr("rms_norm", f"F.rms_norm({a}, ({c},), {w}, eps=1e-5)", "inexact")
        return g.expr("rms_norm", f"F.rms_norm({a}, ({c},))", "inexact")
    if which == 4:
        return g.expr("softmax_implicit_dim", f"F.softmax({a})", "inexact")
    if which == 5 and len(shape) >= 2:
        groups = g.choice([d for d in (1, 2, 3) if shape[1] % d == 0] or [1])
        return g.expr("group_norm", f"F.group_norm({a}, {groups})", "inexact")
    if len(shape) < 2:
        raise Skip("batch_norm needs channels")
    ch = shape[1]
    rm = g.param((ch,), torch.float32)
    g.init[-1] = g.init[-1].replace("torch.randn", "0.1 * torch.randn")
    rv = g.param((ch,), torch.float32)
    g.init[-1] = g.init[-1].replace("torch.randn", "1 + 0.1 * torch.randn")
    training = g.choice(["True", "False"])
    return g.expr("batch_norm", f"F.batch_norm({a}, {rm}, {rv}, training={training}, "
                  f"momentum=0.1)", "inexact")


def multiply_add_or_norm(g: G) -> Step:
    """addcmul and addcdiv (three tensors and a value) and the 2-norm's spellings, which
    decompose into pointwise ops and a sum of squares. (Last in :data:`MORE`, weight 1:
    drawing it changes no program an older seed drew without it.)"""
    which = g.d.int(0, 3)
    if which <= 1:
        a = g.t(kind="float")
        b, c = g.t(kind="float", like=a), g.t(kind="float", like=a)
        value = g.choice(["", ", value=0.5", ", value=-2"])
        if which == 0:
            return g.expr("addcmul", g.choice([f"torch.addcmul({a}, {b}, {c}{value})",
                                               f"{a}.addcmul({b}, {c}{value})"]), "inexact")
        return g.expr("addcdiv", f"torch.addcdiv({a}, {b}, ({c}.abs() + 1){value})", "inexact")
    if which == 2:  # torch.norm and Tensor.norm with a number are vector norms too
        a = g.t(kind="float", min_dim=1)
        d, k = g.dim(a), g.keepdim()
        return g.expr("vector_norm", g.choice([
            f"torch.linalg.vector_norm({a})", f"torch.linalg.vector_norm({a}, 2, {d}, {k})",
            f"{a}.norm()", f"{a}.norm(dim={d}, keepdim={k})", f"torch.norm({a}, p=2, dim={d})",
            f"{a}.norm(p=1)"]), "inexact")
    a = g.t(kind="float", min_dim=2)  # a matrix norm: no decomposition, it runs as it is
    return g.expr("norm", f"torch.norm({a}, p='nuc', dim=(-2, -1))", "inexact")


# ---------------------------------------------------------------------- views
def view(g: G) -> Step:
    a = g.t()
    shape = tuple(g.sample(a).shape)
    nd = len(shape)
    kind = g.d.int(0, 11)
    if kind == 0 and nd >= 2:
        d0, d1 = g.dim(a), g.dim(a)
        return g.expr("transpose", g.choice([f"{a}.transpose({d0}, {d1})",
                                             f"torch.transpose({a}, {d0}, {d1})",
                                             f"{a}.swapaxes({d0}, {d1})"]), alias=True)
    if kind == 1 and nd >= 1:
        perm = list(range(nd))
        for i in range(nd - 1, 0, -1):
            j = g.d.int(0, i)
            perm[i], perm[j] = perm[j], perm[i]
        return g.expr("permute", g.choice([f"{a}.permute({tuple(perm)})",
                                           f"torch.permute({a}, {tuple(perm)})"]), alias=True)
    if kind == 2:
        return g.expr("view", g.choice([f"{a}.view(-1)", f"{a}.view({_refactor(g, shape)})"]),
                      alias=True)
    if kind == 3:
        return g.expr("reshape", g.choice([f"{a}.reshape(-1)",
                                           f"torch.reshape({a}, {_refactor(g, shape)})",
                                           f"{a}.reshape({a}.shape[0], -1)" if nd else
                                           f"{a}.reshape(1)"]), alias=True)
    if kind == 4:
        new = (2, *shape) if g.d.bool() else tuple(3 if s == 1 else s for s in shape)
        return g.expr("expand", f"{a}.expand({new})", alias=True)
    if kind == 5:
        return g.expr("flatten", g.choice([f"{a}.flatten()", f"torch.flatten({a}, 1)"]),
                      alias=True)
    if kind == 6:
        return g.expr("unsqueeze", f"{a}.unsqueeze({g.d.int(-nd - 1, nd)})", alias=True)
    if kind == 7:
        return g.expr("squeeze", g.choice([f"{a}.squeeze()", f"{a}.squeeze({g.dim(a)})"]),
                      alias=True)
    if kind == 8:
        form = f"{a}.contiguous(memory_format=torch.channels_last)" if nd == 4 else \
            f"{a}.contiguous()"
        return g.expr("contiguous", form, alias=True)
    if kind == 9 and nd <= 2:
        return g.expr("t", g.choice([f"{a}.t()", f"torch.t({a})"]), alias=True)
    if kind == 10:
        return g.expr("identity", g.choice([f"F.dropout({a}, 0.5, training=False)",
                                            f"torch.nn.functional.dropout({a}, p=0.2, "
                                            f"training=False)"]), alias=True)
    return getitem(g, a, nd)


def _refactor(g: G, shape: tuple[int, ...]) -> tuple[int, ...]:
    numel = 1
    for s in shape:
        numel *= s
    options = [(numel,), (1, numel), (numel, 1)]
    for k in (2, 3):
        if numel % k == 0 and numel:
            options.append((k, numel // k))
    return g.choice(options)


def getitem(g: G, a: str, nd: int) -> Step:
    if nd == 0:
        return g.expr("getitem", g.choice([f"{a}[None]", f"{a}[...]"]), alias=True)
    form = g.d.int(0, 9)
    simple = ["0", "-1", "1:", "::2", "..., ::2", ":, None", "None", "..., 0", "..., 1:"]
    if form < 7:
        return g.expr("getitem", f"{a}[{g.choice(simple)}]", alias=True)
    if form == 7:
        return g.expr("getitem", f"{a}[[0, -1]]")
    if form == 8:  # a boolean mask: the result's size depends on the values
        m = g.t(exact=True, kind="bool", like=a, same_shape=True)
        return g.expr("getitem", f"{a}[{m}]")
    i = g.t(exact=True, kind="int")
    size = g.sample(a).shape[0]
    if not size:
        raise Skip("empty")
    return g.expr("getitem", f"{a}[{i}.abs() % {size}]")


# ---------------------------------------------------------------------- externs
def extern(g: G) -> Step:
    which = g.d.int(0, 7)
    if which == 0:
        a = g.t(min_dim=1)
        b = g.t(like=a, same_shape=True)
        if g.nd(a) == 1:
            return g.expr("matmul", f"{a} @ {b}", "inexact")
        return g.expr("matmul", g.choice([f"{a} @ {b}.transpose(-1, -2)",
                                          f"torch.matmul({a}, {b}.transpose(-1, -2))",
                                          f"torch.mm({a}, {b}.t())",
                                          f"torch.bmm({a}, {b}.transpose(1, 2))"]), "inexact")
    if which == 1:
        a = g.t(min_dim=1)
        c = g.sample(a).shape[-1]
        w = g.param((3, c), g.sample(a).dtype)
        bias = f", {g.param((3,), g.sample(a).dtype)}" if g.d.bool() else ""
        if bias and g.nd(a) == 2 and g.d.bool():  # transformers' Conv1D: addmm(b, x, w)
            return g.expr("addmm", f"torch.addmm({bias[2:]}, {a}, {w}.t())", "inexact")
        return g.expr("linear", f"F.linear({a}, {w}{bias})", "inexact")
    if which == 2:
        a = g.t(min_dim=1)
        b = g.t(like=a, same_shape=True)
        d = g.dim(a)
        form = g.choice([f"torch.cat([{a}, {b}], dim={d})", f"torch.concat(({a}, {b}), {d})",
                         f"torch.stack([{a}, {b}], dim={d})"])
        return g.expr("stack" if "stack" in form else "cat", form)
    if which in (3, 4):
        a = g.t(kind="float", min_dim=3)
        nd, ch = g.nd(a), g.sample(a).shape[1]
        dt = g.sample(a).dtype
        if nd == 3:
            w = g.param((2, ch, 1), dt)
            return g.expr("conv1d", f"F.conv1d({a}, {w}, padding=1)", "inexact")
        if nd == 4 and which == 3:
            w = g.param((2, ch, 2, 2), dt)
            return g.expr("conv2d", g.choice([f"F.conv2d({a}, {w}, padding=1)",
                                              f"F.conv2d({a}, {w}, stride=2, padding=1)"]),
                          "inexact")
        w = g.param((2, ch, 1, 1, 1), dt)
        return g.expr("conv3d", f"F.conv3d({a}.unsqueeze(2), {w})", "inexact")
    if which == 5:
        i = g.t(exact=True, kind="int")
        w = g.param((5, 3))
        return g.expr("embedding", f"F.embedding({i}.abs() % 5, {w})")
    if which == 6:
        return unknown(g)
    a = g.t()
    return g.expr("cat", f"torch.cat([{a}.reshape(-1), {g.t()}.reshape(-1)])")


def unknown(g: G) -> Step:
    """Ops the table does not know: they must run as they are."""
    a = g.t(min_dim=1)
    form = g.choice([f"torch.flip({a}, [0])", f"torch.cumsum({a}, 0)",
                     f"torch.roll({a}, 1, 0)", f"torch.zeros_like({a})",
                     f"torch.full_like({a}, 2)", f"{a}.repeat(2, *[1] * ({a}.dim() - 1))",
                     f"torch.nan_to_num({a})"])
    rule = "arith" if "cumsum" in form else "exact"
    return g.expr("(unknown)", form, rule)


# ---------------------------------------------------------------------- random, effects
def _finite(code: str) -> str:
    """``code`` with NaN and infinities replaced: random ops that take probabilities or
    rates raise on the CPU for them, but fail a device-side assert on CUDA, which ends the
    process's CUDA context (eager's as much as the compiled function's)."""
    return f"{code}.nan_to_num(0.5, 1.0, 0.0)"


def random_op(g: G) -> Step:
    which = g.d.int(0, 15)
    if which <= 5:
        a = g.t(kind="float")
        g.weak.append(a)  # only its shape, dtype and device count
        form = [f"torch.rand_like({a})", f"torch.randn_like({a})",
                f"torch.randint_like({a}, 0, 5)", f"torch.rand({a}.shape, device={a}.device)",
                f"torch.randn(3, device={a}.device)",
                f"torch.randint(0, 5, {a}.shape, device={a}.device)"][which]
        record = form.split("(")[0]
        return g.expr(record, form, "exact")
    if which == 6:
        a = g.t()
        g.weak.append(a)
        return g.expr("torch.randperm", f"torch.randperm({max(1, g.sample(a).numel())}, "
                      f"device={a}.device)")
    if which == 7:
        a = g.t(kind="float", exact=True)
        return g.expr("torch.bernoulli", f"torch.bernoulli({_finite(a)}.abs().clamp(0, 1))")
    if which == 8:
        a = g.t(kind="float")
        g.weak.append(a)
        return g.expr("Tensor.bernoulli", f"{a}.bernoulli(0.3)")
    if which == 9:
        a = g.t(kind="float", exact=True)
        if not g.sample(a).numel():
            raise Skip("empty")
        f = _finite(a)
        form = g.choice([f"torch.multinomial({f}.abs().reshape(-1) + 0.1, 2)",
                         f"({f}.abs().reshape(-1) + 0.1).multinomial(1)"])
        return g.expr("torch.multinomial" if form.startswith("torch") else
                      "Tensor.multinomial", form)
    if which == 10:
        a = g.t(kind="float", exact=True)
        return g.expr("torch.normal", f"torch.normal({a}, 0.5)", "inexact")
    if which == 11:
        a = g.t(kind="float", exact=True)
        return g.expr("torch.poisson", f"torch.poisson({_finite(a)}.abs())")
    a = g.t(kind="float")
    forms = [("torch.dropout", f"torch.dropout({a}, 0.3, True)"),
             ("torch.alpha_dropout", f"torch.alpha_dropout({a}, 0.3, True)"),
             ("torch.feature_dropout", f"torch.feature_dropout({a}, 0.3, True)"),
             ("dropout", f"F.dropout({a}, 0.3, training=True)"),
             ("dropout1d", f"F.dropout1d({a}, 0.5, training=True)"),
             ("dropout2d", f"F.dropout2d({a}, 0.5, training=True)"),
             ("dropout3d", f"F.dropout3d({a}, 0.5, training=True)"),
             ("alpha_dropout", f"F.alpha_dropout({a}, 0.2, training=True)"),
             ("feature_alpha_dropout", f"F.feature_alpha_dropout({a}, 0.2, training=True)"),
             ("torch.nn.functional.rrelu", f"F.rrelu({a}, training=True)"),
             ("torch.nn.functional.gumbel_softmax", f"F.gumbel_softmax({a}, tau=1.0)")]
    record, form = g.choice(forms)
    return g.expr(record, form, "inexact")


def effect(g: G) -> Step:
    which = g.d.int(0, 4)
    a = g.t()
    if which == 0:
        return g.stmt("builtins.print", f"print({a}.shape, {a}.sum(), file=_sink)", None,
                      branches=True, traceable=False)
    if which == 1:
        g.weak.append(a)  # only its rank counts: a compiler may drop the value, and with
        # it an error eager raises only in making it (a size mismatch after a resize)
        return g.stmt("torch._assert", f"torch._assert({a}.dim() >= 0, 'rank')", None)
    if which == 2:
        return g.stmt("torch._assert", f"torch._assert(bool((({a} == {a}) | {a}.isnan()).all()), "
                      f"'equal or NaN')", None, branches=True, traceable=False)
    if which == 3:
        return g.stmt("torch.random.manual_seed", "torch.manual_seed(7)", None,
                      traceable=False)
    return module_call(g, a)


MODULES = [("relu", "nn.ReLU()", "exact"), ("gelu", "nn.GELU()", "inexact"),
           ("identity", "nn.Identity()", "exact"), ("softmax", "nn.Softmax(dim=-1)", "inexact"),
           ("softmax_implicit_dim", "nn.Softmax()", "inexact"),
           ("dropout", "nn.Dropout(0.3)", "inexact"), ("nn.RReLU", "nn.RReLU()", "inexact")]


def module_call(g: G, a: str) -> Step:
    """A leaf module: symbolic_trace keeps it as call_module (its record's module form)."""
    record, make, rule = g.choice(MODULES)
    name = f"m{g.index}"
    g.init.append(f"self.{name} = {make}")
    return g.expr(record, f"self.{name}({a})", rule)


# ---------------------------------------------------------------------- in-place
INPLACE = [("add", "{a}.add_({b})", "arith", "ts"), ("sub", "{a}.sub_({b}, alpha=2)", "arith", "ts"),
           ("mul", "{a}.mul_({b})", "arith", "ts"), ("truediv", "{a}.div_({b})", "inexact", "div"),
           ("clamp", "{a}.clamp_(min={s})", "exact", None), ("relu", "{a}.relu_()", "exact", None),
           ("neg", "{a}.neg_()", "exact", None), ("abs", "{a}.abs_()", "exact", None),
           ("sigmoid", "{a}.sigmoid_()", "inexact", None), ("exp", "{a}.exp_()", "inexact", None),
           ("pow", "{a}.pow_(2)", "arith", None), ("(unknown)", "{a}.zero_()", "exact", None),
           ("(unknown)", "{a}.fill_({s})", "exact", None), ("(unknown)", "{a}.copy_({b})", "exact", "t"),
           ("(unknown)", "{a}.masked_fill_({a} != {a}, 0)", "exact", None),
           ("relu", "F.relu({a}, inplace=True)", "exact", None),
           ("silu", "F.silu({a}, inplace=True)", "inexact", None),
           ("leaky_relu", "F.leaky_relu({a}, 0.1, inplace=True)", "inexact", None),
           ("hardtanh", "F.hardtanh({a}, inplace=True)", "exact", None),
           ("_operator.iadd", "{a} += {b}", "arith", "ts"),
           ("_operator.isub", "{a} -= {b}", "arith", "ts"),
           ("_operator.imul", "{a} *= {b}", "arith", "ts"),
           ("_operator.itruediv", "{a} /= {b}", "inexact", "div"),
           ("_operator.ifloordiv", "{a} //= {b}", "arith", "div"),
           ("_operator.imod", "{a} %= {b}", "arith", "div"),
           ("_operator.ipow", "{a} **= 2", "arith", None),
           ("_operator.iand", "{a} &= {b}", "exact", "int"),
           ("_operator.ior", "{a} |= {b}", "exact", "int"),
           ("_operator.ixor", "{a} ^= {b}", "exact", "int"),
           ("_operator.ilshift", "{a} <<= 1", "exact", None),
           ("_operator.irshift", "{a} >>= 1", "exact", None)]


def inplace(g: G) -> Step:
    """An in-place op on an input, a buffer, an intermediate or a view of one of them."""
    record, form, rule, how = g.choice(INPLACE)
    disc = record in ("_operator.ifloordiv", "_operator.imod", "_operator.iand",
                      "_operator.ior", "_operator.ixor")
    a = g.t(mutable=True, exact=disc)
    b = ""
    if how == "ts":
        b = g.ts(a)
    elif how == "t":
        b = g.t(like=a)
    elif how == "div":
        b = g.divisor(a)
    elif how == "int":
        b = g.t(exact=True, kind="intlike", like=a)
    elif how == "sq":
        if g.nd(a) != 2 or g.sample(a).shape[0] != g.sample(a).shape[1]:
            raise Skip("square matrix")
        b = g.t(like=a, same_shape=True)
    s = g.scalar(_scalar_kind(g.sample(a)))
    return g.stmt(record, form.format(a=a, b=b, s=s), a, rule)


def imatmul(g: G) -> Step:
    """``v @= w``: tensors have no in-place matmul, so Python rebinds ``v``."""
    a = g.t(min_dim=2)
    if g.sample(a).shape[-1] != g.sample(a).shape[-2]:
        raise Skip("square matrices")
    b = g.t(like=a, same_shape=True)
    return Step([f"{g.out} = {a}", f"{g.out} @= {b}"], "matmul", tuple(g.reads),
                out=g.out, rule="inexact")


def setitem(g: G) -> Step:
    a = g.t(mutable=True, min_dim=1)
    index = g.choice(["0", "-1", "1:", "::2", "..., 0", "..., ::2", ":, 1"])
    v = g.ts(a) if g.d.bool(0.5) else g.scalar(_scalar_kind(g.sample(a)))
    return g.stmt("_operator.setitem", f"{a}[{index}] = {v}", a)


def buffer_update(g: G) -> Step:
    """A running statistic: ``self.b.mul_(0.9).add_(x.mean() * 0.1)`` and friends."""
    bufs = [v.name for v in g.s.values if v.name.startswith("self.b")]
    if not bufs:
        raise Skip("no buffer")
    b = g.choice(bufs)
    g.reads.append(b)
    if not g.sample(b).is_floating_point():
        return g.stmt("_operator.iadd", f"{b} += 1", b, "arith")
    a = g.t(kind="float")
    form = g.choice([f"{b}.mul_(0.9).add_({a}.mean() * 0.1)",
                     f"{b}.copy_({a}.mean().expand_as({b}))",
                     f"{b}.add_({a}.sum())"])
    return g.stmt("mul" if "mul_" in form else "add", form, b, "inexact")


# ---------------------------------------------------------------------- control flow
def _robust_condition(g: G) -> str:
    """A condition whose outcome rounding cannot flip: on an input's sum (the sign of a
    random sum is far from rounding noise) or on an exact value."""
    inputs = [v.name for v in g.s.values if v.input]
    if inputs and g.d.bool(0.5):
        x = g.choice(inputs)
        g.reads.append(x)
        return g.choice([f"{x}.sum() > 0", f"{x}.float().mean() < 0.5"])
    e = g.t(exact=True)
    s = g.scalar(_scalar_kind(g.sample(e)))
    return g.choice([f"({e} > {s}).any()", f"bool(({e} != 0).all())", f"{e}.sum() > 0",
                     f"{e}.amax() > {s}", f"torch.any({e} < 0)", f"({e} == {s}).sum() > 1"])


def branch(g: G) -> Step:
    cond = _robust_condition(g)
    n_cond = len(g.reads)
    a = g.t()
    if g.d.bool(0.3):  # an in-place write on one path only
        if 0 in g.sample(a).stride() and g.sample(a).numel() > 1:
            raise Skip("expanded")
        return g.stmt("(branch)", [f"if {cond}:", f"    {a}.mul_(2)"], a, "arith",
                      branches=True, traceable=False)
    arms = []
    for _ in range(2):
        sub = G(g.d, g.s, g.index)
        sub.reads = [a]
        arms.append(_arm(sub, a))
        g.reads += sub.reads[1:]
    del n_cond
    return Step([f"if {cond}:", f"    {g.out} = {arms[0][0]}", "else:",
                 f"    {g.out} = {arms[1][0]}"], "(branch)", tuple(g.reads), out=g.out,
                rule="exact" if arms[0][1] == arms[1][1] == "exact" else "inexact",
                branches=True, traceable=False)


def _arm(g: G, a: str) -> tuple[str, str]:
    """A shape- and dtype-preserving expression of ``a`` (and its rule)."""
    return g.choice([(f"{a} * 0.5", "inexact"), (f"{a} - 1", "inexact"), (f"-{a}", "exact"),
                     (f"{a}.abs()", "exact"), (f"torch.relu({a})", "exact"),
                     (f"{a}.sigmoid()", "inexact"), (f"{a} + {a}", "inexact")])


def loop(g: G) -> Step:
    e = g.t(exact=True, kind="intlike")
    a = g.t()
    body, rule = _arm(g, g.out)
    return Step([f"{g.out} = {a}", f"for _ in range(int({e}.sum()) % 3):",
                 f"    {g.out} = {body}"], "(loop)", tuple(g.reads), out=g.out,
                rule="inexact" if rule == "inexact" else "exact", branches=True,
                traceable=False)


def value_read(g: G) -> Step:
    """A tensor's value used as a Python number, or its size used in shapes."""
    a = g.t(kind="num")
    if g.d.bool(0.5):
        e = g.t(exact=True, kind="num")
        return g.expr("(read)", g.choice([f"{a} * float({e}.amax())",
                                          f"{a} + int({e}.sum().item())"]), "arith",
                      branches=True, traceable=False)
    return g.expr("(size)", g.choice([f"{a} * {a}.numel()", f"{a} / max(1, {a}.size(-1))",
                                      f"{a}.new_zeros({a}.shape[-1:]) + len({a}.shape)"]),
                  "arith", traceable=False)  # max() and len() of traced sizes


def chain(g: G) -> Step:
    return unary(g)


MORE: list[tuple[int, Callable[[G], Step]]] = [
    (8, reduction), (5, norm), (8, view), (5, extern), (5, random_op), (3, effect),
    (8, inplace), (1, imatmul), (3, setitem), (3, buffer_update), (3, branch), (1, loop), (2, value_read),
    (1, multiply_add_or_norm),
]
