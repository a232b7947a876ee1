"""tollway's GGUF reader gives what the gguf package's GGUFReader gives (metadata values as its
contents(), tensors' data byte for byte), in a fraction of its time, and a clear error for a file
that is not GGUF or is cut short."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from tollway.gguf_file import GGUFFile


def _same_as_gguf_package(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its header, as fields
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        value = field.contents()
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == ref.tensor_type and mine.shape == tuple(int(d) for d in ref.shape)
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data, ref.data), mine.name
    return ours


def test_the_tiny_model_reads_as_the_gguf_package_reads_it(tiny_gguf):
    ours = _same_as_gguf_package(tiny_gguf)
    assert ours.metadata["general.architecture"] == "llama" and len(ours.metadata["tokenizer.ggml.tokens"]) == 320
    assert {t.tensor_type for t in ours.tensors} == {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0}


def test_every_value_type_and_a_quantized_tensor(tmp_path):
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ world")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ünï"])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((4, 8)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = _same_as_gguf_package(path)
    assert ours.metadata["t.strs"] == ["a", "", "ünï"] and ours.metadata["t.u64"] == 2**63 + 5
    q8_tensor = next(t for t in ours.tensors if t.name == "q8")
    assert gguf.quants.dequantize(q8_tensor.data, q8_tensor.tensor_type).shape == (2, 64)


def test_a_file_that_is_not_gguf_or_is_cut_short_is_a_clear_error(tiny_gguf, tmp_path):
    other = tmp_path / "not.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(other)
    data = tiny_gguf.read_bytes()
    for cut in (10, 2000, len(data) - 100):
        short = tmp_path / f"short-{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="cut short|not a readable GGUF"):
            GGUFFile(short)


def test_an_array_is_read_when_first_looked_up_and_a_broken_one_is_a_clear_error_then(tmp_path):
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("t.strs", ["fine", "ünï"])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_uint32("t.after", 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = GGUFFile(path)
    assert ours.metadata["t.after"] == 7 and ours.metadata.get("t.nested") == [[1, 2], [3]]
    assert dict(ours.metadata.items())["t.strs"] == ["fine", "ünï"] and "t.missing" not in ours.metadata
    # Bytes that are not UTF-8 inside the vocabulary: the parse skips them, the first lookup says so.
    data = path.read_bytes().replace("ünï".encode(), b"\xff\xfe\xfd\xfc\xfb")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(data)
    reader = GGUFFile(broken)
    assert reader.metadata["t.after"] == 7
    with pytest.raises(ValueError, match="broken.gguf is not a readable GGUF file"):
        reader.metadata["t.strs"]
