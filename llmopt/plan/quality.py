"""Expected quality of each storage format, as classes users can compare at a glance.

For GGUF mixes the ranking and the figures are llama.cpp's own: the perplexity increase over the
16-bit model that `llama-quantize --help` prints for Llama-3-8B (tools/quantize/quantize.cpp,
QUANT_OPTIONS). GPTQ and AWQ have no such figure there; calibrated 8-bit is near-lossless and
calibrated 4-bit with group 128 lands in the same class as Q4_K_M in their papers' Llama results,
so they are placed next to it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Quality:
    rank: int  # position in QUALITY_ORDER (0 = best)
    label: str  # class shown to users
    ppl_delta: float | None  # llama.cpp's +perplexity on Llama-3-8B, when it publishes one


# class labels, best first; a format's class is decided by its perplexity increase
CLASSES = ("lossless", "near-lossless", "very good", "good", "fair", "poor")
GOOD = CLASSES.index("good")

_PPL = {  # llama-quantize --help, "+x ppl @ Llama-3-8B"
    "Q8_0": 0.0026, "Q6_K": 0.0217, "Q5_K_M": 0.0569, "Q5_1": 0.1062, "Q5_K_S": 0.1049, "Q5_0": 0.1316,
    "Q4_K_M": 0.1754, "Q4_K_S": 0.2689, "Q4_1": 0.4511, "Q4_0": 0.4685, "Q3_K_L": 0.5562, "Q3_K_M": 0.6569,
    "Q3_K_S": 1.6321, "Q2_K": 3.5199,
}  # fmt: skip

# best first
QUALITY_ORDER = ("F16", "BF16", "Q8_0", "GPTQ-8", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M",
                 "AWQ-4", "GPTQ-4", "Q4_K_S", "Q4_1", "Q4_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K")


def _class_of(ppl: float) -> str:
    if ppl <= 0.01:
        return "near-lossless"
    if ppl <= 0.06:
        return "very good"
    if ppl <= 0.3:
        return "good"
    if ppl <= 1.0:
        return "fair"
    return "poor"


def quality_key(format_name: str) -> str:
    """"GPTQ-4bit-g128" -> "GPTQ-4"; GGUF mixes are their own key."""
    if format_name.startswith(("GPTQ-", "AWQ-")):
        kind, rest = format_name.split("-", 1)
        return f"{kind}-{rest.split('bit')[0]}"
    return format_name


def quality(format_name: str) -> Quality:
    key = quality_key(format_name)
    rank = QUALITY_ORDER.index(key) if key in QUALITY_ORDER else len(QUALITY_ORDER)
    if key in ("F16", "BF16"):
        return Quality(rank, "lossless", 0.0)
    if key in _PPL:
        return Quality(rank, _class_of(_PPL[key]), _PPL[key])
    if key.endswith("-8"):
        return Quality(rank, "near-lossless", None)
    return Quality(rank, "good", None)


def class_index(label: str) -> int:
    return CLASSES.index(label)
