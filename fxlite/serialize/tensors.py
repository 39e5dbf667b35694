"""The file ``fxlite.save`` writes: the safetensors layout, with the graph in its metadata.

::

    8 bytes       little-endian length N of the header
    N bytes       JSON: {"<key>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]}, ...,
                         "__metadata__": {"format": "fxlite", "fxlite.graph": "<graph JSON>",
                                          "fxlite.sha256": "<hex>"}}
    the rest      the tensors' bytes, back to back, in the order of their offsets

Any safetensors reader can open the tensors. Reading needs no pickle: the bytes become
tensors through ``torch.frombuffer``. The checksum covers the tensor index, the graph and
the data, so a damaged file is refused instead of loading wrong weights.

Reading is bounded the way safetensors' own reader is: the 8-byte length is checked against
the file's size and :class:`Limits` before the header is read, the header (a flat index; the
graph inside it is one string) is checked for nesting depth before it is parsed, and the
tensor index is checked against the file's size before any tensor byte is read. Each tensor
is then read into a buffer of exactly the size the index gives.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import stat
import struct
import sys
import time
from typing import IO, Any, NamedTuple

import numpy as np
import torch

__all__ = ["Limits", "SerializationError", "parse_json", "read", "write"]

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
_CODES = {v: k for k, v in DTYPES.items()}
_MAX_DIMS = 64
_MAX_DIM = 1 << 62


class SerializationError(ValueError):
    """``save`` met something it cannot store, or ``load`` a file it will not trust (one
    ``fxlite.save`` did not write, or that was truncated or changed since)."""


class Limits(NamedTuple):
    """What one ``fxlite.load`` may read and build; a file past any limit is refused with
    :class:`SerializationError` naming the limit. The defaults admit any file ``save`` writes
    for a model that fits in memory; lower them to load files from people you do not trust
    on a machine you share.

    Attributes:
        max_file_bytes: the whole file.
        max_header_bytes: the JSON header (the tensor index and the graph).
        max_json_depth: how deeply the header's and the graph's JSON may nest.
        max_nodes: nodes, over all the graphs in the file.
        max_values: stored values (constants, arguments and their parts), over the file.
        max_seconds: wall-clock time for the whole load.
    """

    max_file_bytes: int = 1 << 40
    max_header_bytes: int = 1 << 29
    max_json_depth: int = 512
    max_nodes: int = 5_000_000
    max_values: int = 50_000_000
    max_seconds: float = 600.0


def _checksum(index: dict[str, Any], graph: str) -> Any:
    """The running hash of a file; the tensor bytes are added to it in the order of the data."""
    h = hashlib.sha256(json.dumps(index, sort_keys=True).encode())
    h.update(graph.encode())
    return h


def write(path: str | os.PathLike, graph: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``graph`` (a JSON string) and ``tensors`` to ``path``, replacing it atomically.

    The bytes go to a fresh file in the same folder, created exclusively under a random name
    (so saves from several threads or processes never share one), which then replaces
    ``path`` in one step: a reader sees the old file or the new one, never a mix.
    """
    if sys.byteorder != "little":
        raise RuntimeError("fxlite.save writes little-endian files and needs a little-endian machine")
    index: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for key, t in tensors.items():
        code = _CODES.get(t.dtype)
        if code is None:
            raise TypeError(f"cannot save tensor {key!r}: dtype {t.dtype} has no safetensors code "
                            f"(supported: {', '.join(str(d) for d in DTYPES.values())})")
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise TypeError(f"cannot save tensor {key!r}: only dense tensors with data can be "
                            f"saved (this one is {t.layout}, on {t.device})")
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        index[key] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    h = _checksum(index, graph)
    for raw in chunks:
        h.update(raw)
    header = dict(index)
    header["__metadata__"] = {"format": "fxlite", "fxlite.graph": graph, "fxlite.sha256": h.hexdigest()}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(tmp, flags, 0o666)  # the umask applies, as for open(path, "wb")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for raw in chunks:
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)  # ours alone: created with O_EXCL under a random name
        except FileNotFoundError:
            pass
        raise


def read(path: str | os.PathLike, limits: Limits | None = None,
         deadline: float | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """The graph JSON string and the tensors of a file written by :func:`write`.

    Args:
        path: the file.
        limits: what the file may hold (default: :class:`Limits`'s defaults).
        deadline: a ``time.monotonic()`` value past which reading stops.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError: ``path`` is not a readable file.
        SerializationError: naming what is wrong (too short, too large, a bad header, offsets
            past the end, a checksum mismatch...).
    """
    limits = limits or Limits()
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) \
        | getattr(os, "O_BINARY", 0)  # O_NONBLOCK: opening a FIFO must not wait for a writer
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, "fxlite.load reads a file, not a folder", os.fspath(path))
        if not stat.S_ISREG(info.st_mode):
            raise SerializationError("this is not a regular file (a pipe, socket or device)")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        return _read(f, info.st_size, limits, deadline)


def _read(f: IO[bytes], size: int, limits: Limits, deadline: float | None) -> tuple[str, dict[str, torch.Tensor]]:
    if size > limits.max_file_bytes:
        raise SerializationError(f"the file is {size} bytes, over the limit of {limits.max_file_bytes} "
                                 "(Limits.max_file_bytes)")
    if size < 8:
        raise SerializationError(f"the file is {size} bytes long, too short for a header (truncated?)")
    (hsize,) = struct.unpack("<Q", _read_exactly(f, 8))
    if hsize > size - 8:
        raise SerializationError(f"the header claims {hsize} bytes but the file holds {size - 8} after "
                                 "the length field: the file is truncated or not an fxlite file")
    if hsize > limits.max_header_bytes:
        raise SerializationError(f"the header is {hsize} bytes, over the limit of "
                                 f"{limits.max_header_bytes} (Limits.max_header_bytes)")
    header = parse_json(_read_exactly(f, hsize), limits.max_json_depth, "the header")
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise SerializationError("the header has no __metadata__: this is not a file fxlite.save wrote")
    info = header.pop("__metadata__")  # (not a node's meta: the file's)
    graph, digest = info.get("fxlite.graph"), info.get("fxlite.sha256")
    if info.get("format") != "fxlite" or not isinstance(graph, str) or not isinstance(digest, str):
        raise SerializationError("the header's __metadata__ lacks the fxlite graph: this is a safetensors "
                                 "file, but not one fxlite.save wrote")
    entries = _index(header, size - 8 - hsize)  # checked whole before any tensor byte is read
    h = _checksum(header, graph)
    tensors: dict[str, torch.Tensor] = {}
    for key, dtype, shape, nbytes in entries:
        if deadline is not None and time.monotonic() > deadline:
            raise SerializationError("reading the tensors took longer than Limits.max_seconds")
        raw = bytearray(nbytes)
        if f.readinto(raw) != nbytes:
            raise SerializationError(f"tensor {key!r}: the file ended early (it changed while being read)")
        h.update(raw)
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensors[key] = flat.view(dtype).reshape(shape)
    if f.read(1):
        raise SerializationError("the file grew while it was read")
    if h.hexdigest() != digest:
        raise SerializationError("checksum mismatch: the graph or the tensor data changed after the file "
                                 "was saved (a damaged or edited file)")
    return graph, tensors


class _Entry(NamedTuple):
    key: str
    dtype: torch.dtype
    shape: list[int]
    nbytes: int


def _index(header: dict[str, Any], data_size: int) -> list[_Entry]:
    """The tensors in the order of their bytes, each checked against its shape, its dtype,
    its neighbours and the file's size."""
    entries = []
    end = 0
    for key, entry in sorted(header.items(), key=lambda kv: _offsets(kv[0], kv[1])):
        begin, stop = _offsets(key, entry)
        dtype = DTYPES.get(entry.get("dtype"))
        shape = entry.get("shape")
        if dtype is None:
            raise SerializationError(f"tensor {key!r} has unknown dtype {str(entry.get('dtype'))[:40]!r}")
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS
                and all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape)):
            raise SerializationError(f"tensor {key!r} has a bad shape {str(shape)[:60]}")
        numel = 1
        for d in shape:
            numel *= d
        if begin != end or stop > data_size or stop - begin != numel * dtype.itemsize:
            what = "past the end of the file (truncated?)" if stop > data_size else \
                "inconsistent with its shape and dtype, or overlapping another tensor"
            raise SerializationError(f"tensor {key!r}: bytes {begin}..{stop} are {what}")
        end = stop
        entries.append(_Entry(key, dtype, shape, stop - begin))
    if end != data_size:
        raise SerializationError(f"{data_size - end} bytes after the last tensor: the file was changed")
    return entries


def _offsets(key: str, entry: Any) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise SerializationError(f"tensor {key!r} has bad data_offsets {str(offsets)[:60]}")
    return offsets[0], offsets[1]


def _read_exactly(f: IO[bytes], n: int) -> bytes:
    raw = f.read(n)
    if len(raw) != n:
        raise SerializationError("the file ended early (it changed while being read)")
    return raw


_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b"\"[]{}")
_CHUNK = 1 << 24


def parse_json(raw: bytes, max_depth: int, what: str) -> Any:
    """``json.loads(raw)``, refused (naming ``what``) if it nests deeper than ``max_depth``.

    Why check first: Python's parser recurses once per level, so a deep document costs a
    deep stack before it fails, and the failure would name no limit.
    """
    depth = _json_depth(raw)
    if depth > max_depth:
        raise SerializationError(f"{what} nests {depth} levels deep, over the limit of {max_depth} "
                                 "(Limits.max_json_depth)")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SerializationError(f"{what} is not valid JSON ({e}): the file is damaged") from None


def _json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text, brackets inside strings left
    out, at C speed: once escaped backslashes and quotes are gone, every '"' opens or closes
    a string, so a running count of quotes says which brackets are structure."""
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    codes = np.frombuffer(plain, dtype=np.uint8)
    depth = deepest = quotes = 0
    for start in range(0, len(codes), _CHUNK):  # bounded temporaries, whatever the size
        c = codes[start:start + _CHUNK]
        in_string = (np.cumsum(c == ord('"'), dtype=np.int64) + quotes) & 1
        step = (c == ord("[")).astype(np.int64) + (c == ord("{")) - (c == ord("]")) - (c == ord("}"))
        level = np.cumsum(np.where(in_string == 1, 0, step)) + depth
        deepest, depth = max(deepest, int(level.max())), int(level[-1])
        quotes = int(in_string[-1])
    return deepest
