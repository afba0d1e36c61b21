"""Our GGML type table against the `gguf` package's (llama.cpp's enum and type traits, kept by others)."""

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from llmopt.model.ggml_types import GGML_TYPES, GGML_TYPES_BY_ID


def test_every_type_gguf_knows_has_its_id_and_geometry():
    assert set(GGML_TYPES) == {t.name for t in GGMLQuantizationType}
    for t in GGMLQuantizationType:
        row = GGML_TYPES[t.name]
        assert row.id == int(t)
        assert (row.block, row.nbytes) == GGML_QUANT_SIZES[t]
        assert GGML_TYPES_BY_ID[int(t)] is row
