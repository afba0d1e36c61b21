"""How far a quantized weight is from the original: MSE, max abs error, cosine similarity, SQNR (dB)."""

from __future__ import annotations

import math

import torch


def weight_error(original: torch.Tensor, quantized: torch.Tensor) -> dict[str, float]:
    """Error metrics of `quantized` against `original` (same shape), computed in float64."""
    w = original.to(torch.float64).flatten()
    q = quantized.to(torch.float64).flatten()
    diff = w - q
    signal = float(w.pow(2).sum())
    noise = float(diff.pow(2).sum())
    denom = float(w.norm() * q.norm())
    return {
        "mse": noise / max(w.numel(), 1),
        "max_abs": float(diff.abs().max()) if w.numel() else 0.0,
        "cosine": float(w @ q) / denom if denom > 0 else (1.0 if noise == 0 else 0.0),
        "sqnr_db": math.inf if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf),
    }
