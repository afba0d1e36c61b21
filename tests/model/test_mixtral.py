"""Mixtral, the first mixture-of-experts family (llmopt/model/families/mixtral.py, llmopt/model/moe.py):
each token's top-2 of 8 experts, weights renormalised, experts as SwiGLU.

The random model has mistralai/Mixtral-8x7B-v0.1's published config scaled down in layers and width:
8 experts, 2 per token, head_dim 128, a 4:1 GQA ratio (32:8 in the original), rope base 1e6,
RMSNorm eps 1e-5, no sliding window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from llmopt.errors import InputError
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from tests.factories import make_tokenizer, perturb_norms

HEAD_DIM, EXPERTS, PER_TOKEN = 128, 8, 2


def make_tiny_mixtral(directory: Path, layers: int = 2, hidden: int = 256, ffn: int = 256, seed: int = 0) -> Path:
    """A random Mixtral saved by transformers (one safetensors tensor per expert linear), with a BPE tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(directory)
    heads = hidden * 2 // HEAD_DIM  # q is twice as wide as hidden (head_dim kept, width scaled down)
    config = transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads // 4, head_dim=HEAD_DIM, num_local_experts=EXPERTS, num_experts_per_tok=PER_TOKEN,
        vocab_size=tok.get_vocab_size(), max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-5,
        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():  # routers that prefer different experts per token, so routing matters
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20.0)
    perturb_norms(model)
    model.save_pretrained(directory)
    return directory


def ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def reference(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_logits_match_transformers(tmp_path) -> None:
    path = make_tiny_mixtral(tmp_path / "mixtral")
    x = ids(48)
    with open_model(path) as src, torch.no_grad():
        arch = src.arch
        assert arch.family.name == "mixtral" and arch.extra["num_experts"] == EXPERTS and arch.extra["experts_per_token"] == PER_TOKEN
        assert src.tensors["model.layers.1.block_sparse_moe.experts.7.w2.weight"].shape == (arch.hidden_size, arch.intermediate_size)
        model = Decoder.from_source(src)
        ours = model(x)
        moe = model.layers[0].block_sparse_moe
        chosen, _ = moe.route(model.layers[0].post_attention_layernorm(model.embed_tokens(x))[0])
    assert len(chosen.unique()) > PER_TOKEN  # the tokens spread over the experts
    diff = (ours - reference(path)(x).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_parameter_count_and_routing_weights(tmp_path) -> None:
    """Every expert tensor is read, and each token's two weights sum to 1 (Mixtral renormalises)."""
    path = make_tiny_mixtral(tmp_path / "mixtral", layers=1)
    ref = reference(path)
    with open_model(path) as src, torch.no_grad():
        assert src.parameter_count == sum(p.numel() for p in ref.parameters())
        expert = ref.model.layers[0].mlp.experts
        f = src.arch.intermediate_size
        assert torch.equal(src.load("model.layers.0.block_sparse_moe.experts.5.w1.weight"), expert.gate_up_proj[5, :f])
        assert torch.equal(src.load("model.layers.0.block_sparse_moe.experts.5.w3.weight"), expert.gate_up_proj[5, f:])
        model = Decoder.from_source(src)
        _, weights = model.layers[0].block_sparse_moe.route(torch.randn(10, src.arch.hidden_size))
    assert weights.shape == (10, PER_TOKEN) and torch.allclose(weights.sum(-1), torch.ones(10))


def test_missing_expert_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = make_tiny_mixtral(tmp_path / "mixtral", layers=1)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.0.block_sparse_moe.experts.6.w3.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"experts\.6\.w3\.weight is missing"):
        open_model(path)
