"""The GGUF header reader (:mod:`verispec.models.gguf_file`) against ``gguf``'s own GGUFReader: the same
metadata of every value type, the same tensors and bytes; files cut short or foreign refused, and hostile
headers (dimensions, sizes, counts beyond the file) in one line before anything is made of them."""

from __future__ import annotations

import struct
import tracemalloc

import gguf
import numpy as np
import pytest

from verispec.models.gguf_file import GGUFFile


def write(path, alignment: int | None = None):
    """A GGUF file with metadata of every value type and tensors of several types."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.data_alignment = alignment
        writer.add_uint32("general.alignment", alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ 世界")
    writer.add_array("t.strings", ["a", "", "ß" * 300, "<bos>"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(0)
    writer.add_tensor("vector", rng.standard_normal(7).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((3, 64)).astype(np.float16))
    matrix = rng.standard_normal((4, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blocks", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_same_as_gguf_reader(tmp_path, alignment):
    path = write(tmp_path / "all.gguf", alignment)
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    got = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in ours.fields.items()}
    assert got == expected
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, other in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.shape == tuple(int(n) for n in other.shape) and mine.tensor_type == other.tensor_type
        assert mine.data_offset == other.data_offset and mine.n_bytes == other.n_bytes
        assert np.array_equal(mine.data, np.asarray(other.data).view(np.uint8).reshape(-1))


def test_cut_short_or_foreign_files_are_one_line_errors(tmp_path):
    path = write(tmp_path / "all.gguf")
    data = path.read_bytes()
    header_end = data.index(b"blocks") + 40  # inside the tensor table
    cases = {
        "short": (data[:10], "too short"),
        "magic": (b"GGML" + data[4:], "no GGUF magic"),
        "version": (data[:4] + (9).to_bytes(4, "little") + data[8:], "GGUF version 9"),
        "header": (data[:200], "cut short or corrupt"),
        "table": (data[:header_end], "cut short"),
        "data": (data[:-100], "tensor blocks ends at byte"),
    }
    for name, (content, message) in cases.items():
        broken = tmp_path / f"{name}.gguf"
        broken.write_bytes(content)
        with pytest.raises(ValueError, match=message) as err:
            GGUFFile(broken)
        assert "\n" not in str(err.value), name


def hostile(tmp_path, name: str, patch) -> str:
    """A GGUF file of a 4 MB tensor ``big`` (random bytes: a reader that takes them for dimensions makes a
    Python integer of each 8) and a small one, its header patched by ``patch(data, at)``: ``at`` is where
    ``big``'s number of dimensions lies in the tensor table (its dimensions, type and offset follow)."""
    writer = gguf.GGUFWriter(str(tmp_path / "source.gguf"), "llama")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_tensor(
        "big", np.random.default_rng(0).integers(1, 2**31, 2**20, dtype=np.int32).view(np.float32)
    )
    writer.add_tensor("small", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray((tmp_path / "source.gguf").read_bytes())
    entry = struct.pack("<Q", 3) + b"big"
    patch(data, data.index(entry) + len(entry))
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    "name, patch, message",
    [
        (
            "2^31 dims",
            lambda d, at: struct.pack_into("<I", d, at, 2**31),
            "tensor big has 2147483648 dimensions",
        ),
        (
            "0 dims",
            lambda d, at: struct.pack_into("<I", d, at, 0),
            r"tensor big has 0 dimensions \(GGUF: 1 to 4\)",
        ),
        (
            "5 dims",
            lambda d, at: struct.pack_into("<I", d, at, 5),
            r"tensor big has 5 dimensions \(GGUF: 1 to 4\)",
        ),
        (
            "a 0 dim",
            lambda d, at: struct.pack_into("<Q", d, at + 4, 0),
            r"tensor big has a dimension of 0: \[0\]",
        ),
        (
            "2^62 values",
            lambda d, at: struct.pack_into("<Q", d, at + 4, 2**62),
            rf"tensor big of \[{2**62}\] F32 takes {2**64} bytes, more than the \d+-byte file",
        ),
        (
            "2^40 tensors",
            lambda d, at: struct.pack_into("<Q", d, 8, 2**40),
            rf"cut short or corrupt: {2**40} tensors, more than its \d+ bytes left hold",
        ),
        (
            "2^40 items",
            lambda d, at: struct.pack_into("<Q", d, d.index(b"t.ints") + 6 + 4 + 4, 2**40),
            rf"cut short or corrupt: {2**40} items in metadata t.ints, more than its \d+ bytes left hold",
        ),
    ],
)
def test_a_hostile_header_is_refused_naming_what_is_wrong_before_any_allocation(
    tmp_path, name, patch, message
):
    """Issue 52's D7: a tensor claiming 2^31 dimensions had its "dimensions" read to the end of the file (1.1
    GB of memory for a 98 MB file) before a misleading "cut short"; 0 or 5 dimensions read as another type.
    Each claim is checked against the file before anything is made of it: one line naming the tensor (or the
    count) and what is wrong, in no more memory than the header itself takes."""
    path = hostile(tmp_path, name, patch)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=message) as err:
            GGUFFile(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(err.value)
    assert peak < 2**20  # the old reader: 20 MB of "dimensions" from this 4 MB file


@pytest.mark.parametrize("alignment", [0, 48])
def test_an_alignment_that_is_no_power_of_two_is_refused(tmp_path, alignment):
    path = write(tmp_path / "all.gguf", 64)
    data = bytearray(path.read_bytes())
    at = data.index(b"general.alignment") + len("general.alignment") + 4  # after the key and its type
    struct.pack_into("<I", data, at, alignment)
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"general.alignment is {alignment}, not a power of two"):
        GGUFFile(path)  # 0: a division by zero before
