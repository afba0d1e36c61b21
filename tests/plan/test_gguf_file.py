"""Whole-file GGUF sizes: header, metadata, tensor directory and padded data, to the byte."""

import struct
from collections import Counter

import pytest

from llmopt.errors import InputError
from llmopt.formats.gguf.types import tensor_nbytes
from llmopt.plan.gguf_file import estimated_metadata_bytes, gguf_file_bytes, measured_metadata_bytes, tensor_directory
from llmopt.plan.models import resolve_model


@pytest.mark.slow
def test_reproduces_the_real_smollm2_file_from_its_own_types(smollm2_gguf):
    import gguf

    model = resolve_model(str(smollm2_gguf))
    assert model.metadata_exact
    reader = gguf.GGUFReader(smollm2_gguf)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    assert tensor_directory(smollm2_gguf) == {name: (types[name], shapes[name]) for name in types}
    data_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert sum(tensor_nbytes(types[t.gguf_name], t.shape) for t in model.tensors) == data_bytes
    type_counts = Counter((types[t.gguf_name], t.shape) for t in model.tensors)
    assert gguf_file_bytes(model.tensors, type_counts, model.metadata_bytes, model.alignment) == smollm2_gguf.stat().st_size
    # the fast key/value walk agrees with gguf-py's full parse (the file already has both u32 keys)
    parsed = sum(sum(int(p.nbytes) for p in f.parts) for k, f in reader.fields.items() if not k.startswith("GGUF."))
    assert model.metadata_bytes == parsed


@pytest.mark.slow
def test_vocabulary_estimate_is_close_to_a_real_tokenizer(smollm2_gguf):
    measured, _ = measured_metadata_bytes(smollm2_gguf)
    estimate = estimated_metadata_bytes(49152)
    assert abs(estimate - measured) / measured < 0.05


@pytest.mark.slow
def test_truncated_metadata_is_an_input_error(smollm2_gguf, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(smollm2_gguf.read_bytes()[:100_000])
    with pytest.raises(InputError, match="truncated"):
        measured_metadata_bytes(bad)
    bad.write_bytes(b"GGML" + struct.pack("<IQQ", 3, 0, 0))
    with pytest.raises(InputError, match="not a GGUF"):
        measured_metadata_bytes(bad)
