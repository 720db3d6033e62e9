"""Check a GGUF file's layout against its own size before the ``gguf`` reader walks it.

NOTE: the ``gguf`` package's reader trusts every count in the header. Reading past the end
of its memory map gives empty arrays, not an error, so an array header claiming 10^9
scalars in a 200-byte file makes it loop 10^9 times appending empty arrays (gigabytes of
RSS, minutes of CPU) and a truncated file fails deep inside numpy with "index 0 is out of
bounds". ``check_layout`` walks the same structure with every length, count and tensor
extent bounded by the bytes left, so a hostile or truncated file is a ``GgufImportError``
naming the field and the byte offset, in time and memory proportional to the file.

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count × (key string, value type u32, value)       string = u64 length + bytes
    tensor_count × (name string, n_dims u32, dims u64×n, ggml type u32, data offset u64)
    padding to general.alignment, then the tensor data (each tensor inside the file)
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from weft.models.gguf_tokenizer import GgufImportError

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType → bytes
_STRING, _ARRAY = 8, 9
_MIN_SIZE = {**_SCALAR_SIZES, _STRING: 8, _ARRAY: 12}
_MAX_ARRAY_NESTING = 4
# The gguf reader builds a numpy array per array element (~700 bytes each): a 10 MB file
# holding 10^7 one-byte elements took 7 GB of RSS. Real vocabularies are under 300k
# tokens (tokens, scores, types, merges: four arrays of that size).
MAX_ARRAY_ELEMENTS = 1 << 21
MAX_TOTAL_ELEMENTS = 1 << 22
# Likewise per tensor; the largest real models have about 2,000 tensors.
MAX_TENSORS = 1 << 16
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Cursor:
    def __init__(self, data: mmap.mmap, order: str) -> None:
        self.data, self.order, self.offset = data, order, 0
        self.elements = 0  # array elements so far, all arrays

    def left(self) -> int:
        return len(self.data) - self.offset

    def take(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        if size > self.left():
            raise GgufImportError(f"the file ends inside {what} (byte {self.offset} of {len(self.data)}): "
                                  "truncated or corrupt")
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += size
        return value

    def count(self, what: str, min_item: int) -> int:
        n = self.take("Q", f"the count of {what}")
        if n * min_item > self.left():
            raise GgufImportError(f"{what} claims {n} entries, more than the {self.left()} bytes left in the file "
                                  "hold: truncated or corrupt")
        return n

    def string(self, what: str) -> str:
        n = self.take("Q", f"the length of {what}")
        if n > self.left():
            raise GgufImportError(f"{what} claims {n} bytes, more than the {self.left()} left in the file "
                                  f"(byte {self.offset - 8}): truncated or corrupt")
        raw = self.data[self.offset:self.offset + n]
        self.offset += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GgufImportError(f"{what} is not UTF-8 text (byte {self.offset - n}): corrupt") from exc


def _value(cur: _Cursor, kind: int, key: str, depth: int = 0) -> int | None:
    """Skip one value of ``kind``; returns it when it is an unsigned 32-bit scalar (alignment)."""
    if kind in _SCALAR_SIZES:
        fmt = {1: "B", 2: "H", 4: "I", 8: "Q"}[_SCALAR_SIZES[kind]]
        return cur.take(fmt, f"the value of {key}")
    if kind == _STRING:
        cur.string(f"the value of {key}")
        return None
    if kind != _ARRAY:
        raise GgufImportError(f"metadata key {key!r} has value type {kind}, which GGUF does not define: corrupt")
    if depth >= _MAX_ARRAY_NESTING:
        raise GgufImportError(f"metadata key {key!r} nests arrays more than {_MAX_ARRAY_NESTING} deep")
    item = cur.take("I", f"the item type of {key}")
    if item not in _MIN_SIZE:
        raise GgufImportError(f"metadata key {key!r} is an array of type {item}, which GGUF does not define: corrupt")
    n = cur.count(f"the array {key}", _MIN_SIZE[item])
    cur.elements += n
    if n > MAX_ARRAY_ELEMENTS or cur.elements > MAX_TOTAL_ELEMENTS:
        raise GgufImportError(f"the array {key} has {n} entries ({cur.elements} in all arrays so far), more than this "
                              f"importer reads ({MAX_ARRAY_ELEMENTS} per array, {MAX_TOTAL_ELEMENTS} in all)")
    if item in _SCALAR_SIZES:
        cur.offset += n * _SCALAR_SIZES[item]
    else:
        for _ in range(n):
            _value(cur, item, key, depth + 1)
    return None


def check_layout(path: Path) -> None:
    """Raise ``GgufImportError`` unless every header field and tensor of ``path`` lies inside it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as handle:
        if path.stat().st_size < 24:
            raise GgufImportError(f"{path.stat().st_size} bytes, too short for a GGUF header")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                raise GgufImportError("no GGUF magic at its start")
            order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
            cur = _Cursor(data, order)
            cur.offset = 4
            version = cur.take("I", "the version")
            if version not in (2, 3):
                raise GgufImportError(f"GGUF version {version} (supported: 2, 3)")
            tensor_count = cur.take("Q", "the tensor count")
            kv_count = cur.count("the metadata", 12)
            alignment = 32
            for _ in range(kv_count):
                key = cur.string("a metadata key")
                value = _value(cur, cur.take("I", f"the type of {key}"), key)
                if key == "general.alignment":
                    alignment = value or 0
            if tensor_count > MAX_TENSORS:
                raise GgufImportError(f"the tensor count {tensor_count} is more than this importer reads ({MAX_TENSORS})")
            if tensor_count * 32 > cur.left():
                raise GgufImportError(f"the tensor count {tensor_count} needs more than the {cur.left()} bytes left "
                                      "in the file: truncated or corrupt")
            tensors = []
            for _ in range(tensor_count):
                name = cur.string("a tensor name")
                n_dims = cur.take("I", f"the dimensions of tensor {name!r}")
                if not 1 <= n_dims <= _MAX_DIMS:
                    raise GgufImportError(f"tensor {name!r} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
                dims = [cur.take("Q", f"the shape of tensor {name!r}") for _ in range(n_dims)]
                kind = cur.take("I", f"the type of tensor {name!r}")
                tensors.append((name, dims, kind, cur.take("Q", f"the data offset of tensor {name!r}")))
            if alignment <= 0 or alignment & (alignment - 1):
                raise GgufImportError(f"general.alignment {alignment} is not a power of two")
            start = -(-cur.offset // alignment) * alignment
            for name, dims, kind, offset in tensors:
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                except ValueError:
                    raise GgufImportError(f"tensor {name!r} has type {kind}, which GGML does not define") from None
                elements = 1
                for d in dims:
                    elements *= d
                if dims[0] % block:
                    raise GgufImportError(f"tensor {name!r}: row of {dims[0]} is not a whole number of "
                                          f"{block}-element blocks")
                end = start + offset + elements // block * type_size
                if end > len(data):
                    raise GgufImportError(f"tensor {name!r} ends at byte {end}, past the end of the file "
                                          f"({len(data)} bytes): truncated or corrupt")
