"""The language model inside a multimodal checkpoint (Gemma 3 4B and larger:
Gemma3ForConditionalGeneration), read as the text-only model of its family.

Such a checkpoint's config.json nests the language model's config as `text_config` (beside a
`vision_config`), and its files hold the language model's tensors under a prefix next to a vision
tower and a projector. transformers has used two layouts: `language_model.model.layers...` (the
published files, and what transformers 4.50 and 5.x save) and `model.language_model.layers...`
(transformers 4.52 to 4.57). llama.cpp's converter does the same for a text GGUF: it drops
"language_model." from the names and skips the vision tensors (convert_hf_to_gguf.py, Gemma3Model;
it writes those to a separate mmproj file on request, which llmopt does not). Everything above the
readers then sees an ordinary text model of the family: quantizing, converting and generating
handle the language model alone, and what llmopt writes is the text model (Gemma3ForCausalLM).
"""

from __future__ import annotations

from typing import Any

from llmopt.errors import InputError
from llmopt.model.families.base import Family

# stored prefix -> the text model's own, longest first (transformers' "llava" renamings, reversed)
TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)


def text_config(cfg: dict[str, Any], family: Family) -> tuple[dict[str, Any], str] | None:
    """(the language model's config.json as a text model of `family` would have it, the multimodal
    class) for a config of one of the family's multimodal classes; None for any other config."""
    archs = cfg.get("architectures") or []
    wrapper = next((a for a in archs if a in family.hf_multimodal), None)
    if wrapper is None:
        return None
    nested = cfg.get("text_config")
    if not isinstance(nested, dict):
        raise InputError(f"config.json: {wrapper} needs `text_config` (an object with the language model's config)")
    text = {**nested, "architectures": [family.hf_architectures[0]], "model_type": family.hf_model_type}
    if "tie_word_embeddings" not in nested and "tie_word_embeddings" in cfg:  # the wrapper's own says
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text, wrapper


def text_tensor_name(stored: str) -> str | None:
    """The text model's name of a multimodal checkpoint's tensor, or None for the vision tower's and
    the projector's (and anything else outside the language model)."""
    for prefix, own in TEXT_PREFIXES:
        if stored.startswith(prefix):
            return own + stored[len(prefix):]
    return None
