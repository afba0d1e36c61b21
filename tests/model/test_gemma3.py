"""Gemma 3 (text), llmopt/model/families/gemma3.py: (1 + w) norms, sandwich norms, q/k norms, GeGLU,
the embedding scaled by sqrt(hidden), sliding-window and global layers with their own rope bases.

The random model has google/gemma-3-1b-it's published config (config.json: hidden 1152, 26 layers,
4 heads, 1 KV head, head_dim 256, intermediate 6912, sliding_window 512, every 6th layer global,
rope_theta 1e6, rope_local_base_freq 1e4, query_pre_attn_scalar 256, rms_norm_eps 1e-6, tied
embeddings) scaled down: hidden 576 (like 1152, not a multiple of 256, so K-quant rows fall back
the same way), intermediate 2 x hidden, 7 layers (five sliding, one global, one sliding), window 16
so that prompts of 40+ tokens cross it; head_dim, the GQA ratio and the pattern are kept.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from llmopt.errors import InputError
from llmopt.model import open_model
from llmopt.model.arch import ArchSpec
from llmopt.model.decoder import Decoder
from tests.factories import make_tokenizer, perturb_norms

HEAD_DIM, WINDOW = 256, 16


def gemma3_config(vocab: int, layers: int = 7, hidden: int = 576, **overrides: object) -> transformers.Gemma3TextConfig:
    published = dict(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=HEAD_DIM, vocab_size=vocab, sliding_window=WINDOW, rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0, query_pre_attn_scalar=256, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    config = transformers.Gemma3TextConfig(**{**published, **overrides})
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def make_tiny_gemma3(directory: Path, layers: int = 7, seed: int = 0, **overrides: object) -> Path:
    """A random Gemma 3 saved by transformers, with the tests' BPE tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(directory)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(gemma3_config(tok.get_vocab_size(), layers, **overrides))
    perturb_norms(model)  # the (1 + w) norms start at w = 0
    model.save_pretrained(directory)
    return directory


def ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def reference(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_config_is_read_as_published(tmp_path) -> None:
    path = make_tiny_gemma3(tmp_path / "g", layers=7)
    with open_model(path) as src:
        arch = src.arch
    assert arch.family.name == "gemma3" and arch.sliding_window == WINDOW and arch.head_dim == HEAD_DIM
    assert arch.rope_theta == 1_000_000.0 and arch.extra["rope_local_base_freq"] == 10_000.0
    assert arch.extra["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert "model.layers.0.pre_feedforward_layernorm.weight" in src.tensors


@pytest.mark.parametrize("overrides", [{}, {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                                       {"query_pre_attn_scalar": 144}], ids=["1b", "linear-rope", "scalar"])
def test_logits_match_transformers(tmp_path, overrides: dict) -> None:
    """Float32 logits on 48 tokens (past the window) equal transformers' Gemma3ForCausalLM; the
    4b-style linear rope scaling of global layers and a query_pre_attn_scalar other than head_dim
    (27B's form: hidden / heads) too."""
    path = make_tiny_gemma3(tmp_path / "g", **overrides)
    x = ids(48)
    with open_model(path) as src, torch.no_grad():
        ours = Decoder.from_source(src)(x)
    diff = (ours - reference(path)(x).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_written_config_reads_back_in_transformers(tmp_path) -> None:
    """to_hf_config: transformers builds the same model from the config llmopt writes."""
    path = make_tiny_gemma3(tmp_path / "g")
    with open_model(path) as src:
        cfg = src.arch.to_hf_config("float32")
    again = ArchSpec.from_hf_config(cfg)
    assert again == src.arch and again.extra["layer_types"] == src.arch.extra["layer_types"]
    ref = transformers.Gemma3TextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    assert ref.layer_types == src.arch.extra["layer_types"] and ref.hidden_activation == "gelu_pytorch_tanh"
    assert ref.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0


def test_softcapping_is_refused(tmp_path) -> None:
    cfg = gemma3_config(300).to_dict()
    cfg["final_logit_softcapping"] = 30.0
    with pytest.raises(InputError, match="final_logit_softcapping"):
        ArchSpec.from_hf_config(cfg)


def test_published_1b_config_reads_as_the_preset() -> None:
    """google/gemma-3-1b-it's config.json as published (transformers 4.50's form: rope_theta,
    rope_local_base_freq, sliding_window_pattern, no layer_types) reads as the gemma-3-1b preset."""
    from llmopt.model.families.gemma3 import layer_types, local_base, query_scalar
    from llmopt.plan.presets import get_preset

    published = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144,
        "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0, "torch_dtype": "bfloat16",
    }  # fmt: skip
    arch, preset = ArchSpec.from_hf_config(published), get_preset("gemma-3-1b").arch
    assert arch == preset
    assert layer_types(arch) == layer_types(preset) and layer_types(arch).count("full_attention") == 4
    assert local_base(arch) == local_base(preset) == 10000.0 and query_scalar(arch) == 256
