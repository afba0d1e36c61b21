"""GGUF files written by llmopt: llama.cpp reads them, and their bytes equal llama.cpp's own quantizer's."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmopt.calibration.imatrix import Imatrix
from llmopt.formats.gguf.mixes import MIXES, requires_imatrix
from llmopt.formats.gguf.writer import plan_gguf, write_gguf
from llmopt.model import open_model
from tests.formats.gguf.llama_cpp_helpers import gguf_types, llama_dry_run_types, llama_quantize
from tests.formats.gguf.models import make_wide_hf


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory):
    """family -> (HF dir, llmopt's F16 GGUF of it)."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in cache:
            root = tmp_path_factory.mktemp(f"wide-{family}")
            hf = make_wide_hf(root / "hf", family, layers=2, tie=family == "qwen2")
            cache[family] = (hf, write(hf, root / "F16.gguf", "F16"))
        return cache[family]

    return get


def write(hf: Path, out: Path, mix: str, **kwargs) -> Path:
    importance = kwargs.pop("importance", None)
    with open_model(hf) as src:
        plan = plan_gguf(src, mix, has_imatrix=importance is not None, **kwargs)
        path = write_gguf(src, out, plan, importance=importance)
    assert path.stat().st_size == plan.file_nbytes
    return path


def blocks(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        block, nbytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        data = np.asarray(t.data).view(np.uint8)
        out[t.name] = (t.tensor_type.name, data.reshape(-1, nbytes) if block > 1 else data.reshape(-1, 1))
    return out


def assert_same_as_llama_cpp(ours: Path, theirs: Path) -> None:
    a, b = blocks(ours), blocks(theirs)
    assert {n: t for n, (t, _) in a.items()} == {n: t for n, (t, _) in b.items()}
    for name, (_, data) in a.items():
        same = (data == b[name][1]).all(axis=1)
        assert same.all(), f"{name}: {100 * same.mean():.2f}% of blocks identical"


QUANTIZED_MIXES = [m for m in MIXES if m not in ("F16", "BF16")]
# llama-quantize refuses these without an imatrix (very-low-bit i-quant tensors): tested with one below
IMATRIX_MIXES = ["IQ3_XXS", "IQ3_XS", "IQ2_M", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S", "Q2_K_S"]


@pytest.mark.parametrize(("family", "mix"), [("llama", m) for m in QUANTIZED_MIXES if m not in IMATRIX_MIXES]
                         + [("qwen2", m) for m in ("Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M")])
def test_every_mix_is_byte_identical_to_llama_quantize(wide, tmp_path: Path, family: str, mix: str) -> None:
    hf, f16 = wide(family)
    ours = write(hf, tmp_path / "ours.gguf", mix)
    theirs = llama_quantize(f16, tmp_path / "theirs.gguf", mix)
    assert_same_as_llama_cpp(ours, theirs)


# llama.cpp builds its IQ1 neighbour lists on first use (~13 s on one core): the IQ1 mixes are slow-marked
@pytest.mark.parametrize("mix", ["Q4_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "TQ1_0",
                                 "IQ3_M", *(m if not m.startswith("IQ1") else pytest.param(m, marks=pytest.mark.slow)
                                            for m in IMATRIX_MIXES)])  # fmt: skip
def test_imatrix_weighted_mixes_are_byte_identical(wide, tmp_path: Path, mix: str) -> None:
    hf, f16 = wide("llama")
    names = [n for n in gguf_types(f16) if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n]
    g = torch.Generator().manual_seed(0)
    with open_model(hf) as src:
        cols = {n: src.arch.intermediate_size if "ffn_down" in n else src.arch.hidden_size for n in names}
    importance = {n: torch.rand(c, generator=g) ** 3 * 5 for n, c in cols.items()}
    ours = write(hf, tmp_path / "ours.gguf", mix, importance=importance)
    theirs = llama_quantize(f16, tmp_path / "theirs.gguf", mix, imatrix={n: v.numpy() for n, v in importance.items()})
    assert_same_as_llama_cpp(ours, theirs)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_llama_cpp_reads_our_f16_like_the_source(wide, family: str) -> None:
    """Same tokens and the same next-token logits as our own decoder on the HF source."""
    from llama_cpp import Llama

    from llmopt.model.decoder import Decoder

    hf, f16 = wide(family)
    text = "The quick brown fox jumps over the lazy dog."
    with open_model(hf) as src:
        ids = src.tokenizer().encode(text)
        ref = Decoder.from_source(src)(torch.tensor([ids]))[0].detach()
    llm = Llama(model_path=str(f16), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids
    llm.eval(ids)
    logits = torch.tensor(np.asarray(llm.scores[: len(ids)]))
    assert torch.allclose(logits, ref, atol=2e-2, rtol=0), (logits - ref).abs().max()


def test_f16_round_trips_through_our_reader(wide) -> None:
    hf, f16 = wide("llama")
    with open_model(hf) as a, open_model(f16) as b:
        assert set(a.tensors) == set(b.tensors)
        for name in a.tensors:
            assert torch.equal(a.load(name, torch.float32), b.load(name, torch.float32)), name


def test_tensor_type_overrides_and_output_type_match_llama_cpp(wide, tmp_path: Path) -> None:
    hf, f16 = wide("llama")
    overrides = [(r"blk\.[01]\.ffn_down", "Q8_0"), ("attn_q", "Q3_K")]
    ours = write(hf, tmp_path / "ours.gguf", "Q4_K_M", overrides=overrides, output_tensor_type="Q5_K")
    theirs = llama_quantize(f16, tmp_path / "theirs.gguf", "Q4_K_M", overrides=overrides, output_tensor_type="Q5_K")
    assert_same_as_llama_cpp(ours, theirs)


def test_mxfp4_tensors_by_override_match_llama_cpp(wide, tmp_path: Path) -> None:
    """MXFP4 goes on chosen tensors (under MXFP4_MOE a dense model is all Q8_0), NVFP4 too (no mix has it)."""
    hf, f16 = wide("llama")
    overrides = [("ffn_", "MXFP4"), ("attn_[qk]", "TQ2_0"), ("attn_v", "IQ4_XS"), ("attn_output", "NVFP4")]
    ours = write(hf, tmp_path / "ours.gguf", "MXFP4_MOE", overrides=overrides)
    theirs = llama_quantize(f16, tmp_path / "theirs.gguf", "MXFP4_MOE", overrides=overrides)
    assert {"MXFP4", "NVFP4"} <= set(gguf_types(ours).values())
    assert_same_as_llama_cpp(ours, theirs)


@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4"])
def test_new_types_read_back_as_their_grid_dequantizes(wide, tmp_path: Path, type_name: str) -> None:
    """Reading our file (open_model, what inspect/convert/runtime use) gives exactly the grid's values."""
    from llmopt.quant.grids import quantize

    hf, _ = wide("llama")
    out = write(hf, tmp_path / "t.gguf", "Q8_0", overrides=[("ffn_down", type_name)])
    with open_model(hf) as src, open_model(out) as back:
        names = [n for n in src.tensors if n.endswith("mlp.down_proj.weight")]
        for name in names:
            expected = quantize(type_name, src.load(name, torch.float32)).dequantize()
            assert torch.equal(back.load(name, torch.float32), expected), name


def test_plan_types_equal_llama_cpp_dry_run_for_every_mix(wide) -> None:
    hf, f16 = wide("qwen2")
    with open_model(hf) as src:
        for mix in MIXES:
            if mix in ("F16", "BF16"):
                continue
            ours = {t.gguf_name: t.type_name for t in plan_gguf(src, mix).tensors}
            assert ours == llama_dry_run_types(f16, mix), mix


def test_metadata_and_provenance(wide, tmp_path: Path) -> None:
    from llmopt.formats.gguf.writer import Provenance

    hf, _ = wide("qwen2")
    prov = Provenance(command="llmopt convert x --to gguf", imatrix_file="im.gguf", imatrix_datasets=["wiki.txt"],
                      imatrix_entries=7, imatrix_chunks=3)
    out = write(hf, tmp_path / "q.gguf", "Q4_K_M", provenance=prov)
    fields = gguf.GGUFReader(str(out)).fields
    value = {k: f.contents() for k, f in fields.items() if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                                                                       "tokenizer.ggml.token_type")}
    assert value["general.architecture"] == "qwen2" and value["general.file_type"] == 15
    assert value["general.quantization_version"] == 2
    assert value["quantize.imatrix.file"] == "im.gguf" and value["quantize.imatrix.chunks_count"] == 3
    assert value["quantize.imatrix.entries_count"] == 7 and value["quantize.imatrix.dataset"] == "wiki.txt"
    assert value["llmopt.command"] == "llmopt convert x --to gguf"
    assert value["tokenizer.ggml.model"] == "gpt2" and value["tokenizer.ggml.pre"] == "gpt-2"


def test_failure_leaves_no_partial_file(wide, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import llmopt.formats.gguf.writer as writer

    hf, _ = wide("llama")
    calls = {"n": 0}
    real = writer.encode_tensor

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "encode_tensor", failing)
    target = tmp_path / "out.gguf"
    with pytest.raises(RuntimeError):
        write(hf, target, "Q4_K_M")
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_imatrix_object_feeds_the_writer(wide, tmp_path: Path) -> None:
    hf, f16 = wide("llama")
    im = Imatrix(sums={"blk.0.ffn_down.weight": torch.arange(512, dtype=torch.float64)}, counts={"blk.0.ffn_down.weight": 4})
    ours = write(hf, tmp_path / "ours.gguf", "Q4_K_M", importance=im.importance())
    theirs = llama_quantize(f16, tmp_path / "theirs.gguf", "Q4_K_M",
                            imatrix={n: v.numpy() for n, v in im.importance().items()})
    assert_same_as_llama_cpp(ours, theirs)


@pytest.mark.parametrize("mix", ["IQ2_XXS", "IQ3_XXS", "IQ2_S", "Q2_K_S"])
def test_llama_quantize_refuses_what_we_refuse_before_writing(wide, tmp_path: Path, mix: str) -> None:
    """Very-low-bit i-quants without an imatrix (ggml itself refuses IQ2_XXS; llama-quantize also
    IQ3_XXS and IQ2_S, and a tensor its imatrix lacks): one line naming the first such tensor and
    its type, before any byte is written."""
    from llmopt.errors import InputError

    hf, f16 = wide("llama")
    with pytest.raises(AssertionError, match="llama_model_quantize failed"):
        llama_quantize(f16, tmp_path / "theirs.gguf", mix)

    def needs(has_imatrix: bool) -> list:
        with open_model(hf) as src:
            plan = plan_gguf(src, mix, has_imatrix=has_imatrix)
        return [t for t in plan.tensors if requires_imatrix(t.gguf_name, t.type_name, plan.mix)]

    def first(t) -> str:  # noqa: ANN001
        label = re.escape(f"{mix}'s Q2_K") if t.type_name == "Q2_K" else t.type_name  # (Q2_K needs it only in Q2_K_S)
        return rf"^{label} needs an importance matrix for {re.escape(t.gguf_name)} [^\n]*$"

    with pytest.raises(InputError, match=first(needs(False)[0])):
        write(hf, tmp_path / "out.gguf", mix)
    wanted = needs(True)
    partial = {t.gguf_name: torch.ones(t.shape[-1]) for t in wanted[1:]}  # an imatrix that lacks one of them
    with pytest.raises(InputError, match=first(wanted[0])):
        write(hf, tmp_path / "out.gguf", mix, importance=partial)
    assert list(tmp_path.glob("*out.gguf*")) == []


@pytest.mark.parametrize("mix", ["Q4_K_M", "IQ4_XS", "Q8_0"])
def test_big_tensors_encoded_in_slabs_match_llama_cpp(wide, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       mix: str) -> None:  # fmt: skip
    """With slabs of 7 rows (so every tensor but Q/K, and an uneven last slab), read from the HF dir and
    from the F16 GGUF, with an imatrix: the bytes are still llama.cpp's."""
    from llmopt.formats.gguf import writer

    hf, f16 = wide("llama")
    with open_model(hf) as src:
        arch = src.arch
    g = torch.Generator().manual_seed(1)
    names = [n for n in gguf_types(f16) if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n]
    importance = {n: torch.rand(arch.intermediate_size if "ffn_down" in n else arch.hidden_size, generator=g) ** 3
                  for n in names}
    theirs = llama_quantize(f16, tmp_path / "theirs.gguf", mix, imatrix={n: v.numpy() for n, v in importance.items()})
    slabs = []
    real = writer._encode_slabs
    monkeypatch.setattr(writer, "_encode_slabs", lambda *a: slabs.append(a[1].gguf_name) or real(*a))
    monkeypatch.setattr(writer, "SLAB_BYTES", 7 * 4 * arch.hidden_size)
    for source in (hf, f16):
        slabs.clear()
        assert_same_as_llama_cpp(write(source, tmp_path / "ours.gguf", mix, importance=importance), theirs)
        assert "token_embd.weight" in slabs and "blk.0.ffn_down.weight" in slabs and "blk.0.attn_q.weight" not in slabs


@pytest.mark.parametrize(("mix", "loaded"), [("Q4_K_M", True), ("Q8_0", True), ("F16", False)])
def test_kernels_a_plan_needs_are_loaded_before_its_first_tensor(wide, tmp_path: Path, mix: str, loaded: bool) -> None:
    """In a fresh process: a plan with quantized types loads numba's kernels (every GGUF search's one
    definition) before its first tensor; a float file never loads them."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from llmopt.model import open_model\n"
            "from llmopt.formats.gguf.writer import GGUFWriter, plan_gguf\n"
            f"src = open_model(Path({str(wide('llama')[0])!r}))\n"
            f"w = GGUFWriter(src, Path({str(tmp_path / 'm.gguf')!r}), plan_gguf(src, {mix!r}))\n"
            "print('llmopt.quant.grids.compiled' in sys.modules)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split()[-1] == str(loaded)
