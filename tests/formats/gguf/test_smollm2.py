"""The real model: SmolLM2-135M (fp16 HF directory) written as GGUF, checked by llama.cpp."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmopt.formats.gguf.writer import plan_gguf, write_gguf
from llmopt.model import open_model
from llmopt.quant.grids import quantize
from tests.formats.gguf.llama_cpp_helpers import llama_dry_run_types, llama_quantize
from tests.formats.gguf.test_writer import assert_same_as_llama_cpp

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(smollm2_hf: Path, tmp_path_factory: pytest.TempPathFactory):
    """mix -> llmopt's GGUF of SmolLM2 (written once per module)."""
    root = tmp_path_factory.mktemp("smol-gguf")
    cache: dict[str, Path] = {}

    def get(mix: str) -> Path:
        if mix not in cache:
            with open_model(smollm2_hf) as src:
                cache[mix] = write_gguf(src, root / f"{mix}.gguf", plan_gguf(src, mix))
        return cache[mix]

    return get


def answer(path: Path) -> str:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=128, verbose=False, n_threads=2)
    out = llm.create_chat_completion(messages=QUESTION, max_tokens=12, temperature=0)
    return out["choices"][0]["message"]["content"]


@pytest.mark.parametrize("mix", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M",
                                 "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS",
                                 "TQ1_0", "TQ2_0", "MXFP4_MOE"])
def test_llama_cpp_loads_and_generates(smol, tmp_path: Path, mix: str) -> None:
    """Every type and mix, written from the fp16 HF dir, loads in llama.cpp and answers as the file
    llama-quantize makes of that type from the same F16 does, on this machine's kernels (another
    CPU rounds otherwise, so the answer itself is never written down here)."""
    ours = answer(smol(mix))
    assert len(ours.split()) >= 3
    theirs = answer(llama_quantize(smol("F16"), tmp_path / f"{mix}.gguf", mix, nthread=2))
    assert ours == theirs


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q2_K", "Q8_0", "IQ4_XS", "TQ1_0", "TQ2_0"])
def test_same_bytes_as_llama_quantize_from_our_f16(smol, tmp_path: Path, mix: str) -> None:
    theirs = llama_quantize(smol("F16"), tmp_path / f"{mix}.gguf", mix, nthread=2)
    assert_same_as_llama_cpp(smol(mix), theirs)


def test_type_map_equals_llama_cpp_for_every_mix(smollm2_hf: Path, smol) -> None:
    from llmopt.formats.gguf.mixes import MIXES

    with open_model(smollm2_hf) as src:
        for mix in MIXES:
            if mix in ("F16", "BF16"):
                continue
            ours = {t.gguf_name: t.type_name for t in plan_gguf(src, mix).tensors}
            assert ours == llama_dry_run_types(smol("F16"), mix), mix


def test_legacy_bytes_and_dequantization_equal_the_gguf_package(smollm2_hf: Path, smol) -> None:
    """Q8_0 tensors equal gguf.quants.quantize of the permuted weights; every Q4_K_M tensor's
    gguf.quants.dequantize equals our QuantizedTensor.dequantize()."""
    from llmopt.model.families.base import permute_for_gguf

    q8 = {t.name: t for t in gguf.GGUFReader(str(smol("Q8_0"))).tensors}
    q4km = {t.name: t for t in gguf.GGUFReader(str(smol("Q4_K_M"))).tensors}
    with open_model(smollm2_hf) as src:
        arch = src.arch
        for hf_name in src.tensors:
            name = arch.family.hf_to_gguf_name(hf_name)
            if name not in q8 or q8[name].tensor_type.name != "Q8_0" or not name.startswith("blk.3."):
                continue
            w = src.load(hf_name, torch.float32)
            heads = arch.family.qk_heads(hf_name, arch.num_heads, arch.num_kv_heads)
            w = permute_for_gguf(w, heads) if heads else w
            assert np.array_equal(np.asarray(q8[name].data), gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0))
            t = q4km[name]
            if t.tensor_type.name in ("F32", "F16"):
                continue
            ours = quantize(t.tensor_type.name, w).dequantize().numpy()
            assert np.array_equal(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(ours.shape), ours)


def write_with_random_imatrix(hf: Path, out: Path, mix: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """`mix` written from `hf` with a random importance vector (seeded) for every 2-D block tensor."""
    g = torch.Generator().manual_seed(0)
    with open_model(hf) as src:
        plan = plan_gguf(src, mix, has_imatrix=True)
        importance = {t.gguf_name: torch.rand(t.shape[-1], generator=g) ** 3 * 5 + 0.01 for t in plan.tensors
                      if t.gguf_name.startswith("blk.") and len(t.shape) == 2}  # fmt: skip
        return write_gguf(src, out, plan, importance=importance), importance


@pytest.mark.parametrize("mix", ["IQ2_XXS", "IQ3_M", "Q2_K_S"])
def test_i_quant_mixes_with_an_imatrix(smollm2_hf: Path, smol, tmp_path: Path, mix: str) -> None:
    """Mixes llama-quantize refuses without an importance matrix (lattice i-quants; Q2_K_S's Q2_K): with
    one (random, the same for both tools) our file is block-for-block llama_model_quantize's of our F16,
    loads in llama.cpp and answers. (SmolLM2's 576-wide rows fall back to IQ4_NL or Q4_K; ffn_down,
    1536 wide, takes the imatrix types.) Three mixes on the real model, one per family of rules (the
    IQ1 and the other IQ2/IQ3 mixes cost 20-50 s each here); every imatrix mix is byte-checked on a
    random model in test_writer.py."""
    from tests.formats.gguf.test_writer import blocks

    ours, importance = write_with_random_imatrix(smollm2_hf, tmp_path / "ours.gguf", mix)
    needs = {n for n, (t, _) in blocks(ours).items() if t.startswith(("IQ2", "IQ3")) or (mix == "Q2_K_S" and t == "Q2_K")}
    assert any("ffn_down" in n for n in needs)  # the types llama-quantize will not write without an imatrix
    theirs = llama_quantize(smol("F16"), tmp_path / "theirs.gguf", mix, nthread=2,
                            imatrix={n: v.numpy() for n, v in importance.items()})  # fmt: skip
    assert_same_as_llama_cpp(ours, theirs)
    assert len(answer(ours).split()) >= 3


@pytest.mark.parametrize("mix", ["IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ2_S", "IQ2_XS", "IQ2_M", "IQ1_S", "IQ1_M"])
def test_the_other_i_quant_mixes_load_and_generate(smollm2_hf: Path, tmp_path: Path, mix: str) -> None:
    """The i-quant mixes not above, written from SmolLM2 with a random imatrix: llama.cpp loads each and
    generates (their bytes are checked against llama_model_quantize's on a random model in
    test_writer.py; a random imatrix makes the low-bit answers noise, so only that they come is checked).
    Each file holds its mix's own type on ffn_down (1536 wide; the 576-wide rows fall back)."""
    from llama_cpp import Llama

    from tests.formats.gguf.test_writer import blocks

    ours, _ = write_with_random_imatrix(smollm2_hf, tmp_path / "ours.gguf", mix)
    types = {t for n, (t, _) in blocks(ours).items() if "ffn_down" in n}
    assert any(t.startswith(mix[:3]) for t in types), types
    llm = Llama(model_path=str(ours), n_ctx=128, verbose=False, n_threads=2)
    out = llm.create_completion("The capital of France is", max_tokens=8, temperature=0)
    assert out["usage"]["completion_tokens"] >= 1 and out["choices"][0]["text"]
