"""The model families llmopt supports, one short module each, and lookups over them."""

from llmopt.errors import InputError
from llmopt.model.families.base import Family
from llmopt.model.families.gemma3 import GEMMA3
from llmopt.model.families.llama import LLAMA
from llmopt.model.families.mistral import MISTRAL
from llmopt.model.families.mixtral import MIXTRAL
from llmopt.model.families.phi3 import PHI3
from llmopt.model.families.qwen2 import QWEN2
from llmopt.model.families.qwen2moe import QWEN2MOE
from llmopt.model.families.qwen3 import QWEN3

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA3, MIXTRAL, QWEN2MOE)


def supported_architectures() -> str:
    return ", ".join(a for f in FAMILIES for a in (*f.hf_architectures, *f.hf_multimodal))


def family_for_hf(architectures: list[str] | None, model_type: str | None) -> Family:
    """The family of an HF config, from `architectures` (preferred) or `model_type`; a multimodal
    class gives the family of its language model."""
    for arch in architectures or []:
        for family in FAMILIES:
            if arch in family.hf_architectures or arch in family.hf_multimodal:
                return family
    if not architectures:
        for family in FAMILIES:
            if model_type == family.hf_model_type:
                return family
    named = ", ".join(architectures or []) or repr(model_type)
    raise InputError(f"unsupported architecture {named}; supported: {supported_architectures()}")


def family_for_gguf(gguf_arch: str, experts: bool = False) -> Family:
    """The family of a GGUF file's `general.architecture` (Mistral files say "llama"; Mixtral's too,
    with an `expert_count`)."""
    for family in FAMILIES:
        if family.gguf_arch == gguf_arch and family.reads_gguf and (family.experts is not None) == experts:
            return family
    gguf_names = sorted({f.gguf_arch for f in FAMILIES})
    raise InputError(f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(gguf_names)}")


__all__ = ["FAMILIES", "GEMMA3", "LLAMA", "MISTRAL", "MIXTRAL", "PHI3", "QWEN2", "QWEN2MOE", "QWEN3", "Family", "family_for_gguf", "family_for_hf", "supported_architectures"]
