"""A recipe's typed shape: pydantic models built from the commands' option declarations.

Every key a recipe output takes is an option of the command that makes it (`convert --to gguf`,
`quantize`, `convert --to hf`), declared once in llmopt/options.py with its default, range and help;
this module builds the pydantic models from those declarations (`_fields`), under the API's keyword
or the recipe's own name for it (`type`, `tensor_type`, `calibration.data`). Values are checked here
for type and range; the rules about which options go together are each command's `prepare`, which
`recipe/plan.py`'s preflight calls. What only a recipe has (`format`, `path`, `gates`, an output's
`imatrix: true`, `eval`) is declared here.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from llmopt.formats.gguf.mixes import MIXES
from llmopt.names import CHECKPOINT_FORMATS
from llmopt.options import (O, CalibrationOptions, Declared, EvalOptions, GgufOptions, HfOptions, ImatrixOptions,
                            Options, QuantizeOptions, ResumeOptions)

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


def _recipe_type(d: Declared) -> Any:
    """A declared option's type as a recipe (YAML) gives it: choices as a Literal, paths as text."""
    args = typing.get_args(d.type) if isinstance(d.type, types.UnionType) else (d.type,)
    optional = type(None) in args
    base: Any = d.type
    if d.spec.choices is not None:
        base = Literal[d.spec.choices]  # type: ignore[valid-type]
    elif typing.get_origin(args[0]) is tuple:
        base = list[str]
    return base | None if optional and d.spec.choices is not None else base


def _fields(group: type[Options], skip: Collection[str] = (), **defaults: Any) -> dict[str, Any]:
    """The pydantic fields of a recipe section from the options' one declaration (api keyword ->
    recipe key, type, default, range, help); `defaults` are where a recipe's default says
    "follow another setting" (None) instead of the command's."""
    fields = {}
    for d in group.declared():
        if d.name in skip:
            continue
        s = d.spec
        default = defaults.get(d.name, list(d.default) if isinstance(d.default, tuple) else d.default)
        annotation = _recipe_type(d) if d.name not in defaults else _recipe_type(d) | None
        fields[s.recipe or d.name] = (annotation, Field(default, ge=s.ge, gt=s.gt, le=s.le, lt=s.lt, description=s.help))
    return fields


def as_options(model: BaseModel, group: type[O], skip: Collection[str] = (), **given: Any) -> O:
    """A recipe section back as the API's options (recipe keys -> keywords)."""
    values = {d.name: getattr(model, d.spec.recipe or d.name) for d in group.declared()
              if d.name not in skip and (d.spec.recipe or d.name) in type(model).model_fields}  # fmt: skip
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return group.of(**{**values, **given})


CALIBRATION = {d.name for d in CalibrationOptions.declared()}  # a recipe's `calibration:` section, shared by its outputs
RUN = {d.name for d in ResumeOptions.declared()}  # not the recipe's to set: a run always resumes a killed one's blocks


class _Output(_Strict):
    path: str | None = None  # file or folder name inside the output's folder (default: <name>.<ext>)
    gates: Gates = Gates()


class _Gguf(_Output):
    """`llmopt convert MODEL --to gguf`: a llama.cpp type or mix, llama.cpp's or a calibrated rounding."""

    format: Literal["gguf"]
    imatrix: bool | str = False  # true: the recipe's shared importance matrix; a string: that file

    @field_validator("type", check_fields=False)
    @classmethod
    def _mix(cls, v: str | None) -> str | None:
        if v is not None and v.upper() not in MIXES:
            raise ValueError(f"unknown GGUF type {v!r}; choose one of {', '.join(MIXES)}")
        return None if v is None else v.upper()

    @property
    def calibrated(self) -> bool:
        """Does it read the calibration samples (a method, or the automatic mix's sensitivities)?"""
        return self.method is not None or self.target_size is not None or self.target_bpw is not None  # type: ignore[attr-defined]

    def options(self, calibration: dict[str, Any], imatrix: Path | None = None) -> GgufOptions:
        """The API's options: this output's, the recipe's `calibration` (the API's keywords; used when
        the output reads samples) and `imatrix` (the file it reads, if any)."""
        calib = calibration if self.calibrated else {}
        return as_options(self, GgufOptions, skip={"imatrix"} | CALIBRATION | RUN, imatrix=imatrix, resume=True, **calib)


class _Checkpoint(_Output):
    """`llmopt quantize`: a GPTQ, AWQ or compressed-tensors checkpoint (or dense float16) made layer by layer."""

    format: Literal[CHECKPOINT_FORMATS]  # type: ignore[valid-type]

    def method_name(self) -> str:
        """The method: as given, else the format's own (QuantizeOptions.method_name's rule)."""
        return self._options().method_name

    def _options(self) -> QuantizeOptions:
        return as_options(self, QuantizeOptions, skip={"fmt"} | CALIBRATION | RUN, fmt=self.format)

    @property
    def calibrated(self) -> bool:
        """Whether it reads the recipe's calibration (QuantizeOptions.calibrated's rule)."""
        return self._options().calibrated

    def options(self, calibration: dict[str, Any]) -> QuantizeOptions:
        """The API's options: this output's and the recipe's `calibration` (the API's keywords; used
        when the method reads samples)."""
        calib = calibration if self.calibrated else {}
        return as_options(self, QuantizeOptions, skip={"fmt"} | CALIBRATION | RUN, fmt=self.format, resume=True, **calib)


class _Hf(_Output):
    """`llmopt convert MODEL --to hf`: a dense safetensors directory."""

    format: Literal["hf"]

    @property
    def calibrated(self) -> bool:
        return False

    def options(self) -> HfOptions:
        return as_options(self, HfOptions)


class _Calibration(_Strict):
    """The samples every calibrated output and the shared importance matrix read (default: self-written)."""


class _Imatrix(_Strict):
    """The shared importance matrix (llama-imatrix's settings); unset, they follow `calibration`."""


GgufOutput = create_model("GgufOutput", __base__=_Gguf, **_fields(GgufOptions, skip={"imatrix"} | CALIBRATION | RUN))
CheckpointOutput = create_model("CheckpointOutput", __base__=_Checkpoint, **_fields(QuantizeOptions, skip={"fmt"} | CALIBRATION | RUN))
HfOutput = create_model("HfOutput", __base__=_Hf, **_fields(HfOptions))
Calibration = create_model("Calibration", __base__=_Calibration, **_fields(CalibrationOptions))
Imatrix = create_model("Imatrix", __base__=_Imatrix, **_fields(ImatrixOptions, skip={"calib_field", "output_format"},
                                                               chunks=None, ctx_size=None))  # fmt: skip

Output = Union[GgufOutput, CheckpointOutput, HfOutput]  # type: ignore[valid-type]
OUTPUT_KINDS: dict[str, type[BaseModel]] = {"gguf": GgufOutput, **dict.fromkeys(CHECKPOINT_FORMATS, CheckpointOutput),
                                            "hf": HfOutput}  # fmt: skip
# The library's keyword names that a recipe spells otherwise, for its error messages (the rest are the same words).
RECIPE_KEYS = {**{d.name: d.spec.recipe for g in (QuantizeOptions, GgufOptions, HfOptions) for d in g.declared()
                  if d.spec.recipe and d.name not in CALIBRATION},
               **{d.name: f"calibration.{d.spec.recipe or d.name}" for d in CalibrationOptions.declared()},
               "ctx_size": "imatrix.ctx_size", "chunks": "imatrix.chunks", "force": "--force"}  # fmt: skip


class _Eval(_Strict):
    """The text the gates score on: `windows` windows of `ctx` tokens; `stream` as `llmopt eval --stream`."""

    data: str


Eval = create_model("Eval", __base__=_Eval, **{k: v for k, v in _fields(EvalOptions).items() if k in ("windows", "ctx", "stream")})


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
