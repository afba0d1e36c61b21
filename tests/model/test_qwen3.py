"""Qwen3, the family added as one file (llmopt/model/families/qwen3.py): transformers' logits, a GGUF
that llama.cpp runs with our logits' top choices, and GPTQ through the pipeline.

The random model has Qwen3-0.6B's published shape scaled down: a head size of its own (q_proj twice
as wide as the hidden state), 2 query heads per KV head, RMSNorm on q and k, rope base 1e6.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from tests.factories import make_tiny_hf, write_checkpoint


def _ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def test_config_shape_and_logits_match_transformers(tmp_path) -> None:
    path = make_tiny_hf(tmp_path / "qwen3", "qwen3", tie=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _ids(40)
    with open_model(path) as src, torch.no_grad():
        arch = src.arch
        assert arch.family.name == "qwen3" and arch.family.qk_norm
        assert arch.num_heads * arch.head_dim == 2 * arch.hidden_size and arch.num_heads == 2 * arch.num_kv_heads
        ours = Decoder.from_source(src)
        diff = (ours(ids) - ref(ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_our_gguf_runs_in_llama_cpp_with_our_top1(tmp_path) -> None:
    """64 positions: llama.cpp's most likely next token on our F16 GGUF equals our decoder's (same weights)."""
    from llama_cpp import Llama

    from llmopt.api import convert_to_gguf

    path = make_tiny_hf(tmp_path / "qwen3", "qwen3", tie=True)
    gguf_path = tmp_path / "qwen3.gguf"
    convert_to_gguf(path, gguf_path, "F16")
    ids = _ids(64, seed=5)
    with open_model(gguf_path) as src, torch.no_grad():
        assert src.arch.family.name == "qwen3"
        ours = Decoder.from_source(src)(ids)[0]
    llm = Llama(model_path=str(gguf_path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids[0].tolist())
    theirs = torch.tensor(np.asarray(llm.scores[:64]))
    diff = (theirs - ours).abs().max().item()
    top2 = ours.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 4 * diff  # positions no kernel's rounding can flip
    assert diff < 1e-2 and int(clear.sum()) >= 60, (diff, int(clear.sum()))
    assert torch.equal(theirs.argmax(-1)[clear], ours.argmax(-1)[clear])
    assert (theirs.argmax(-1) == ours.argmax(-1)).sum() >= 63


def test_gptq_runs_through_the_pipeline(tmp_path) -> None:
    """Every linear of both blocks (q/k/v share a stage, the q/k norms sit inside it) is quantized,
    and the checkpoint loads back with the weights the pipeline produced."""
    path = make_tiny_hf(tmp_path / "qwen3", "qwen3")
    spec = QuantizeSpec(GPTQConfig(4, 32, True, group_aware=True), batch_size=2)
    produced: dict[str, torch.Tensor] = {}
    with open_model(path) as src:
        tokens = _ids(4 * 32).view(4, 32)
        blocks = quantize_model(src, spec, tokens)
        out = write_checkpoint(src, spec, blocks, tmp_path / "gptq",
                               on_block=lambda b: produced.update({k: v.dequantize() for k, v in b.tensors.items()}))
    assert len(produced) == 2 * 7
    with open_model(out) as q:
        assert q.arch.family.name == "qwen3" and "model.layers.0.self_attn.q_norm.weight" in q.tensors
        for module, w in produced.items():
            assert torch.equal(q.load(f"{module}.weight"), w), module
        logits = Decoder.from_source(q)(_ids(16))
    assert torch.isfinite(logits).all()
