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
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from typing import Any

import torch

__all__ = ["SerializationError", "read", "write"]

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
_MAX_HEADER = 1 << 31


class SerializationError(ValueError):
    """``save`` met something it cannot store, or ``load`` a file it will not trust (one
    ``fxlite.save`` did not write, or that was truncated or changed since)."""


def _checksum(index: dict[str, Any], graph: str, data: bytes | memoryview) -> str:
    h = hashlib.sha256(json.dumps(index, sort_keys=True).encode())
    h.update(graph.encode())
    h.update(data)
    return h.hexdigest()


def write(path: str | os.PathLike, graph: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``graph`` (a JSON string) and ``tensors`` to ``path``, replacing it atomically."""
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
    data = b"".join(chunks)
    header = dict(index)
    header["__metadata__"] = {"format": "fxlite", "fxlite.graph": graph,
                              "fxlite.sha256": _checksum(index, graph, data)}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read(path: str | os.PathLike) -> tuple[str, dict[str, torch.Tensor]]:
    """The graph JSON string and the tensors of a file written by :func:`write`.

    Raises:
        SerializationError: naming what is wrong (too short, a bad header, offsets past the end,
            a checksum mismatch...).
    """
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise SerializationError(f"the file is {len(blob)} bytes long, too short for a header (truncated?)")
    (size,) = struct.unpack("<Q", blob[:8])
    if size > min(len(blob) - 8, _MAX_HEADER):
        raise SerializationError(f"the header claims {size} bytes but the file holds {len(blob) - 8} after "
                        "the length field: the file is truncated or not an fxlite file")
    try:
        header = json.loads(blob[8:8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SerializationError(f"the header is not valid JSON ({e}): the file is damaged") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise SerializationError("the header has no __metadata__: this is not a file fxlite.save wrote")
    meta = header.pop("__metadata__")
    graph, digest = meta.get("fxlite.graph"), meta.get("fxlite.sha256")
    if meta.get("format") != "fxlite" or not isinstance(graph, str) or not isinstance(digest, str):
        raise SerializationError("the header's __metadata__ lacks the fxlite graph: this is a safetensors "
                        "file, but not one fxlite.save wrote")
    data = memoryview(blob)[8 + size:]
    tensors: dict[str, torch.Tensor] = {}
    end = 0
    for key, entry in sorted(header.items(), key=lambda kv: _offsets(kv[0], kv[1])[0]):
        begin, stop = _offsets(key, entry)
        dtype = DTYPES.get(entry.get("dtype"))
        shape = entry.get("shape")
        if dtype is None:
            raise SerializationError(f"tensor {key!r} has unknown dtype {entry.get('dtype')!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise SerializationError(f"tensor {key!r} has a bad shape {shape!r}")
        numel = 1
        for d in shape:
            numel *= d
        if begin != end or stop > len(data) or stop - begin != numel * dtype.itemsize:
            what = "past the end of the file (truncated?)" if stop > len(data) else \
                "inconsistent with its shape and dtype, or overlapping another tensor"
            raise SerializationError(f"tensor {key!r}: bytes {begin}..{stop} are {what}")
        end = stop
        raw = bytearray(data[begin:stop])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        tensors[key] = flat.view(dtype).reshape(shape)
    if end != len(data):
        raise SerializationError(f"{len(data) - end} bytes after the last tensor: the file was changed")
    if _checksum(header, graph, data) != digest:
        raise SerializationError("checksum mismatch: the graph or the tensor data changed after the file "
                        "was saved (a damaged or edited file)")
    return graph, tensors


def _offsets(key: str, entry: Any) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise SerializationError(f"tensor {key!r} has bad data_offsets {offsets!r}")
    return offsets[0], offsets[1]
