"""From a loaded recipe to a run plan: where every output goes, which shared steps it needs, its
fingerprint, and (for `--dry-run`) its predicted size. The library's own option checks run here,
before any work, so a bad combination is a recipe error with file:line:column.

The shared steps, each computed once and kept in the cache folder under a content fingerprint:
- `working copy`: a GGUF source dequantized once to an HF folder of `working_dtype`, which every
  output then reads (so `--only` jobs read the same float weights as a full run);
- `imatrix`: llama.cpp's importance matrix over `calibration.data`, for every output with
  `imatrix: true`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llmopt
import torch

from llmopt.api.convert import plan_gguf_file, prepare_gguf
from llmopt.api.quantize import prepare
from llmopt.calibration.text import PRESETS, SELF
from llmopt.errors import InputError, OptionError
from llmopt.formats.hf import parse_size
from llmopt.model import ModelSource, open_model
from llmopt.model.arch import ArchSpec
from llmopt.model.hub import looks_like_hub_id, resolve_hub_id
from llmopt.plan.arch_tensors import arch_tensors
from llmopt.plan.weights import awq_format, gptq_format, packed_weight_size
from llmopt.options import CalibrationOptions
from llmopt.quant.spec import check_shapes
from llmopt.api.recipe.fingerprint import HashCache, canonical_sha256
from llmopt.api.recipe.load import LoadedRecipe, RecipeError
from llmopt.api.recipe.schema import CheckpointOutput, GgufOutput, HfOutput, Output, as_options

STATE = ".llmopt-run"  # per-output records of finished work, inside the output folder
_QUANT_SUFFIX = re.compile(r"[.-](f16|bf16|f32|q\d[\w]*|iq\d[\w]*)$", re.IGNORECASE)


@dataclass
class OutputPlan:
    name: str
    spec: Output
    folder: Path  # out/<name>/: the output, its model card (and, for checkpoints, the output itself)
    target: Path  # the file (GGUF) or folder (checkpoint, HF) the build writes
    uses_imatrix: bool
    fingerprint: str = ""
    predicted_bytes: int | None = None


@dataclass
class RunPlan:
    recipe: LoadedRecipe
    out_dir: Path
    cache_dir: Path
    model_name: str
    source: Path  # the model as given, resolved to a local file or folder
    hub_id: str | None  # the model as given, when it named a hub repository
    source_sha256: str
    source_bytes: int
    calib_sha256: str  # of calibration.data's bytes (a preset: its name; self: "self")
    working_copy: Path | None  # the float folder outputs read, when the source is a GGUF file
    imatrix: Path | None  # the shared importance matrix, when an output asks for it
    outputs: list[OutputPlan]
    hashes: HashCache

    @property
    def model_path(self) -> Path:
        """What every output reads: the working copy when there is one."""
        return self.working_copy or self.source

    @property
    def state_dir(self) -> Path:
        return self.out_dir / STATE

    def calibration(self) -> dict[str, Any]:
        """What the manifest records about the calibration."""
        c = self.recipe.recipe.calibration
        return {"data": c.data or SELF, "sha256": self.calib_sha256, "field": c.field, "nsamples": c.nsamples,
                "seqlen": c.seqlen, "seed": c.seed, "dtype": c.dtype}  # fmt: skip

    def calib_data(self) -> str:
        """calibration.data as the library takes it (a resolved path, a preset or "self")."""
        data = self.recipe.recipe.calibration.data or SELF
        return data if data in (SELF, *PRESETS) and not self.recipe.resolve(data).is_file() else str(self.recipe.resolve(data))

    def calibration_options(self) -> dict[str, Any]:
        """The recipe's `calibration:` section as the API's keywords (`calib` resolved)."""
        return {**as_options(self.recipe.recipe.calibration, CalibrationOptions).values(), "calib": self.calib_data()}


def plan_run(recipe: LoadedRecipe, only: list[str] | None = None, out_dir: Path | None = None,
             cache_dir: Path | None = None) -> RunPlan:  # fmt: skip
    """Resolve paths, hash the source and calibration, check every selected output's options."""
    names = list(recipe.outputs)
    if only:
        unknown = [n for n in only if n not in recipe.outputs]
        if unknown:
            raise OptionError(f"<only> {', '.join(unknown)}: no such output in {recipe.path.name} (it has {', '.join(names)})")
        names = [n for n in names if n in only]
    out_dir = (out_dir or recipe.resolve(recipe.recipe.output_dir)).expanduser().resolve()
    cache_dir = (cache_dir or out_dir / ".cache").expanduser().resolve()
    hashes = HashCache(cache_dir / "hashes.json")
    source = _local_source(recipe)
    source_sha, source_bytes, _ = hashes.tree(source)
    r = recipe.recipe
    model_name = r.name or _QUANT_SUFFIX.sub("", source.name.removesuffix(".gguf"))
    calib = _calib_sha256(recipe, hashes)
    working = None
    if source.is_file():
        working = cache_dir / f"working-{canonical_sha256([source_sha, r.working_dtype, llmopt.__version__])[:16]}"
    model_key = [source_sha, r.working_dtype if working else None, llmopt.__version__]
    calib_key = [calib, r.calibration.model_dump()]
    outputs = [_output_plan(recipe, name, out_dir, model_name) for name in names]
    imatrix = None
    if any(o.uses_imatrix for o in outputs):
        chunks, ctx = r.imatrix.chunks or r.calibration.nsamples, r.imatrix.ctx_size or r.calibration.seqlen
        imatrix = cache_dir / f"imatrix-{canonical_sha256([model_key, calib_key, chunks, ctx])[:16]}.gguf"
    hub_id = None if recipe.resolve(r.model).exists() else r.model
    plan = RunPlan(recipe, out_dir, cache_dir, model_name, source, hub_id, source_sha, source_bytes, calib, working,
                   imatrix, outputs, hashes)  # fmt: skip
    with open_model(source) as opened:
        for o in outputs:
            o.predicted_bytes = _preflight(plan, o, opened)
            o.fingerprint = canonical_sha256({
                "llmopt": llmopt.__version__, "model": model_key, "name": model_name, "output": o.name,
                "recipe": recipe.path.name, "spec": o.spec.model_dump(exclude={"gates"}),
                "calibration": calib_key if o.spec.calibrated else None,
                "imatrix": imatrix.name if o.uses_imatrix and imatrix else None,
                "imatrix_file": _imatrix_file_sha(plan, o)})  # fmt: skip
    return plan


def _local_source(recipe: LoadedRecipe) -> Path:
    model = recipe.recipe.model
    path = recipe.resolve(model)
    if path.exists():
        return path.resolve()
    if looks_like_hub_id(model):
        return resolve_hub_id(model)
    raise recipe.error(["model"], f"`model` {model}: no such file or directory")


def _calib_sha256(recipe: LoadedRecipe, hashes: HashCache) -> str:
    data = recipe.recipe.calibration.data or SELF
    path = recipe.resolve(data)
    if path.is_file():
        return hashes.sha256(path)
    return data  # a preset (its dataset revision is datasets' business) or "self" (the model's own text)


def _output_plan(recipe: LoadedRecipe, name: str, out_dir: Path, model_name: str) -> OutputPlan:
    spec = recipe.outputs[name]
    folder = out_dir / name
    if isinstance(spec, GgufOutput):
        automatic = spec.target_size is not None or spec.target_bpw is not None
        default = f"{model_name}-{name if automatic else spec.type}.gguf"
        target = folder / (spec.path or default)
        return OutputPlan(name, spec, folder, target, spec.imatrix is True)
    return OutputPlan(name, spec, folder, folder / spec.path if spec.path else folder, False)


def _imatrix_file_sha(plan: RunPlan, o: OutputPlan) -> str | None:
    """An output that names its own imatrix file depends on that file's bytes."""
    if isinstance(o.spec, GgufOutput) and isinstance(o.spec.imatrix, str):
        return plan.hashes.sha256(plan.recipe.resolve(o.spec.imatrix))
    return None


def _preflight(plan: RunPlan, o: OutputPlan, source: ModelSource) -> int | None:
    """The commands' own checks of `o`'s options (`prepare`; errors located in the recipe); the predicted size."""
    s, arch, cpu = o.spec, source.arch, torch.device("cpu")
    try:
        if isinstance(s, GgufOutput):
            job = prepare_gguf(s.options(plan.calibration_options()), cpu)
            if job.target is not None:
                return job.target.size
            file_plan, _ = plan_gguf_file(plan.source, options=job.options)
            return file_plan.file_nbytes
        if isinstance(s, HfOutput):
            parse_size(s.max_shard_size)
            return _dense_bytes(arch, 4 if s.dtype == "float32" else 2)
        assert isinstance(s, CheckpointOutput)
        quant = prepare(s.options(plan.calibration_options()), cpu)
        check_shapes(source, quant.spec)
        if quant.fmt == "dense" or s.target_bpw is not None:
            return _dense_bytes(arch, 2) if quant.fmt == "dense" else None
        shape = gptq_format if quant.fmt == "gptq" else awq_format
        return packed_weight_size(arch_tensors(arch), shape(s.bits, s.group_size)).total_bytes
    except OptionError as e:
        raise plan.recipe.option_error(o.name, e) from None
    except RecipeError:
        raise
    except InputError as e:
        raise plan.recipe.error(["outputs", o.name], f"outputs.{o.name}: {e}") from None


def _dense_bytes(arch: ArchSpec, width: int) -> int:
    return sum(width * t.numel for t in arch_tensors(arch) if t.hf_name is not None)
