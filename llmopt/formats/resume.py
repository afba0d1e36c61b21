"""A calibrated run's progress on disk, so a killed run resumes from its last finished block.

The pipeline is deterministic given its inputs, so a resumed run needs only what the killed one held
between blocks: every finished block's result (codes, scales, reports, the float tensors a method
changed) and the next block's inputs (the calibration activations, float32, bit for bit). Both are
written after each block (safetensors, each file atomically) into `.NAME.resume/` beside the output,
under a key of everything that decides the bytes (the source files' sizes and times, the spec with
every module's grid, the calibration tokens, the device, llmopt's version). `--resume` replays the
finished blocks into a fresh writer and goes on from the next; without it, or under another key, the
run starts over. The folder appears with the first finished block and is removed once the output is
committed, or when the run stops on bad input (a rerun would stop there again); a kill, SIGTERM,
Ctrl-C, a full disk or an out-of-memory error leave it for `--resume`.

Disk: the results (about the output's size) plus one block's inputs (samples x seqlen x hidden x 4
bytes: 1 GiB at 8B width with 128 x 512 tokens), rewritten after each block.
"""

from __future__ import annotations

import hashlib
import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import llmopt
from llmopt.errors import LlmoptError
from llmopt.formats.atomic import atomic_output_file
from llmopt.model.source import ModelSource
from llmopt.quant.grids import grid_identity
from llmopt.quant.pipeline import BlockResult, LayerReport, Progress, QuantizeSpec, quantized_modules
from llmopt.quantized_tensor import QuantizedTensor

_TENSOR_FIELDS = ("codes", "scales", "zeros", "mins", "g_idx")  # with bits, group_size, grid, aux: every field


def run_key(source: ModelSource, spec: QuantizeSpec, tokens: torch.Tensor, device: torch.device) -> str:
    """A digest of everything that decides a calibrated run's bytes."""
    path = Path(source.path)
    files = sorted(p for p in ([path] if path.is_file() else path.iterdir()) if p.is_file())
    described = {
        "llmopt": llmopt.__version__,
        "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "method": repr(spec.method), "tune": repr(spec.tune),
        "grids": [grid_identity(spec.grid_for(m)) for m in quantized_modules(source, spec)],
        "dynamic": sorted(spec.dynamic.items()),
        "batch": spec.batch_size, "act_dtype": str(spec.act_dtype), "head": spec.quantize_head,
        "tokens": hashlib.sha256(tokens.cpu().contiguous().numpy().tobytes()).hexdigest(), "shape": list(tokens.shape),
        "device": device.type,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


class ResumeLog:
    """The progress folder of one output: replay what a killed run finished, record what this one does."""

    def __init__(self, target: Path, key: str, resume: bool):
        self.folder = target.parent / f".{target.name}.resume"
        self.key = key
        kept = resume and _read_key(self.folder) == key
        if not kept:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.next = _next_layer(self.folder) if kept else 0

    def start(self) -> Progress | None:
        """Where the pipeline goes on (None: from the first block)."""
        if self.next == 0:
            return None
        with safe_open(str(self.folder / "inputs.safetensors"), "pt") as f:
            return Progress(self.next, f.get_tensor("x"), f.get_tensor("x_fp") if "x_fp" in f.keys() else None)

    def finished(self) -> Iterator[BlockResult]:
        """The results of the blocks a killed run finished, in order, read one at a time."""
        for index in range(self.next):
            yield _load_block(self.folder / _block_file(index))

    def record(self, result: BlockResult, progress: Progress) -> None:
        """After a block: its result, then the next block's inputs (which say the block is done)."""
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True)
            (self.folder / "key.json").write_text(json.dumps({"key": self.key}))
        with atomic_output_file(self.folder / _block_file(progress.layer - 1)) as tmp:
            _save_block(result, tmp)
        inputs = {"x": progress.x}
        if progress.x_fp is not None:
            inputs["x_fp"] = progress.x_fp
        inputs = _unshared(inputs)
        with atomic_output_file(self.folder / "inputs.safetensors") as tmp:
            save_file(inputs, str(tmp), metadata={"next": str(progress.layer), "key": self.key})

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    @contextlib.contextmanager
    def kept_for_resume(self) -> Iterator[None]:
        """Around a run: the folder goes when the output is written or the input is at fault, and
        stays for every other way the run can stop."""
        try:
            yield
        except LlmoptError:
            self.remove()
            raise
        self.remove()


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and one storage each: safetensors refuses tensors that share memory (a tied
    field, an aux tensor that is a view of another), so a second view of a storage is copied."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _block_file(index: int) -> str:
    return f"block-{index:05d}.safetensors"


def _read_key(folder: Path) -> str | None:
    try:
        return json.loads((folder / "key.json").read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _next_layer(folder: Path) -> int:
    """The first block the folder has no result for (0 when its inputs are missing or unreadable)."""
    try:
        with safe_open(str(folder / "inputs.safetensors"), "pt") as f:
            meta = f.metadata() or {}
    except Exception:  # a missing or torn file: nothing to resume from
        return 0
    if meta.get("key") != _read_key(folder):
        return 0
    done = int(meta.get("next", 0))
    return done if all(_readable(folder / _block_file(i)) for i in range(done)) else 0


def _readable(path: Path) -> bool:
    """Whether a block file is there and whole (safetensors checks its header against the file's size)."""
    try:
        with safe_open(str(path), "pt"):
            return True
    except Exception:  # missing, truncated or not safetensors: that progress cannot be replayed
        return False


def _save_block(result: BlockResult, path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, object] = {"layer": result.layer, "seconds": result.seconds, "quantized": {},
                               "reports": [[r.name, list(r.shape), r.metrics, r.details] for r in result.reports]}  # fmt: skip
    for name, q in result.tensors.items():
        for f in _TENSOR_FIELDS:
            value = getattr(q, f)
            if value is not None:
                tensors[f"q/{name}/{f}"] = value
        for k, v in q.aux.items():
            tensors[f"q/{name}/aux/{k}"] = v
        meta["quantized"][name] = {"bits": q.bits, "group_size": q.group_size, "grid": q.grid}  # type: ignore[index]
    for name, t in result.updated.items():
        tensors[f"u/{name}"] = t
    save_file(_unshared(tensors), str(path), metadata={"block": json.dumps(meta)})


def _load_block(path: Path) -> BlockResult:
    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {})["block"])
        stored = {k: f.get_tensor(k) for k in f.keys()}
    result = BlockResult(meta["layer"], {}, seconds=meta["seconds"])
    result.reports = [LayerReport(n, tuple(shape), metrics, details) for n, shape, metrics, details in meta["reports"]]
    for name, scalars in meta["quantized"].items():
        parts = {f: stored.get(f"q/{name}/{f}") for f in _TENSOR_FIELDS}
        aux_prefix = f"q/{name}/aux/"
        aux = {k.removeprefix(aux_prefix): v for k, v in stored.items() if k.startswith(aux_prefix)}
        result.tensors[name] = QuantizedTensor(**parts, **scalars, aux=aux)
    result.updated = {k.removeprefix("u/"): v for k, v in stored.items() if k.startswith("u/")}
    return result
