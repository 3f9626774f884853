"""A GGUF file's metadata and tensor table, read in one pass over its header; its tensors' bytes mapped.

``gguf.GGUFReader`` makes a memory-mapped numpy view of every part of every metadata value: for a file whose
tokenizer holds 262,144 tokens (Gemma 3) that is seconds to tens of seconds on each load. The header is a
plain sequence (the GGUF specification: magic, version, counts, key/value pairs, tensor infos, aligned
data), read here with ``struct`` into Python values (numeric arrays as numpy arrays, views of the header's
bytes); the tensors' bytes stay in a read-only mapping of the file, each tensor a uint8 view of its own.
``gguf``'s constants name the value and tensor types and their block sizes.

Every count and size the header claims is checked against the file's size before anything is made of it:
a tensor's number of dimensions (1 to 4, GGML_MAX_DIMS) before its dimensions are read, its bytes (from its
dimensions and type) before its view, the numbers of tensors, metadata keys and array items against the bytes
left; a hostile header costs no more memory than the file's own header does.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from verispec.errors import UsageError
from verispec.inputs import is_int

__all__ = ["GGUFFile", "GGUFTensor", "read_gguf"]

_MAGIC = b"GGUF"
_ALIGNMENT = 32  # general.alignment's default
_MAX_DIMS = 4  # GGML_MAX_DIMS: a tensor has 1 to 4 dimensions
_LENGTH = struct.Struct("<Q")  # a string's byte count
# the fewest bytes an entry can take, what a claimed count of them is checked against: a metadata key and
# value (key length, type, a 1-byte value), a tensor info (name length, n_dims, 1 dimension, type, offset),
# an array's item by its type (a string: its length; an array: its type and count)
_KEY_VALUE_BYTES, _TENSOR_INFO_BYTES, _STRING_BYTES, _ARRAY_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8, 8, 4 + 8
_SCALARS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the table: its name, shape (GGUF's order: the fastest dimension first), type, where its
    bytes start in the file, and ``data``: those bytes, a read-only uint8 view [n_bytes] of the mapping."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data_offset: int
    data: np.ndarray

    @property
    def n_bytes(self) -> int:
        return int(self.data.shape[0])


class GGUFFile:
    """The header of the GGUF file ``path``: ``fields`` (key → value: int, float, bool, str, a list of str,
    or a numpy array of numbers) and ``tensors`` in the file's order. ValueError (one line) when the file is
    not GGUF, is of another version or byte order, is cut short, or claims more than it holds (a count, a
    tensor's dimensions or bytes: checked before anything is made of them)."""

    def __init__(self, path: str | Path) -> None:
        with Path(path).open("rb") as file:
            size = self._size = file.seek(0, 2)
            if size < 24:
                raise ValueError(f"{size} bytes: too short for a GGUF header")
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)  # outlives the descriptor
        buffer = memoryview(self._map)
        if buffer[:4] != _MAGIC:
            raise ValueError("no GGUF magic at its start")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (read: 2, 3; a big-endian file reads as another)")
        self._buffer, self._at = buffer, 24
        self._check_count(kv_count, _KEY_VALUE_BYTES, "metadata keys")
        self._check_count(tensor_count, _TENSOR_INFO_BYTES, "tensors")
        try:
            self.fields: dict[str, Any] = {}
            for _ in range(kv_count):
                key = self._string()
                self.fields[key] = self._value(GGUFValueType(self._unpack("<I")), key)
            infos = [self._tensor_info() for _ in range(tensor_count)]
        except (struct.error, UnicodeDecodeError) as err:
            raise ValueError(f"its header is cut short or corrupt ({err})") from err
        alignment = self.fields.get("general.alignment", _ALIGNMENT)
        if not is_int(alignment) or alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment is {alignment!r}, not a power of two")
        start = -(-self._at // alignment) * alignment  # the tensors' data, aligned
        data = np.frombuffer(self._map, np.uint8)  # [size], read-only
        self.tensors: list[GGUFTensor] = []
        for name, shape, kind, offset, n_bytes in infos:
            begin, end = start + offset, start + offset + n_bytes
            if end > size:
                raise ValueError(f"tensor {name} ends at byte {end} of a {size}-byte file: cut short")
            self.tensors.append(GGUFTensor(name, shape, kind, begin, data[begin:end]))
        del self._buffer, buffer  # the views above keep the mapping

    def _check_count(self, count: int, least: int, what: str) -> None:
        """ValueError when ``count`` entries of at least ``least`` bytes each cannot fit in what is left."""
        left = self._size - self._at
        if count * least > left:
            raise ValueError(
                f"its header is cut short or corrupt: {count} {what}, more than its {left} bytes left hold"
            )

    def _unpack(self, form: str) -> Any:
        (value,) = struct.unpack_from(form, self._buffer, self._at)
        self._at += struct.calcsize(form)
        return value

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int) -> list[str]:
        """``count`` strings, each a uint64 length and its UTF-8 bytes (a vocabulary's 262k in a fraction of a
        second: one loop over locals)."""
        buffer, at, size, out = self._buffer, self._at, self._size, []
        for _ in range(count):
            (length,) = _LENGTH.unpack_from(buffer, at)
            at += 8
            if length > size - at:
                raise struct.error(f"a string of {length} bytes runs past the end")
            out.append(str(buffer[at : at + length], "utf-8"))
            at += length
        self._at = at
        return out

    def _value(self, kind: GGUFValueType, key: str) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
        least = (
            _STRING_BYTES
            if item == GGUFValueType.STRING
            else struct.calcsize(_SCALARS[item])
            if item in _SCALARS
            else _ARRAY_BYTES
        )
        self._check_count(count, least, f"items in metadata {key}")
        if item == GGUFValueType.STRING:
            return self._strings(count)
        if item not in _SCALARS:
            return [self._value(item, key) for _ in range(count)]  # arrays of arrays
        dtype = np.dtype("<" + _SCALARS[item])
        values = np.frombuffer(self._buffer, dtype, count, self._at)  # ValueError when cut short
        self._at += count * dtype.itemsize
        return values

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]:
        """A tensor's name, shape, type, offset in the data and bytes, each checked as soon as it is read."""
        name = self._string()
        dims = self._unpack("<I")
        if not 1 <= dims <= _MAX_DIMS:  # before reading them: a hostile count reads to the end of the file
            raise ValueError(f"tensor {name} has {dims} dimensions (GGUF: 1 to {_MAX_DIMS})")
        shape = tuple(self._unpack("<Q") for _ in range(dims))
        if 0 in shape:
            raise ValueError(f"tensor {name} has a dimension of 0: {list(shape)}")
        kind = self._unpack("<I")
        try:
            tensor_type = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"tensor {name} has unknown type {kind}") from None
        n_bytes = _n_bytes(name, shape, tensor_type)
        if n_bytes > self._size:
            raise ValueError(
                f"tensor {name} of {list(shape)} {tensor_type.name} takes {n_bytes} bytes, "
                f"more than the {self._size}-byte file"
            )
        return name, shape, tensor_type, self._unpack("<Q"), n_bytes


def read_gguf(path: str | Path) -> GGUFFile:
    """The memory-mapped file; UsageError (one line, naming it) when it is no readable GGUF file. Light to
    import (no torch): the command line checks a file with it before anything loads."""
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as err:  # truncated, corrupt, hostile, not GGUF
        raise UsageError(f"cannot read {path} as a GGUF file: {' '.join(str(err).split())}") from err


def _n_bytes(name: str, shape: tuple[int, ...], kind: GGMLQuantizationType) -> int:
    """The bytes of a tensor of ``shape`` and type ``kind`` (Python integers: no overflow, however large the
    dimensions); ValueError when its values are not whole blocks of its type."""
    block, type_size = GGML_QUANT_SIZES[kind]
    elements = math.prod(shape)
    if elements % block:
        raise ValueError(f"tensor {name} has {elements} values, not whole blocks of {block}")
    return elements // block * type_size
