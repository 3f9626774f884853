"""A GGUF file's metadata and tensor table, read in one pass over its header; its tensors' bytes mapped.

``gguf.GGUFReader`` makes a memory-mapped numpy view of every part of every metadata value: for a file whose
tokenizer holds 262,144 tokens (Gemma 3) that is seconds to tens of seconds on each load. The header is a
plain sequence (the GGUF specification: magic, version, counts, key/value pairs, tensor infos, aligned
data), read here with ``struct`` into Python values (numeric arrays as numpy arrays, views of the header's
bytes); the tensors' bytes stay in a read-only mapping of the file, each tensor a uint8 view of its own.
``gguf``'s constants name the value and tensor types and their block sizes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

__all__ = ["GGUFFile", "GGUFTensor"]

_MAGIC = b"GGUF"
_ALIGNMENT = 32  # general.alignment's default
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
    not GGUF, is of another version or byte order, or is cut short."""

    def __init__(self, path: str | Path) -> None:
        with Path(path).open("rb") as file:
            size = file.seek(0, 2)
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
        try:
            self.fields: dict[str, Any] = {}
            for _ in range(kv_count):
                key = self._string()
                self.fields[key] = self._value(GGUFValueType(self._unpack("<I")))
            infos = [self._tensor_info() for _ in range(tensor_count)]
        except (struct.error, UnicodeDecodeError) as err:
            raise ValueError(f"its header is cut short or corrupt ({err})") from err
        alignment = int(self.fields.get("general.alignment", _ALIGNMENT))
        start = -(-self._at // alignment) * alignment  # the tensors' data, aligned
        data = np.frombuffer(self._map, np.uint8)  # [size], read-only
        self.tensors: list[GGUFTensor] = []
        for name, shape, kind, offset in infos:
            block, type_size = GGML_QUANT_SIZES[kind]
            elements = int(np.prod(shape))
            if elements % block:
                raise ValueError(f"tensor {name} has {elements} values, not whole blocks of {block}")
            begin, end = start + offset, start + offset + elements // block * type_size
            if end > size:
                raise ValueError(f"tensor {name} ends at byte {end} of a {size}-byte file: cut short")
            self.tensors.append(GGUFTensor(name, shape, kind, begin, data[begin:end]))
        del self._buffer, buffer  # the views above keep the mapping

    def _unpack(self, form: str) -> Any:
        (value,) = struct.unpack_from(form, self._buffer, self._at)
        self._at += struct.calcsize(form)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        text = bytes(self._buffer[self._at : self._at + length])
        if len(text) != length:
            raise struct.error("a string runs past the end")
        self._at += length
        return text.decode("utf-8")

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
        if item == GGUFValueType.STRING:
            return [self._string() for _ in range(count)]
        if item not in _SCALARS:
            return [self._value(item) for _ in range(count)]  # arrays of arrays
        dtype = np.dtype("<" + _SCALARS[item])
        values = np.frombuffer(self._buffer, dtype, count, self._at)  # ValueError when cut short
        self._at += count * dtype.itemsize
        return values

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = self._unpack("<I")
        shape = tuple(self._unpack("<Q") for _ in range(dims))
        kind = self._unpack("<I")
        try:
            tensor_type = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"tensor {name} has unknown type {kind}") from None
        return name, shape, tensor_type, self._unpack("<Q")
