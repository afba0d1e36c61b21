"""`ModelSource`: one lazy, read-only view over any model llmopt can read.

Tensors are addressed by their HF names and come back in HF orientation ([out, in] for linears),
dequantized on demand, one at a time: no source ever loads the whole model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmopt.errors import InputError
from llmopt.memory import release_mapped_files
from llmopt.model.tokenizer import TokenizerInfo

if TYPE_CHECKING:
    import torch

    from llmopt.model.arch import ArchSpec  # a type only: the decoder reads this module and arch.py, through the families, the decoder


def torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`load`'s dtype: a torch dtype, or its name. Sources take names as their default so that
    reading headers (inspect, recommend) needs no torch; torch comes in with the first tensor."""
    if isinstance(dtype, str):
        import torch

        return getattr(torch, dtype)
    return dtype


@dataclass(frozen=True)
class TensorInfo:
    name: str  # HF name
    stored_name: str  # the name inside the file (llama.cpp's for GGUF)
    shape: tuple[int, ...]  # HF orientation
    dtype: str  # storage type: "F16", "BF16", "F32", "Q4_1", "I32", ...
    nbytes: int  # bytes on disk

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def file_stamps(path: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of a model's file, or of each file directly in its folder."""
    try:
        files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in files}
    except OSError:  # gone: every stamp differs
        return {}


class ModelSource(ABC):
    """A model on disk: architecture, tensors, tokenizer and metadata, read lazily."""

    kind: str  # "hf" or "gguf"
    path: Path
    arch: ArchSpec
    tensors: dict[str, TensorInfo]  # HF name -> info, in file order
    metadata: dict[str, Any]
    quantization_config: dict[str, Any] | None = None
    # a family's fused linears (Phi-3's qkv_proj): each part -> (stored tensor, first row, end row),
    # and the stored tensors' own infos; `tensors` lists the parts, never the fused tensor
    fused_rows: dict[str, tuple[str, int, int]] = {}
    fused_tensors: dict[str, TensorInfo] = {}
    # a multimodal checkpoint's tensors outside its language model (vision tower, projector), by their
    # names in the file: listed for `inspect`, never read
    set_aside: dict[str, TensorInfo] = {}

    def split_fused(self) -> None:
        """List each of the family's fused tensors as the linears it holds (rows of the stored tensor),
        so everything above the readers sees the Llama block. Readers call it after `check_tensors`."""
        family = self.arch.family
        if not family.fused and family.experts is None:
            return
        tensors: dict[str, TensorInfo] = {}
        self.fused_rows, self.fused_tensors = {}, {}
        for name, info in self.tensors.items():
            parts = family.split(self.arch, name) if name.endswith((".weight", ".bias")) else None
            if parts is None:
                tensors[name] = info
                continue
            self.fused_tensors[name] = info
            total = info.shape[0] * (info.shape[1] if len(info.shape) == 3 else 1)  # an expert stack: rows of all experts
            row = info.shape[1:] if len(info.shape) < 3 else info.shape[2:]
            for part, lo, hi in parts:  # bytes pro rata, summing to the stored tensor's
                nbytes = info.nbytes * hi // total - info.nbytes * lo // total
                tensors[part] = TensorInfo(part, info.stored_name, (hi - lo, *row), info.dtype, nbytes)
                self.fused_rows[part] = (name, lo, hi)
        self.tensors = tensors

    def unsplit(self) -> dict[str, TensorInfo]:
        """The listing as the files have it (each fused tensor in place of its parts): `split_fused` undone."""
        out: dict[str, TensorInfo] = {}
        for name, info in self.tensors.items():
            stored = self.fused_rows[name][0] if name in self.fused_rows else name
            out.setdefault(stored, self.fused_tensors.get(stored, info))
        return out

    def stored_rows(self, name: str) -> tuple[str, slice | None]:
        """The stored tensor that holds `name`, and the rows of it that are `name` (None: all)."""
        entry = self.fused_rows.get(name)
        return (name, None) if entry is None else (entry[0], slice(entry[1], entry[2]))

    def load_stored(self, name: str, dtype: torch.dtype | str | None = "float32") -> torch.Tensor:
        """A tensor as this family's files store it: a fused linear is its parts stacked by rows, an
        expert stack (GGUF's) the experts' tensors along a new first axis."""
        family = self.arch.family
        parts = family.part_names(name, self.arch)
        if parts is None or name in self.tensors:
            return self.load(name, dtype)
        import torch

        return (torch.stack if family.is_stack(name) else torch.cat)([self.load(part, dtype) for part in parts])

    @abstractmethod
    def load(self, name: str, dtype: torch.dtype | str | None = "float32") -> torch.Tensor:
        """One tensor by HF name, dequantized and in HF layout; `dtype=None` keeps a float file's dtype."""

    def load_rows(self, name: str, rows: slice, dtype: torch.dtype | str | None = "float32") -> torch.Tensor:
        """Rows `rows` of `load(name, dtype)`, so a big tensor can be converted one slab at a time. This
        fallback loads the whole tensor; readers that can read only those rows override it."""
        return self.load(name, dtype)[rows].clone()

    @abstractmethod
    def tokenizer(self) -> TokenizerInfo | None:
        """The model's tokenizer, or None when the source carries none."""

    stamps: dict[str, tuple[int, int]] = {}  # each file's (size, mtime) when opened (open_model)

    def check_unchanged(self) -> None:
        """A one-line InputError when a file of the model changed since it was opened (replaced,
        truncated, rewritten): an output made of tensors read before and after would be neither.
        Writers ask before each tensor or block they read and before they commit (a stat per file)."""
        now = file_stamps(self.path)
        changed = next((name for name, stamp in self.stamps.items() if now.get(name) != stamp), None)
        if changed is not None:
            raise InputError(f"{self.path}: {changed} changed while it was being read (its size or modification "
                             "time); nothing was written - run again once it stays put")  # fmt: skip

    def release_pages(self) -> None:
        """Let go of the memory-mapped file pages read so far (they stay counted in RSS otherwise)."""
        release_mapped_files(self.path)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release file handles and memory maps."""

    def __enter__(self) -> ModelSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def parameter_count(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def file_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
