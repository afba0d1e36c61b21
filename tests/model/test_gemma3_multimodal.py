"""Gemma 3 4B and larger (Gemma3ForConditionalGeneration, llmopt/model/multimodal.py): the language
model is read from the nested `text_config` and the prefixed tensors, the vision tower and projector
are set aside, and the result is the text model transformers' multimodal class runs on text.

The random model has google/gemma-3-4b-it's published config (below: hidden 2560, 34 layers, window
1024, linear rope scaling 8 on global layers; Gemma3TextConfig's defaults for the rest: 8 heads, 4 KV
heads, head_dim 256, every 6th layer global) scaled down: hidden 256, intermediate 4 x hidden, 7
layers (five sliding, one global, one sliding), window 16; head_dim, the GQA ratio, the rope scaling
and the pattern are kept. Its vision tower is a one-layer SigLIP of width 32.
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
from tests.model.test_gemma3 import HEAD_DIM, WINDOW, ids

# google/gemma-3-4b-it config.json as published (transformers 4.50's form)
PUBLISHED_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                      "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}  # fmt: skip
TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": 28, "patch_size": 14, "vision_use_head": False}  # fmt: skip
# transformers 4.52-4.57 saved the language model under model.language_model (and the rest under model.)
NEWER_LAYOUT = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                ("multi_modal_projector.", "model.multi_modal_projector."))  # fmt: skip


def make_tiny_gemma3_4b(directory: Path, seed: int = 0, layout: str = "published") -> Path:
    """A random Gemma3ForConditionalGeneration saved by transformers, with the tests' BPE tokenizer;
    `layout="newer"` renames its tensors to transformers 4.52's `model.language_model.` form."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(directory)
    text = {**PUBLISHED_4B["text_config"], "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 7,
            "sliding_window": WINDOW, "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 32768,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip
    config = transformers.Gemma3Config(text_config=text, vision_config=TINY_VISION, mm_tokens_per_image=4,
                                       image_token_index=tok.get_vocab_size() - 1, boi_token_index=1, eoi_token_index=2)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    perturb_norms(model)
    model.save_pretrained(directory)
    if layout == "newer":
        from safetensors.torch import load_file, save_file

        weights = load_file(directory / "model.safetensors")
        renamed = {}
        for name, t in weights.items():
            for old, new in NEWER_LAYOUT:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            renamed[name] = t
        save_file(renamed, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def reference(path: Path) -> transformers.PreTrainedModel:
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def test_published_4b_config_reads_as_transformers_text_config() -> None:
    """The published 4B config names few keys; what it leaves out takes Gemma3TextConfig's defaults,
    as transformers fills them."""
    arch = ArchSpec.from_hf_config(PUBLISHED_4B)
    text = transformers.Gemma3Config(**PUBLISHED_4B).text_config
    assert arch.family.name == "gemma3" and arch.hf_architecture == "Gemma3ForCausalLM"
    assert arch.extra["multimodal"] == "Gemma3ForConditionalGeneration"
    assert (arch.hidden_size, arch.num_layers, arch.intermediate_size) == (2560, 34, 10240)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (8, 4, 256)
    assert (arch.vocab_size, arch.max_position_embeddings) == (text.vocab_size, text.max_position_embeddings)
    assert arch.rms_norm_eps == text.rms_norm_eps and arch.sliding_window == text.sliding_window == 1024
    assert arch.extra["layer_types"] == text.layer_types and arch.tie_word_embeddings
    assert arch.rope_theta == text.rope_parameters["full_attention"]["rope_theta"]
    assert arch.rope_scaling["factor"] == text.rope_parameters["full_attention"]["factor"] == 8.0
    assert arch.extra["rope_local_base_freq"] == text.rope_parameters["sliding_attention"]["rope_theta"]
    assert arch.extra["query_pre_attn_scalar"] == text.query_pre_attn_scalar


def test_a_multimodal_config_without_text_config_is_refused() -> None:
    with pytest.raises(InputError, match="text_config"):
        ArchSpec.from_hf_config({k: v for k, v in PUBLISHED_4B.items() if k != "text_config"})


@pytest.mark.parametrize("layout", ["published", "newer"])
def test_logits_match_transformers_text_logits(tmp_path, layout: str) -> None:
    """Float32 logits on 48 tokens (past the window, through a global layer with 4B's linear rope
    scaling) equal transformers' Gemma3ForConditionalGeneration on the same text; the vision tensors
    are set aside, not read."""
    path = make_tiny_gemma3_4b(tmp_path / "g", layout=layout)
    x = ids(48)
    with open_model(path) as src, torch.no_grad():
        assert src.arch.head_dim == HEAD_DIM and src.arch.rope_scaling["factor"] == 8.0
        assert "model.layers.6.self_attn.q_norm.weight" in src.tensors and "model.embed_tokens.weight" in src.tensors
        assert not any("vision" in n or "projector" in n for n in src.tensors)
        assert src.set_aside and all(("vision_tower." in n) or ("multi_modal_projector." in n) for n in src.set_aside)
        ours = Decoder.from_source(src)(x)
    ref = reference(path)
    with torch.no_grad():
        want = ref(input_ids=x).logits
    text_params = sum(p.numel() for n, p in ref.named_parameters() if "language_model" in n)
    with open_model(path) as src:
        assert src.parameter_count == text_params
    diff = (ours - want).abs().max().item()
    assert diff < 1e-4, diff


def test_inspect_names_what_is_not_read(tmp_path) -> None:
    from llmopt.api import inspect

    path = make_tiny_gemma3_4b(tmp_path / "g")
    info = inspect(str(path))
    ref = reference(path)
    vision = {n: p for n, p in ref.named_parameters() if "language_model" not in n and not n.startswith("lm_head")}
    assert info["architecture"]["hf_architecture"] == "Gemma3ForCausalLM"
    assert info["not_read"]["model"] == "Gemma3ForConditionalGeneration"
    assert info["not_read"]["parameters"] == sum(p.numel() for p in vision.values())


def test_converted_hf_directory_is_the_text_model(tmp_path) -> None:
    """convert --to hf writes the language model as a Gemma3ForCausalLM that transformers loads, with
    the multimodal model's text logits."""
    from llmopt.api import convert_to_hf

    path = make_tiny_gemma3_4b(tmp_path / "g")
    convert_to_hf(path, tmp_path / "text", dtype="float32")
    text = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    assert type(text).__name__ == "Gemma3ForCausalLM" and text.config.rope_parameters["full_attention"]["factor"] == 8.0
    x = ids(40)
    with torch.no_grad():
        diff = (text(x).logits - reference(path)(input_ids=x).logits).abs().max().item()
    assert diff < 1e-4, diff
