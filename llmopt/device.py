"""`--device auto|cpu|cuda` -> a torch device, with a clear error when CUDA is asked for but absent."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmopt.errors import OptionError
from llmopt.names import CALIB_DTYPES, DEVICES

if TYPE_CHECKING:
    import torch


def resolve_device(name: str = "auto") -> torch.device:
    import torch  # here: the CLI imports this module before it knows whether a command needs torch

    if name not in DEVICES and not name.startswith("cuda:"):
        raise OptionError(f"bad <device> {name!r}; choose one of {', '.join(DEVICES)}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise OptionError("<device> cuda: no CUDA device is available to torch on this machine")
    return torch.device(name)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 natively (CUDA since Ampere; x86 CPUs with AVX512-BF16 or AMX).
    Elsewhere torch emulates it, slower than float32."""
    import torch

    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_calib_dtype(name: str, device: torch.device) -> torch.dtype:
    """`--calib-dtype`: the calibration forward's dtype; auto = bfloat16 where it is native, else float32."""
    import torch

    if name not in CALIB_DTYPES:
        raise OptionError(f"bad <calib_dtype> {name!r}; choose one of {', '.join(CALIB_DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return getattr(torch, name)
