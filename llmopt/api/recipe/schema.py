"""A recipe's typed shape: pydantic models whose fields are the API's keyword arguments.

Every key a recipe output takes is an option of the command that makes it (`convert --to gguf`,
`quantize`, `convert --to hf`) under the same name as the Python API's keyword (`group_size`,
`tensor_type`, ...). Values are checked here for type and range; the rules about which options go
together stay where they are (quant/spec.py, formats/...) and run in `recipe/plan.py`'s preflight.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmopt.calibration.text import SELF
from llmopt.formats.gguf.mixes import MIXES
from llmopt.names import FLOAT_DTYPES, METHODS

OUTPUT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a folder name on every system


class _Strict(BaseModel):
    """No unknown keys, no silent coercion of strings into numbers."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _percent(value: Any) -> Any:
    """'5%' -> 5.0; numbers pass through (pydantic then checks the type)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            return float(value.strip()[:-1])
        except ValueError:
            raise ValueError(f"expected a percentage like '5%', got {value!r}") from None
    return value


class Gates(_Strict):
    """Pass/fail limits against the source model, on the recipe's `eval` text.

    `max_ppl_increase`: perplexity may rise at most this many percent ('5%' or 5).
    `max_kld`: mean KL(source || output) in nats per token at most this.
    `min_top1`: top-1 agreement with the source at least this fraction (0.97 or '97%')."""

    max_ppl_increase: float | None = Field(None, ge=0, le=1000)
    max_kld: float | None = Field(None, ge=0, le=100)
    min_top1: float | None = Field(None, ge=0, le=1)

    @field_validator("max_ppl_increase", mode="before")
    @classmethod
    def _ppl(cls, v: Any) -> Any:
        return _percent(v)

    @field_validator("min_top1", mode="before")
    @classmethod
    def _top1(cls, v: Any) -> Any:
        pct = _percent(v)
        return pct / 100 if isinstance(v, str) and isinstance(pct, float) else pct

    def any(self) -> bool:
        return any(v is not None for v in (self.max_ppl_increase, self.max_kld, self.min_top1))


class _Output(_Strict):
    path: str | None = None  # file or folder name inside the output's folder (default: <name>.<ext>)
    gates: Gates = Gates()


class _Calibrated(_Output):
    """Options of the calibrated methods (`quantize` and `convert --method` share them)."""

    damp: float = Field(0.01, ge=0, lt=1)
    act_order: bool = False
    static_groups: bool = False
    group_aware: bool | None = None
    gptaq: float = Field(0.0, ge=0, le=1)
    clip: bool = True
    batch_size: int = Field(8, ge=1, le=4096)
    target_bpw: float | None = Field(None, gt=0, le=32)
    sensitivity_samples: int = Field(32, ge=1, le=100_000)


class GgufOutput(_Calibrated):
    """`llmopt convert MODEL --to gguf`: a llama.cpp type or mix, llama.cpp's or a calibrated rounding."""

    format: Literal["gguf"]
    type: str = "Q4_K_M"
    imatrix: bool | str = False  # true: the recipe's shared importance matrix; a string: that file
    method: Literal["gptq", "awq", "awq+gptq"] | None = None
    tensor_type: list[str] | dict[str, str] = []  # REGEX=TYPE as llama-quantize, or {REGEX: TYPE}
    output_tensor_type: str | None = None
    target_size: str | int | None = None

    @field_validator("type")
    @classmethod
    def _mix(cls, v: str) -> str:
        if v.upper() not in MIXES:
            raise ValueError(f"unknown GGUF type {v!r}; choose one of {', '.join(MIXES)}")
        return v.upper()

    def tensor_types(self) -> list[str]:
        if isinstance(self.tensor_type, dict):
            return [f"{k}={v}" for k, v in self.tensor_type.items()]
        return list(self.tensor_type)

    @property
    def calibrated(self) -> bool:
        """Does it read the calibration samples (a method, or the automatic mix's sensitivities)?"""
        return self.method is not None or self.target_size is not None or self.target_bpw is not None


class CheckpointOutput(_Calibrated):
    """`llmopt quantize`: a GPTQ or AWQ checkpoint (or dense float16) made layer by layer."""

    format: Literal["gptq", "awq", "dense"]
    method: Literal[METHODS] | None = None  # type: ignore[valid-type]  # default: the format's own
    bits: int = Field(4, ge=2, le=8)
    group_size: int = Field(128, ge=-1, le=1 << 20)
    sym: bool | None = None
    mse: bool = False
    refit_scales: bool = False
    quantize_head: bool = False
    max_shard_size: str = "5GB"

    def method_name(self) -> str:
        return self.method or ("awq" if self.format == "awq" else "gptq")

    @property
    def calibrated(self) -> bool:
        return self.method_name() != "rtn"


class HfOutput(_Output):
    """`llmopt convert MODEL --to hf`: a dense safetensors directory."""

    format: Literal["hf"]
    dtype: Literal[FLOAT_DTYPES] = "float16"  # type: ignore[valid-type]
    max_shard_size: str = "5GB"

    @property
    def calibrated(self) -> bool:
        return False


Output = Union[GgufOutput, CheckpointOutput, HfOutput]
OUTPUT_KINDS: dict[str, type[BaseModel]] = {"gguf": GgufOutput, "gptq": CheckpointOutput, "awq": CheckpointOutput,
                                            "dense": CheckpointOutput, "hf": HfOutput}  # fmt: skip


class Calibration(_Strict):
    """The samples every calibrated output and the shared importance matrix read."""

    data: str = SELF  # a .txt/.jsonl/.parquet file, a preset, or "self" (text the model writes)
    field: str | None = None
    nsamples: int = Field(128, ge=1, le=1_000_000)
    seqlen: int = Field(512, ge=16, le=1 << 20)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class Imatrix(_Strict):
    """The shared importance matrix (llama-imatrix's settings); defaults follow `calibration`."""

    chunks: int | None = Field(None, ge=1, le=1_000_000)
    ctx_size: int | None = Field(None, ge=16, le=1 << 20)


class Eval(_Strict):
    """The text the gates score on: `windows` windows of `ctx` tokens."""

    data: str
    windows: int = Field(40, ge=0, le=1_000_000)
    ctx: int = Field(512, ge=16, le=1 << 20)


class Recipe(_Strict):
    model: str
    name: str | None = None  # the model's name in files, cards and the manifest (default: the source's)
    output_dir: str = "out"
    calibration: Calibration = Calibration()
    imatrix: Imatrix = Imatrix()
    eval: Eval | None = None
    working_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    outputs: dict[str, Any]  # each validated on its own by its `format` (OUTPUT_KINDS)

    @field_validator("outputs")
    @classmethod
    def _names(cls, v: dict[str, Any]) -> dict[str, Any]:
        if not v:
            raise ValueError("a recipe needs at least one output")
        return v
