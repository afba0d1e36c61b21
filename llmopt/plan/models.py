"""What `recommend` plans for: an architecture with its full tensor list and GGUF metadata size.

A model can come from a built-in preset, a parameter count ("13B": the nearest preset's shape with
its layer count scaled to match), a GGUF file (tensors and metadata measured from the file), an HF
directory, or a hub id (only config.json is fetched: planning never needs the weights).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from llmopt.errors import InputError, OptionError
from llmopt.model.arch import ArchSpec
from llmopt.plan.arch_tensors import ROPE, PlannedTensor, PlannedTensors, active_parameter_count, arch_tensors, num_experts, parameter_count
from llmopt.plan.gguf_file import DEFAULT_ALIGNMENT, estimated_metadata_bytes, measured_metadata_bytes, tensor_directory
from llmopt.plan.presets import PRESETS, Preset, find_preset, preset_names


@dataclass
class PlanModel:
    name: str
    arch: ArchSpec
    tensors: PlannedTensors
    origin: str  # where the architecture came from, for the report
    metadata_bytes: int  # GGUF key/value bytes
    metadata_exact: bool
    alignment: int = DEFAULT_ALIGNMENT

    @property
    def parameters(self) -> int:
        return parameter_count(self.tensors)

    @property
    def active_parameters(self) -> int:
        return active_parameter_count(self.arch, self.tensors) if num_experts(self.arch) else self.parameters


def from_arch(name: str, arch: ArchSpec, origin: str) -> PlanModel:
    return PlanModel(name, arch, arch_tensors(arch), origin, estimated_metadata_bytes(arch.vocab_size), False)


def from_preset(preset: Preset) -> PlanModel:
    return from_arch(preset.name, preset.arch, f"preset (config.json of {preset.source})")


def all_presets() -> list[PlanModel]:
    return [from_preset(p) for p in PRESETS.values()]


_PARAMS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_params(text: str) -> int:
    """"13B", "1.7b", "135M", "7000000000" -> a parameter count."""
    m = _PARAMS.match(text)
    if not m or float(m.group(1)) <= 0:
        raise OptionError(f"bad <params> {text!r}; give a count such as 135M, 7B or 1.5T")
    return int(float(m.group(1)) * _SCALE[m.group(2).lower()])


def from_params(target: int) -> PlanModel:
    """A dense model of about `target` parameters: the nearest dense preset, layers rescaled."""
    dense = [m for m in all_presets() if not num_experts(m.arch)]
    base = min(dense, key=lambda m: abs(math.log(m.parameters / target)))
    per_layer = (base.parameters - _non_block_params(base)) / base.arch.num_layers
    layers = max(1, round((target - _non_block_params(base)) / per_layer))
    arch = replace(base.arch, num_layers=layers)
    label = f"~{_short_count(target)}"
    return from_arch(label, arch, f"{base.name}'s shape with {layers} layers (from --params)")


def _non_block_params(m: PlanModel) -> int:
    return sum(t.numel for t in m.tensors if t.hf_name and not t.hf_name.startswith("model.layers."))


def _short_count(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return str(n)


def resolve_model(spec: str) -> PlanModel:
    """A preset name, a GGUF file, an HF directory (or its config.json), or a hub id."""
    preset = find_preset(spec)
    if preset is not None:
        return from_preset(preset)
    path = Path(spec).expanduser()
    if path.is_file() and path.name != "config.json":
        return _from_gguf(path)
    if path.is_dir() or path.name == "config.json":
        config = path / "config.json" if path.is_dir() else path
        if not config.is_file():
            raise InputError(f"{path}: not an HF model directory (no config.json)")
        return from_arch(path.name if path.is_dir() else path.parent.name, _read_config(config), str(path))
    from llmopt.model.hub import looks_like_hub_id

    if looks_like_hub_id(spec):
        return from_arch(spec, _read_config(_hub_config(spec)), f"config.json of {spec}")
    raise InputError(f"unknown model {spec!r}: not a preset, a file, a directory or a hub id; presets: {preset_names()}")


def _read_config(path: Path) -> ArchSpec:
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    arch = ArchSpec.from_hf_config(cfg)
    if cfg.get("num_local_experts"):  # Mixtral-style MoE configs
        arch = replace(arch, extra={**arch.extra, "num_experts": int(cfg["num_local_experts"]),
                                    "experts_per_token": int(cfg.get("num_experts_per_tok", 2))})
    return arch


def _hub_config(repo_id: str) -> Path:
    """config.json of a hub repository: from the cache, else downloaded alone."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, "config.json", local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except RepositoryNotFoundError:
        raise InputError(f"{repo_id}: no such local path, and no such model on the hub") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{repo_id}: not a preset or local path, and its config.json cannot be fetched ({first})") from None


def _from_gguf(path: Path) -> PlanModel:
    """A GGUF file: its architecture, its exact tensor list and its measured metadata."""
    from llmopt.model import open_model

    with open_model(path) as source:
        arch = source.arch
    directory = tensor_directory(path)
    tensors = PlannedTensors(t for t in arch_tensors(arch) if t.gguf_name in directory)
    known = {t.gguf_name for t in tensors}
    tensors += [PlannedTensor(None, name, shape, ROPE) for name, (_, shape) in directory.items() if name not in known]
    metadata, alignment = measured_metadata_bytes(path)
    return PlanModel(path.stem, arch, tensors, str(path), metadata, True, alignment)
