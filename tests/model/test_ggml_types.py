"""Our GGML type table against the `gguf` package's (llama.cpp's enum and type traits, kept by others),
and the types it does not know yet against llama.cpp's own type traits."""

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from llmopt.model.ggml_types import GGML_TYPES, GGML_TYPES_BY_ID, GGMLQuantType
from tests.quant.grids.ggml_reference import ggml_geometry, ggml_type_id


def test_every_type_gguf_knows_has_its_id_and_geometry():
    assert set(GGML_TYPES) >= {t.name for t in GGMLQuantizationType}
    for t in GGMLQuantizationType:
        row = GGML_TYPES[t.name]
        assert row.id == int(t)
        assert (row.block, row.nbytes) == GGML_QUANT_SIZES[t]
        assert GGML_TYPES_BY_ID[int(t)] is row
        assert GGMLQuantType[t.name] == t and hash(GGMLQuantType[t.name]) == hash(t)  # keys of each other's tables


def test_the_types_gguf_does_not_know_are_llama_cpps():
    newer = set(GGML_TYPES) - {t.name for t in GGMLQuantizationType}
    assert newer == {"Q2_0"}  # (gguf 0.19; when it learns them, the test above covers them)
    for name in newer:
        row = GGML_TYPES[name]
        assert row.id == ggml_type_id(name) == GGMLQuantType[name]
        assert (row.block, row.nbytes) == ggml_geometry(name)
