"""Our grids against llama.cpp's quantizer (ggml_quantize_chunk) and the gguf package, byte for byte."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmopt.errors import InputError
from llmopt.formats.gguf.blocks import pack
from llmopt.quant.grids import GRIDS, quantize
from tests.quant.grids.ggml_reference import ggml_dequantize, ggml_quantize

NEW_TYPES = ["IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "IQ3_XXS", "IQ2_XXS",
             "IQ2_XS", "IQ3_S", "IQ2_S", "IQ1_S", "IQ1_M", "Q1_0", "Q2_0"]
NEEDS_IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ1_S"}  # llama.cpp asserts (aborts) without one: we refuse with a one-line error
# llama.cpp builds the IQ1 neighbour lists on first use (~13 s on one core): their byte tests are slow-marked
SLOW_REFERENCE = {"IQ1_S", "IQ1_M"}
NOT_IN_GGUF = {"Q1_0", "Q2_0"}  # types the `gguf` package cannot dequantize (Q2_0: not even name): llama.cpp's to_float
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", *NEW_TYPES]  # all also on
# denormals (`edge_weights`)
# relative RMS error of the grids whose codes are not plain b-bit integers (the others: by bits); ternary
# with d = max|x| rounds most Gaussian weights to 0
# (IQ2_XXS: 2 bits, weighted by a random imatrix that all but ignores most columns; the 1-bit types: their
# levels are little more than signs)
MAX_ERROR = {"IQ4_NL": 0.1, "IQ4_XS": 0.1, "TQ1_0": 0.85, "TQ2_0": 0.85, "MXFP4": 0.13, "NVFP4": 0.12, "IQ3_XXS": 0.25,
             "IQ2_XXS": 0.6, "IQ2_XS": 0.5, "IQ3_S": 0.25, "IQ2_S": 0.45, "IQ1_S": 0.8, "IQ1_M": 0.7, "Q1_0": 0.8,
             "Q2_0": 0.8}  # fmt: skip
LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def weights(rows: int = 48, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """fp16-representable weights (as from an fp16 checkpoint) with the awkward cases mixed in."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[1] = 0.0  # all-zero row
    w[2] = 0.25  # constant row
    w[3, ::7] = 0.0
    w[4, 5] = 3.0  # outlier
    w[5] = w[5].abs()  # no negative value
    w[6] = -w[6].abs()  # no positive value
    w[7] = torch.randint(-3, 4, (cols,), generator=g) * 0.01  # few distinct values: ties everywhere
    w[8, : cols // 2] = 0.0
    w[9] = torch.randn(cols, generator=g) * 300
    w[10] = -0.0  # signed zeros: C keeps the sign of the first one it meets
    w[10, 3::5] = 0.0
    return w.half().float()


def edge_weights(rows: int = 24, cols: int = 512) -> torch.Tensor:
    """`weights` plus float32 denormals and tiny values (below and above ggml's 1e-15 all-zero threshold)."""
    g = torch.Generator().manual_seed(7)
    w = weights(rows, cols, seed=5)
    w[11] = torch.randn(cols, generator=g) * 1e-40  # every value denormal
    w[12, ::3] = torch.randn(w[12, ::3].shape, generator=g) * 1e-39  # denormals among normal values
    w[13] = torch.randn(cols, generator=g) * 1e-16  # all below the threshold
    w[14] = torch.randn(cols, generator=g) * 1e-12  # tiny but quantized
    w[15, :256] = 1e-38  # constant, just above the smallest normal
    w[16] = torch.randn(cols, generator=g) * 5000  # NVFP4: max/6 above UE4M3's largest scale (448)
    w[17] = torch.randn(cols, generator=g) * 0.005  # NVFP4: max/6 among UE4M3's subnormal scales
    w[18, 32:64] = 0.0  # all-zero sub-blocks inside a live super-block (IQ3_S then writes later ones a slot early)
    w[18, 128:144] = 0.0
    w[19, 256:288] = torch.randn(32, generator=g) * 1e-40  # one denormal sub-block among normal ones
    return w


def importance(kind: str, cols: int = 512) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "zeros":
        return torch.zeros(cols)
    g = torch.Generator().manual_seed(1)
    return torch.rand(cols, generator=g) ** 4 * 10  # a few channels dominate, as in real imatrices


def usable_importance(type_name: str, kind: str) -> torch.Tensor | None:
    """`importance(kind)`, or the random one where the type cannot do without."""
    return importance("random" if kind == "none" and type_name in NEEDS_IMATRIX else kind)


def assert_same_bytes_as_llama_cpp(type_name: str, w: torch.Tensor, imp: torch.Tensor | None) -> None:
    if imp is None and type_name in NEEDS_IMATRIX:  # llama.cpp would abort the process: check our refusal
        with pytest.raises(InputError, match=f"^{type_name} needs an importance matrix[^\n]*$"):
            quantize(type_name, w)
        return
    ref = ggml_quantize(type_name, w.numpy(), None if imp is None else imp.numpy())
    ours = pack(quantize(type_name, w, imp))
    assert ours.shape == ref.shape
    differing = np.flatnonzero((ours != ref).any(axis=1))
    assert differing.size == 0, f"rows {differing.tolist()} differ from llama.cpp"


@pytest.mark.parametrize("imatrix", ["none", "random", "zeros"])
@pytest.mark.parametrize("type_name", [t for t in TYPES if t not in SLOW_REFERENCE])
def test_bytes_match_llama_cpp(type_name: str, imatrix: str) -> None:
    assert_same_bytes_as_llama_cpp(type_name, weights(), importance(imatrix))


@pytest.mark.parametrize("imatrix", ["none", "random", "zeros"])
@pytest.mark.parametrize("type_name", [t for t in TYPES if t not in SLOW_REFERENCE])
def test_edge_values_match_llama_cpp(type_name: str, imatrix: str) -> None:
    """Denormals and tiny values, through the compiled searches."""
    assert_same_bytes_as_llama_cpp(type_name, edge_weights(), importance(imatrix))


@pytest.mark.slow
@pytest.mark.parametrize("type_name", sorted(SLOW_REFERENCE))
def test_iq1_bytes_match_llama_cpp(type_name: str) -> None:
    """IQ1_S / IQ1_M on the awkward rows and on denormals, with a random, an all-zero and no imatrix
    (the compiled split scan and neighbour search)."""
    for w in (weights(), edge_weights()):
        for imatrix in ("none", "random", "zeros"):
            assert_same_bytes_as_llama_cpp(type_name, w, importance(imatrix))


@pytest.mark.parametrize("type_name", LEGACY)
def test_legacy_bytes_match_gguf_package(type_name: str) -> None:
    w = weights()[11:]  # the gguf package and C disagree on the sign of zero in all-zero blocks
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[type_name])
    assert np.array_equal(pack(quantize(type_name, w)), ref)


@pytest.mark.parametrize("imatrix", ["none", "random"])
@pytest.mark.parametrize("type_name", [t for t in TYPES if t not in NOT_IN_GGUF])
def test_dequantize_equals_gguf_package(type_name: str, imatrix: str) -> None:
    w = weights(rows=16, seed=3)
    qt = quantize(type_name, w, usable_importance(type_name, imatrix))
    theirs = gguf.quants.dequantize(pack(qt), gguf.GGMLQuantizationType[type_name])
    assert np.array_equal(qt.dequantize().numpy(), theirs.reshape(w.shape))


@pytest.mark.parametrize("type_name", ["Q1_0", "Q2_0", "IQ1_S", "IQ1_M"])
def test_dequantize_equals_llama_cpp(type_name: str) -> None:
    """Our values of our bytes are llama.cpp's own dequantization (its type traits' to_float)."""
    w = edge_weights()
    qt = quantize(type_name, w, usable_importance(type_name, "random"))
    assert np.array_equal(qt.dequantize().numpy(), ggml_dequantize(type_name, pack(qt)))


@pytest.mark.parametrize("type_name", TYPES)
def test_quantized_tensor_contract(type_name: str) -> None:
    w = weights(rows=24, seed=4)
    qt = quantize(type_name, w, usable_importance(type_name, "none"))
    assert qt.grid == type_name and qt.shape == tuple(w.shape)
    assert int(qt.codes.max()) < 2**qt.bits
    assert qt.scales.shape[1] * qt.group_size == w.shape[1]
    err = (qt.dequantize() - w)[11:].pow(2).mean().sqrt() / w[11:].pow(2).mean().sqrt()
    assert err < (MAX_ERROR[type_name] if type_name in MAX_ERROR else {2: 0.45, 3: 0.25, 4: 0.12, 5: 0.06, 6: 0.03, 8: 0.01}[qt.bits])


def test_rejects_rows_that_do_not_fill_blocks() -> None:
    with pytest.raises(InputError):
        quantize("Q4_K", torch.zeros(4, 576))
    with pytest.raises(InputError):
        quantize("Q4_0", torch.zeros(4, 48))
    with pytest.raises(InputError):
        quantize("Q8_1", torch.zeros(4, 256))
    assert set(GRIDS) == set(TYPES)


def _lattice(type_name: str):  # noqa: ANN202 - a Lattice
    from llmopt.quant.grids import iq1, iq_lattice

    return iq1.IQ1_LATTICE if type_name.startswith("IQ1") else getattr(iq_lattice, f"{type_name}_LATTICE")


@pytest.mark.parametrize("type_name", ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S"])
def test_lattice_reads_back_as_the_gguf_packages_grid(type_name: str) -> None:
    """Our point list (llama.cpp's search grid) with its read-back levels is gguf's dequantization grid
    (IQ1: ggml-common.h's iq1s_grid, before the ±1/8 shift)."""
    lattice = _lattice(type_name)
    quant = gguf.quants._type_traits[gguf.GGMLQuantizationType[type_name]]
    quant.init_grid()
    assert np.array_equal(lattice.read_values.numpy(), quant.grid.reshape(lattice.read_values.shape))


@pytest.mark.parametrize(("type_name", "keys"), [("IQ3_XXS", (1, 7, 100, 4095)), ("IQ1_S", (1, 4, 100, 43689))])
def test_lattice_neighbour_lists(type_name: str, keys: tuple[int, ...]) -> None:
    """Every off-lattice key's candidates are the points at its `nwant` smallest distances (IQ3: two,
    IQ1: three), nearest first, then by index (iq3xs_init_impl / iq2xs_init_impl)."""
    lat = _lattice(type_name)
    for key in keys:
        assert lat.index_of_key[key] < 0
        pos = 2 * lat.keys[key] + 1
        d2 = ((2 * lat.coords + 1 - pos) ** 2).sum(axis=1)
        nearest = np.unique(d2)[: lat.nwant]
        cand = [int(c) for c in lat.neighbours[key] if c >= 0]
        assert cand == sorted(np.flatnonzero(np.isin(d2, nearest)).tolist(), key=lambda j: (d2[j], j))
