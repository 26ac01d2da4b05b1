"""``specforge.engines.gguf_header`` reads what gguf-py's GGUFReader reads from a GGUF's header (the
reference: the converter's own library), on a file gguf-py's GGUFWriter writes with every value type,
a tokenizer-sized string array, and float and quantized tensors. Cut short or not a GGUF: ValueError,
and the llama.cpp wrapper then treats it as unknown (llama-server says what is wrong)."""

import numpy as np
import pytest

from specforge.engines import llamacpp
from specforge.engines.gguf_header import SMALL_ARRAY, read_gguf_header

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "t.gguf"
    w = gguf.GGUFWriter(str(path), "eagle3")
    w.add_uint32("t.u32", 7)
    w.add_int32("t.i32", -3)
    w.add_uint64("t.u64", 2**40)
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", -1.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.layers", [4, 13, 23])  # the converter's target layer ids
    w.add_array("t.floats", [0.25, 0.5])
    w.add_token_list([f"tok{i}" for i in range(50_000)])  # a string array: skipped by its lengths
    w.add_array("t.long", list(range(SMALL_ARRAY + 1)))  # a long numeric array: skipped
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((8, 32), dtype=np.float32))
    w.add_tensor("b.weight", rng.standard_normal((4, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_header_equals_gguf_pys_reading(written):
    ours, ref = read_gguf_header(str(written)), gguf.GGUFReader(str(written))
    assert ours.architecture == "eagle3"
    assert ours.tensors == tuple((t.name, int(t.tensor_type)) for t in ref.tensors)
    assert [kind for _, kind in ours.tensors] == [0, 1, int(gguf.GGMLQuantizationType.Q8_0)]
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):  # the reader's own pseudo-fields (version, counts)
            continue
        value = ours.fields[key]
        if key in ("tokenizer.ggml.tokens", "t.long"):
            assert value is None, key  # skipped, and what follows them still read right (the tensors)
        elif field.types[0] == gguf.GGUFValueType.STRING:
            assert value == bytes(field.parts[field.data[0]]).decode(), key
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            assert value == pytest.approx([field.parts[i][0] for i in field.data]), key
        else:
            assert value == pytest.approx(field.parts[field.data[0]][0]), key
    assert set(ours.fields) == {k for k in ref.fields if not k.startswith("GGUF.")}
    assert ours.fields["t.layers"] == [4, 13, 23] and ours.fields["t.bool"] is True


def test_a_cut_or_foreign_file_is_refused_and_the_wrapper_calls_it_unknown(written, tmp_path):
    data = written.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 3])  # inside the token list
    with pytest.raises(ValueError, match="cut short|past the end"):
        read_gguf_header(str(cut))
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        read_gguf_header(str(other))
    empty = tmp_path / "empty.gguf"
    empty.touch()
    with pytest.raises(ValueError, match="empty"):
        read_gguf_header(str(empty))
    for f in (cut, other, empty):
        assert llamacpp._gguf_header(str(f), f.stat().st_mtime_ns) is None
        with pytest.raises(ValueError, match="has architecture None"):
            llamacpp.gguf_spec_type(f)


def test_the_wrapper_reads_the_draft_architecture_and_quantization(written, tmp_path):
    """gguf_spec_type finds the algorithm by the header's architecture (and tensor names); a target's
    architecture is refused naming it. _quantized sees the Q8_0 tensor, and none in an F32-only file."""
    assert llamacpp._quantized(str(written), written.stat().st_mtime_ns)
    assert llamacpp.gguf_spec_type(written) == "draft-eagle3"
    plain = tmp_path / "plain.gguf"
    w = gguf.GGUFWriter(str(plain), "llama")
    w.add_tensor("a.weight", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert not llamacpp._quantized(str(plain), plain.stat().st_mtime_ns)  # the control: F32 only
    with pytest.raises(ValueError, match="has architecture 'llama'"):
        llamacpp.gguf_spec_type(plain)
