"""Straight-line forwards: a compiled segment's graph as one flat function per layout.

A compiled segment's ``GraphModule`` pays host time on every call that the layout of
its inputs makes unnecessary: each kernel computes its inputs' fingerprint (shapes,
strides, dtypes, alignment) to find its launch, each ``get_attr`` walks the module tree,
and views of parameters (BatchNorm's statistics as ``(C, 1, 1)``, 212 of them in
resnet50) are made again. :func:`straight_line` writes, for one layout of the
arguments, a function that does only the work that changes between calls:

- ``get_attr`` values are bound once. That holds while the module state is unchanged
  (the compiled function's guard keys parameter identities) and while their layouts are
  (:func:`attr_key`, checked on each call: a ``p.data = ...`` can change them);
- a value is *fixed* when its layout and its address modulo 16 follow from the
  arguments' fast key and the attributes' key: an aligned argument, an attribute, a
  kernel's output, or the result of a torch op on fixed values (an op whose output
  shape depends on the data, such as ``nonzero``, is not). A kernel whose inputs are all
  fixed calls its prepared direct launch without looking it up; others look it up;
- views and size reads of attributes alone (``per_channel(weight, 64, 4, ...)``,
  ``x.size(1)`` of a fixed ``x``) are computed once, when the function is made, and
  bound as constants: a view shares the attribute's memory, so it sees in-place writes;
- a chain of views of a fixed value (GPT-2's ``qkv.split(...)[1].view(...).transpose(1,
  2)``: four torch calls, 9.5 us of host time on the development machine) is one
  ``torch.as_strided`` of the chain's first tensor (1.7 us), written where a later op
  reads it; a view nothing reads costs nothing (:meth:`_Writer.defer`).

Everything else is called as the graph calls it, in the graph's order. Example, for a
convolution followed by BatchNorm and ReLU in one kernel::

    def forward(a0):
        v2 = _f2(a0, _a1, None, (1, 1), (1, 1), (1, 1), 1)   # torch.conv2d
        v7 = _L7((v2, _c3, _c4, _c5, _c6))                    # the kernel's launch
        return v7
"""

from __future__ import annotations

import itertools
import keyword
import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from fxlite.codegen.capture.guards import LayoutCheck, tensor_guard
from fxlite.codegen.runtime.launch import fingerprint

from fxlite.interpreter import freed_after
from fxlite.node import Node, target_name
from fxlite.python_code import PythonCode

__all__ = ["AttrCheck", "Forward", "StraightRunner", "attr_key", "fast_key", "straight_line"]

_NUMBERS = itertools.count()  # the straight lines' file names
_LOCAL = re.compile(r"v\d+")  # the names of a forward's values (arguments are the caller's)
_READ = re.compile(r"\bv\d+\b")  # such a name, as a word of a line
_ASSIGN = re.compile(r"^\s*(v\d+) = ")  # a line's target
# Ops whose output shape depends on tensor values, not only on their inputs' layouts.
_DATA_DEPENDENT = frozenset({
    "nonzero", "nonzero_static", "argwhere", "masked_select", "unique", "unique_consecutive",
    "bincount", "repeat_interleave", "histc", "histogram", "where", "item", "tolist",
    "__bool__", "__int__", "__float__", "__index__", "_unique", "_unique2", "index",
    "__getitem__", "index_put", "index_put_", "masked_scatter", "masked_scatter_"})
# Views: computed once when every tensor they read is an attribute (or such a view).
_VIEWS = frozenset({
    "view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "permute",
    "transpose", "t", "expand", "narrow", "select", "view_as", "expand_as", "detach",
    "per_channel", "movedim", "swapaxes"})
# Views returning a tuple of views.
_TUPLE_VIEWS = frozenset({"split", "chunk", "unbind", "tensor_split", "split_with_sizes"})
# Size reads: computed once when the tensors they read are fixed.
_SIZES = frozenset({"size", "dim", "numel", "stride", "ndimension", "nelement",
                    "broadcast_size", "_normalized_count", "__len__"})
# Where a call_function's target must come from for its result's layout to be trusted.
_TRUSTED_MODULES = ("torch", "fxlite", "_operator", "operator", "math")


def fast_key(args: Sequence[Any]) -> tuple | None:
    """What :func:`straight_line` functions are specialized on, or None (no fast path).

    The launch fingerprint of every argument plus ``requires_grad``: with grad mode and
    the model's train/eval flags (added by the caller) it fixes the compiled entry too.
    """
    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16 == 0,
                        a.requires_grad))
        elif type(a) is int:
            key.append((int, -(2**31) <= a < 2**31))
        elif type(a) in (float, bool) or a is None:
            key.append(type(a))
        else:
            return None
    return tuple(key)


_DTYPE = operator.attrgetter("dtype")


def attr_key(tensors: Sequence[torch.Tensor]) -> tuple:
    """The layouts and addresses of the attribute tensors a straight line binds.

    Equal keys mean each tensor still has the same memory, shape, strides and dtype (a
    ``p.data = other`` changes at least one), so views made of them earlier still read
    what the graph would read, and kernels reading them keep their launches.
    """
    t = torch.Tensor
    return (tuple(map(t.data_ptr, tensors)), tuple(map(t.size, tensors)),
            tuple(map(t.stride, tensors)), tuple(map(_DTYPE, tensors)))


class AttrCheck:
    """Whether the attribute tensors a straight line binds still have the memory and
    layout they had when it was made (:func:`attr_key`'s comparison).

    The addresses are compared in Python; shapes, strides, dtypes and devices by torch's
    C++ tensor guard where this torch has it (resnet50's 161 tensors: about 13 us,
    against about 60 for the Python comparison, on the development machine).
    """

    __slots__ = ("tensors", "ptrs", "guard", "key")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.ptrs = tuple(map(torch.Tensor.data_ptr, self.tensors))
        self.guard = tensor_guard(self.tensors)
        self.key = attr_key(self.tensors) if self.guard is None else None

    def __call__(self) -> bool:
        tensors = self.tensors
        if not tensors:
            return True
        if self.guard is None:
            return attr_key(tensors) == self.key
        return tuple(map(torch.Tensor.data_ptr, tensors)) == self.ptrs and \
            self.guard.check(*tensors)


class _NoFastPath(Exception):
    pass


def _kernel_call(node: Node) -> bool:
    return (node.op == "call_function" and isinstance(getattr(node.target, "_direct", None), dict)
            and not node.kwargs and bool(node.args))


def _trusted(node: Node) -> bool:
    """Whether the op's output layout follows from its inputs' layouts alone."""
    if target_name(node) in _DATA_DEPENDENT:
        return False
    if node.op == "call_method":
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:  # a tensor index may be a mask
        return not any(isinstance(a, Node) for a in _flat(node.args[1:]))
    owner = getattr(node.target, "__objclass__", None)  # torch.Tensor.contiguous, say
    module = getattr(owner if owner is not None else node.target, "__module__", None) or ""
    return module.split(".")[0] in _TRUSTED_MODULES


def _integer_index(node: Node, args: Any) -> bool:
    """Whether ``node`` indexes with integer tensors of at least one dim (MaxViT's relative
    position bias, ``table[index.view(-1)]``): its result is a new tensor whose shape
    follows from the indices', as a mask's would not. Without such a tensor, an index by
    a number the graph computed (or by a 0-dim tensor) selects: a view whose address
    depends on that number's value."""
    if node.target is not operator.getitem:
        return False
    tensors = [a for a in _flat(args[1:]) if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.dim() > 0 and t.dtype not in (torch.bool, torch.uint8)
                                 for t in tensors)


def _flat(a: Any) -> list[Any]:
    if isinstance(a, (tuple, list)):
        return [y for x in a for y in _flat(x)]
    if isinstance(a, dict):
        return [y for x in a.values() for y in _flat(x)]
    if isinstance(a, slice):
        return [a.start, a.stop, a.step]
    return [a]


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _shares_memory(view: Any, bases: list[torch.Tensor]) -> bool:
    if not isinstance(view, torch.Tensor):
        return False
    storage = view.untyped_storage().data_ptr()
    return any(storage == b.untyped_storage().data_ptr() for b in bases)


class _Writer:
    """Builds the function while running the graph once on the call's arguments."""

    def __init__(self) -> None:
        self.names: dict[Node, str] = {}
        self.env: dict[Node, Any] = {}
        self.fixed: set[Node] = set()   # layout and address mod 16 follow from the keys
        self.const: set[Node] = set()   # value bound at build time
        self.attrs: list[torch.Tensor] = []
        self.namespace: dict[str, Any] = {}
        self.lines: list[str] = []
        self.complete = True  # every fixed kernel had a prepared launch
        self.escaped = False  # a value dropped early came back as a value bound once
        # views not written yet: node -> (the tensor the chain starts from, how to write
        # a tuple of views; None for one view, written as torch.as_strided of the start)
        self.deferred: dict[Node, tuple[Node, Any]] = {}
        # values whose last reader ran while an unwritten view of them was left
        self.held: set[Node] = set()

    def bind(self, prefix: str, value: Any) -> str:
        name = f"_{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def expr(self, a: Any) -> str:
        if isinstance(a, Node):
            if a in self.deferred:
                self._write_deferred(a)
            return self.names[a]
        if isinstance(a, tuple):
            inner = ", ".join(self.expr(x) for x in a) + ("," if len(a) == 1 else "")
            return f"({inner})"
        if isinstance(a, list):
            return "[" + ", ".join(self.expr(x) for x in a) + "]"
        if isinstance(a, dict):  # string keys only (_check)
            return "{" + ", ".join(f"{k!r}: {self.expr(v)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self.expr(a.start)}, {self.expr(a.stop)}, {self.expr(a.step)})"
        if a is None or type(a) in (bool, int) or (type(a) is float and math.isfinite(a)):
            return repr(a)
        return self.bind("c", a)  # dtypes, devices, memory formats, slices...

    def defer(self, node: Node, out: Any) -> bool:
        """Leave a view of a fixed value unwritten until an op reads it (see the module's
        docstring); whether it was. A view qualifies when its tensor input is fixed, its
        other inputs are constants, it shares that tensor's memory and dtype, autograd
        does not record it, and its users only read it (or return it)."""
        op, src = target_name(node), node.args[0] if node.args else None
        tuple_item = node.target is operator.getitem and src in self.deferred \
            and type(node.args[1]) is int
        if not (op in _VIEWS or op in _TUPLE_VIEWS or tuple_item) or not isinstance(src, Node) \
                or src not in self.fixed or node.meta.get("impure") \
                or not all(u.op == "output" or _only_read_by(u) for u in node.users):
            return False
        if any(n is not src and n not in self.const for n in node.all_input_nodes):
            return False
        root = self.deferred[src][0] if src in self.deferred else src
        base = self.env[root]
        if type(base) is not torch.Tensor or base.layout != torch.strided or op == "detach" \
                or base.requires_grad and torch.is_grad_enabled():  # as_strided would record
            return False
        many = op in _TUPLE_VIEWS and not tuple_item
        for t in (out if many and isinstance(out, (tuple, list)) else [out]):
            if (type(t) is not torch.Tensor or t.dtype != base.dtype or t.requires_grad
                    or t.layout != torch.strided or not _shares_memory(t, [base])):
                return False
        self.deferred[node] = root, (node if many else None)
        return True

    def flush(self) -> None:
        """Write every deferred view some op reads, in the graph's order."""
        for node in [n for n in self.deferred if n.users]:
            if node in self.deferred:
                self._write_deferred(node)

    def _write_deferred(self, node: Node) -> None:
        root, many = self.deferred.pop(node)
        if many is not None:  # the tuple itself is read: the op as the graph calls it
            self.call_line(node, self.names[node],
                           None if node.op == "call_method" else node.target)
            return
        out, base = self.env[node], self.env[root]
        start = self.expr(root)
        delta = out.storage_offset() - base.storage_offset()
        offset = f", {start}.storage_offset() + {delta}" if delta else ""
        self.namespace["_as_strided"] = torch.as_strided
        self.lines.append(f"    {self.names[node]} = _as_strided({start}, {tuple(out.shape)!r}, "
                          f"{tuple(out.stride())!r}{offset})")

    def call_line(self, node: Node, name: str, fn: Any) -> None:
        """Write ``name = fn(args...)``, or ``name = args[0].method(...)`` for ``fn`` None
        (a ``call_method`` node), with the node's arguments."""
        head = ", ".join([self.expr(a) for a in node.args[1 if fn is None else 0:]]
                         + [f"{k}={self.expr(v)}" for k, v in node.kwargs.items()])
        if fn is None:
            self.lines.append(f"    {name} = {self.expr(node.args[0])}.{node.target}({head})")
        else:
            self.lines.append(f"    {name} = {self.bind('f', fn)}({head})")

    def value(self, a: Any) -> Any:
        if isinstance(a, Node):
            return self.env[a]
        if isinstance(a, (tuple, list)):
            items = [self.value(x) for x in a]
            return type(a)(*items) if hasattr(a, "_fields") else type(a)(items)  # namedtuples
        if isinstance(a, dict):
            return {k: self.value(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(self.value(a.start), self.value(a.stop), self.value(a.step))
        return a

    def all_fixed(self, node: Node) -> bool:
        return all(n in self.fixed for n in node.all_input_nodes)

    def all_const(self, node: Node) -> bool:
        return all(n in self.const for n in node.all_input_nodes)


def _check(gm: Any) -> None:
    """Refuse, before anything runs, graphs the writer cannot express."""
    if not any(node.op == "output" for node in gm.graph.nodes):
        raise _NoFastPath  # the run would end without a result
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "get_attr", "call_function", "call_method",
                           "call_module", "output"):
            raise _NoFastPath
        if node.op == "call_method" and not _identifier(node.target):
            raise _NoFastPath  # written as `x.<name>(...)`: a name, nothing else
        if not all(map(_identifier, node.kwargs)) or not _str_keys((node.args, node.kwargs)):
            raise _NoFastPath


def _str_keys(a: Any) -> bool:
    """Whether every dict inside ``a`` has string keys (what :meth:`_Writer.expr` writes)."""
    if isinstance(a, dict):
        return all(type(k) is str for k in a) and all(map(_str_keys, a.values()))
    if isinstance(a, (tuple, list)):
        return all(map(_str_keys, a))
    return True


def _identifier(name: Any) -> bool:
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def straight_line(gm: Any, args: Sequence[Any]) -> tuple[Any, Any, list[torch.Tensor], bool] | None:
    """Run ``gm`` on ``args`` and write its straight-line forward for their layouts.

    Returns ``(forward, result, attrs, complete)``: ``forward`` is valid for arguments
    with the :func:`fast_key` of ``args`` while ``attr_key(attrs)`` is unchanged and the
    module state is (the caller keys both); ``result`` is this call's. ``complete`` is
    False when a kernel of fixed inputs had no launch prepared yet: ``forward`` then
    calls it through its lookup (this call prepared the launch, so writing the function
    again picks it up). ``forward`` is None when a value bound once would reach the
    caller (this call still ran whole). Returns None, having run nothing, for graphs it
    cannot write.

    Example of what it writes for ``relu(x + 1) * 2``::

        def forward(a0):
            v1 = _L1((a0,))
            return v1
    """
    try:
        _check(gm)
    except _NoFastPath:
        return None
    if sum(n.op == "placeholder" for n in gm.graph.nodes) != len(args):
        return None
    w = _Writer()
    params: list[str] = []
    freed = freed_after(gm.graph)
    previous = None
    for node in gm.graph.nodes:
        if previous is not None:
            _drop_dead(w, freed.get(previous, ()))
        previous = node
        name = f"v{len(w.names)}"
        if node.op == "placeholder":
            x = args[len(params)]
            name = f"a{len(params)}"
            params.append(name)
            w.env[node] = x
            if not isinstance(x, torch.Tensor) or _aligned(x):
                w.fixed.add(node)
        elif node.op == "get_attr":
            obj: Any = gm
            for part in node.target.split("."):
                obj = getattr(obj, part)
            w.env[node] = obj
            name = w.bind("a", obj)
            w.fixed.add(node)
            w.const.add(node)
            if isinstance(obj, torch.Tensor):
                w.attrs.append(obj)
        elif node.op == "output":
            w.lines.append(f"    return {w.expr(node.args[0])}")
            result = w.value(node.args[0])
            break
        elif _kernel_call(node):
            inputs = [w.value(a) for a in node.args]
            launch = node.target._direct.get(fingerprint(inputs)) if w.all_fixed(node) \
                else None
            joined = ", ".join(w.expr(a) for a in node.args)
            if launch is not None:
                w.lines.append(f"    {name} = {w.bind('L', launch.fast)}(({joined},))")
                w.env[node] = launch.fast(inputs)
                w.fixed.add(node)
            else:
                if w.all_fixed(node):
                    w.complete = False  # it prepares its launch now
                w.lines.append(f"    {name} = {w.bind('K', node.target)}({joined})")
                w.env[node] = node.target(*inputs)
        else:
            if not _only_read_by(node):  # it may move a tensor's storage (set_, resize_):
                w.flush()  # views made before it are made before it
            name = _call(w, gm, node, name)
        w.names[node] = name
    if w.escaped or _escapes(w):
        return None, result, w.attrs, w.complete
    source = f"def forward({', '.join(params)}):\n" + "\n".join(_release(w.lines)) + "\n"
    # a name of its own, with its lines in linecache while it lives: tracebacks show
    # them, and so does compile._raised_before_writes's check of the line that raised
    forward = PythonCode(source, w.namespace).compile(
        f"<fxlite-straight-line-{next(_NUMBERS)}>")
    return forward, result, w.attrs, w.complete


def _release(lines: list[str]) -> list[str]:
    """Drop each value after the last line that reads it, as eager Python's locals die:
    without it a forward keeps every intermediate alive until it returns (a training
    step's segment held all of its activations and gradients at once).

    Before and after::

        v1 = _K1((a0,))                      v1 = _K1((a0,))
        v2 = _K2((v1,))                      v2 = _K2((v1,));  v1 = None
        v3 = _f3(v2, dim=1)                  v3 = _f3(v2, dim=1);  v2 = None
        return v3                            return v3
    """
    # the values each line reads: its words that name a value made above it, right of
    # its " = " (a regex: ast.parse of each line took 18 ms for 276 lines on the CPU, in
    # the call that writes the forward; a look-alike in a string only lives longer)
    last: dict[str, int] = {}
    made: set[str] = set()
    for i, line in enumerate(lines):
        assigned = _ASSIGN.match(line)
        for n in _READ.findall(line[assigned.end():] if assigned else line):
            if n in made:
                last[n] = i
        if assigned:
            made.add(assigned[1])
            last.setdefault(assigned[1], i)  # a value no line reads dies where it is made
    dead: dict[int, list[str]] = {}
    for n, i in last.items():
        if not lines[i].lstrip().startswith("return"):
            dead.setdefault(i, []).append(n)
    return [line + (f";  {' = '.join(sorted(dead[i]))} = None" if i in dead else "")
            for i, line in enumerate(lines)]


def _call(w: _Writer, gm: Any, node: Node, name: str) -> str:
    """Run an op other than a kernel; returns the name its value goes by. A view or size
    read of constants becomes a constant; anything else is called as the graph calls it."""
    if node.op == "call_module":
        fn: Any = gm.get_submodule(node.target)
    elif node.op == "call_method":
        fn = None
    else:
        fn = node.target
    args, kwargs = w.value(node.args), w.value(node.kwargs)
    if node.op == "call_method":
        out = getattr(args[0], node.target)(*args[1:], **kwargs)
    else:
        out = fn(*args, **kwargs)
    w.env[node] = out
    if (_trusted(node) or _integer_index(node, args)) and w.all_fixed(node):
        w.fixed.add(node)
        op = target_name(node)
        bases = [w.env[n] for n in node.all_input_nodes if isinstance(w.env[n], torch.Tensor)]
        hoist = (op in _SIZES and not isinstance(out, torch.Tensor)) or (
            op in _VIEWS and w.all_const(node) and _shares_memory(out, bases)
            and not (out.requires_grad and torch.is_grad_enabled()) and _only_read(node))
        if hoist and not node.meta.get("impure"):
            w.const.add(node)
            return w.bind("c", out)
        if w.defer(node, out):
            return name
    w.call_line(node, name, fn)
    return name


def _drop_dead(w: _Writer, dead: Sequence[Node]) -> None:
    """Forget the values whose last reader ran (``freed_after``), as the written forward
    does (:func:`_release`): the run that writes it is the segment's first call of its
    kernels, whose activations would otherwise all live until it returns (a GPT-2 step's
    first kernel call peaked 1.5 GiB above the next ones).

    A view left unwritten (:meth:`_Writer.defer`) is forgotten too once its last reader
    ran: that reader was a view written from the chain's first tensor, or nothing reads
    it. The chain's first tensor is kept while an unwritten view of it is left, and
    forgotten once none is (``held``). Before, both lived to the end of the call: the
    writing call of vit_b_16 peaked at 5x eager's memory, every layer's activations kept
    by its attention's views."""
    for n in dead:
        w.deferred.pop(n, None)
    roots = {root for root, _ in w.deferred.values()}
    for n in [*w.held, *dead]:
        if n.op in ("placeholder", "get_attr") or n in w.const or n not in w.env:
            continue
        if n in roots:  # an unwritten view will be written from it: dropped after that
            w.held.add(n)
            continue
        w.held.discard(n)
        if _aliases_bound(w, w.env[n]):
            w.escaped = True  # (what _escapes would have found at the end)
        del w.env[n]


def _aliases_bound(w: _Writer, value: Any) -> bool:
    bound = {id(w.env[n]) for n in w.const if n.op != "get_attr" and n in w.env
             and isinstance(w.env[n], torch.Tensor)}
    return bool(bound) and any(id(x) in bound for x in _flat(value))


def _escapes(w: _Writer) -> bool:
    """Whether a value bound once comes back from an op as itself (``flatten`` of a 1-d
    view returns its input): the caller or a later op could then change it in place."""
    bound = {id(w.env[n]) for n in w.const if n.op != "get_attr"
             and isinstance(w.env[n], torch.Tensor)}
    if not bound:
        return False
    for node, v in w.env.items():
        if node not in w.const and any(id(x) in bound for x in _flat(v)):
            return True
    return False


def _only_read(node: Node) -> bool:
    """Whether every user of ``node`` only reads it: kernels and torch ops that are not
    in place. A view bound once must not be returned (the caller could reshape it in
    place) nor reach an op that could change it."""
    return all(map(_only_read_by, node.users))


def _only_read_by(user: Node) -> bool:
    return _kernel_call(user) or (_trusted(user) and not target_name(user).endswith("_")
                                  and not user.meta.get("impure"))


_DATA_PTR = torch.Tensor.data_ptr


def _all_aligned(args: tuple, tensors: list[int]) -> bool:
    """Whether the tensors at ``tensors`` in ``args`` all start 16-byte aligned."""
    return not any([_DATA_PTR(args[i]) & 15 for i in tensors])


class Forward(NamedTuple):
    """A straight-line forward kept for one layout of a segment's arguments."""

    run: Callable[..., Any]
    check: AttrCheck  # the attribute tensors still have the layouts it was written for
    rewrites: int  # times it is written again if incomplete; 0 once complete


class _Last(NamedTuple):
    """The forward a :class:`StraightRunner` checks a call against first."""

    layout: LayoutCheck  # the arguments' layouts (torch's guard, and their types)
    ints: tuple[tuple[int, bool], ...]  # (place, whether in int32's range) of each int
    forward: Forward


def _ints_fit(args: tuple, ints: tuple[tuple[int, bool], ...]) -> bool:
    """Whether each int of ``args`` at the places ``ints`` names is in int32's range
    where it was, and out of it where it was (a kernel is specialized on it)."""
    for i, small in ints:
        if (-(2**31) <= args[i] < 2**31) != small:
            return False
    return True


class StraightRunner:
    """Runs a compiled segment's graph through its straight-line forwards, one per layout
    of the arguments (made on first use), or through ``gm.forward`` where none can be.

    Valid wherever the segment runs: the compiled function reaches a segment only under
    the ambient and module state its path was recorded in, and the rest (the arguments'
    layouts, the attributes' layouts) is this runner's key and check. A forward written
    before every kernel had its launch prepared is written again on the next call (at
    most ``_REWRITES`` times), never left out: a call through it costs no more than one
    through ``gm.forward``, so a trial timing the segment's kernels is not misled.
    """

    _REWRITES = 2  # rewrites of an incomplete forward
    _LAYOUTS = 64  # forwards kept

    def __init__(self, gm: Any) -> None:
        self.gm = gm
        self.plain = type(gm).forward.__get__(gm)  # gm.forward without Module.__call__
        self.lines: dict[tuple, Forward] = {}  # by the arguments' layouts (fast_key)
        self.off = False
        self.writes = 0  # forwards written so far (first-call work: the trial leaves it out)
        # the last complete forward run, and a check that arguments have its layout
        self.last: _Last | None = None
        self._checks: dict[tuple, _Last | None] = {}

    def __call__(self, *args: Any) -> Any:
        if self.off:
            return self.plain(*args)
        last = self.last
        if last is not None and last.layout(args) and _all_aligned(args, last.layout.tensors) \
                and _ints_fit(args, last.ints) and last.forward.check():
            return last.forward.run(*args)
        key = fast_key(args)
        if key is None:
            return self.plain(*args)
        found = self.lines.get(key)
        if found is not None and found.check():
            if not found.rewrites:
                self._remember(key, args, found)
                return found.run(*args)
            rewrites = found.rewrites - 1
        else:
            rewrites = self._REWRITES
        made = straight_line(self.gm, args)
        self.writes += 1
        if made is None:
            self.off = True  # a graph it cannot write
            return self.plain(*args)
        forward, result, attrs, complete = made
        if forward is None:
            self.off = True  # a value bound once would reach the caller
        elif len(self.lines) < self._LAYOUTS or key in self.lines:
            self.lines[key] = Forward(forward, AttrCheck(attrs), 0 if complete else rewrites)
        return result

    def _remember(self, key: tuple, args: tuple, found: Forward) -> None:
        """Make ``found`` the forward that the next call checks first: torch's C++ guard
        over the arguments' layouts, their alignment and the ranges of their ints, about
        a third of the host time of their :func:`fast_key` (each region of a training
        step runs two such calls a step). Not where a tensor is not 16-byte aligned (the
        check asks all to be)."""
        last = self._checks.get(key, False)
        if last is False:
            if len(self._checks) >= self._LAYOUTS:
                return
            check = LayoutCheck(args)
            ints = tuple((i, -(2**31) <= a < 2**31) for i, a in enumerate(args)
                         if type(a) is int)
            last = _Last(check, ints, found) if check.ok and _all_aligned(
                args, check.tensors) else None
        elif last is not None and last.forward is not found:  # the key's, written again
            last = last._replace(forward=found)
        self._checks[key] = self.last = last

    def complete(self, key: tuple) -> Forward | None:
        """The finished forward for the layout ``key`` (a :func:`fast_key`), if there is
        one."""
        found = self.lines.get(key) if not self.off else None
        return found if found is not None and not found.rewrites else None
