"""Our GGML type table against the `gguf` package's (llama.cpp's enum and type traits, kept by others),
and the types it does not know yet against llama.cpp's own type traits; then each written type's parts
(grid, packer, dequantizer) against each other."""

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from llmopt.model.ggml_types import GGML_TYPES, GGML_TYPES_BY_ID, PARTS, GGMLQuantType
from tests.quant.grids.ggml_reference import ggml_geometry, ggml_type_id


def test_every_type_gguf_knows_has_its_id_and_geometry():
    assert set(GGML_TYPES) >= {t.name for t in GGMLQuantizationType}
    for t in GGMLQuantizationType:
        row = GGML_TYPES[t.name]
        assert row.id == int(t)
        if t.name != "Q8_1":  # gguf-py still has Q8_1's old float32 fields (40 bytes); ggml's block is 36
            assert (row.block, row.nbytes) == GGML_QUANT_SIZES[t]
        assert GGML_TYPES_BY_ID[int(t)] is row
        assert GGMLQuantType[t.name] == t and hash(GGMLQuantType[t.name]) == hash(t)  # keys of each other's tables


def test_every_type_has_llama_cpps_geometry():
    """ggml's own type traits are the authority (the GGUF reader's sizes and offsets follow them)."""
    for row in GGML_TYPES.values():
        assert row.id == ggml_type_id(row.name)
        assert (row.block, row.nbytes) == ggml_geometry(row.name), row.name


def test_the_types_gguf_does_not_know_are_llama_cpps():
    newer = set(GGML_TYPES) - {t.name for t in GGMLQuantizationType}
    assert newer == {"Q2_0"}  # (gguf 0.19; when it learns them, the test above covers them)
    for name in newer:
        row = GGML_TYPES[name]
        assert row.id == ggml_type_id(name) == GGMLQuantType[name]
        assert (row.block, row.nbytes) == ggml_geometry(name)


def test_every_named_part_resolves():
    """Each written type's grid, packer and dequantizer exist under the names PARTS gives, with the
    type's name and block; GRIDS and PACKERS hold exactly those types."""
    from llmopt.formats.gguf.blocks import PACKERS
    from llmopt.model import dequantize
    from llmopt.quant.grids import GRIDS

    for name, parts in PARTS.items():
        assert GRIDS[name].name == name and GRIDS[name].block == GGML_TYPES[name].block
        assert PACKERS[name].__name__ == parts.packer
        assert not parts.dequantizer or callable(getattr(dequantize, parts.dequantizer))
    assert list(GRIDS) == list(PACKERS) == list(PARTS)


def test_written_types_are_the_writable_ones():
    from llmopt.formats.gguf.types import FLOAT_TYPES, WRITABLE_TYPES

    assert set(PARTS) == set(WRITABLE_TYPES) - set(FLOAT_TYPES)
    assert list(PARTS) == sorted(PARTS, key=lambda name: GGML_TYPES[name].id)


@pytest.mark.parametrize("name", list(PARTS))
def test_written_type_parts_agree(name):
    """For every type llmopt writes, its parts line up: the grid's result packed into `nbytes` per
    `block`, and read back by the type's dequantizer (ours or the gguf package's) as the grid's own values."""
    import torch

    from llmopt.formats.gguf.blocks import pack
    from llmopt.model.dequantize import dequantize
    from llmopt.quant.grids import GRIDS

    t = GGML_TYPES[name]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 512, generator=g) * 0.02
    qt = GRIDS[name].quantize(w, torch.rand(512, generator=g) + 0.1)
    data = pack(qt)
    assert data.shape == (4, 512 // t.block * t.nbytes)
    assert np.array_equal(dequantize(data, GGMLQuantType[name]), qt.dequantize().numpy())
