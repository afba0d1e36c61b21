"""`--device auto|cpu|cuda` -> a torch device, with a clear error when CUDA is asked for but absent."""

from __future__ import annotations

import torch

from llmopt.errors import InputError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str = "auto") -> torch.device:
    if name not in DEVICES and not name.startswith("cuda:"):
        raise InputError(f"bad --device {name!r}; choose one of {', '.join(DEVICES)}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available to torch on this machine")
    return torch.device(name)
