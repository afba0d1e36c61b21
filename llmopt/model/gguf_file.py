"""A GGUF file: metadata, tensors of any type (dequantized on demand), and its tokenizer.

The header is parsed by `gguf_header` (fast, numpy-backed) and tensors are dequantized with the
`gguf` package's reference code; names are mapped to HF names and llama.cpp's Q/K row
permutation is undone, so callers see exactly what an HF directory would hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dataclasses import replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from llmopt.errors import InputError
from llmopt.model.arch import ArchSpec
from llmopt.model.dequantize import dequantize
from llmopt.model.families.base import unpermute_from_gguf
from llmopt.model.gguf_header import read_gguf
from llmopt.model.rope import GGUF_ONLY, rope_scaling_from_gguf
from llmopt.model.source import ModelSource, TensorInfo, torch_dtype
from llmopt.model.tokenizer import TokenizerInfo, tokenizer_from_gguf
from llmopt.model.validate import check_tensors

if TYPE_CHECKING:
    import torch

_FLOATS = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)


class GGUFSource(ModelSource):
    kind = "gguf"

    def __init__(self, path: Path):
        self.path = path
        header = read_gguf(path)
        self.metadata, raw_tensors, self._map = header.metadata, header.tensors, header.map
        self._by_stored = {t.name: t for t in raw_tensors}
        try:
            self.arch = ArchSpec.from_gguf_metadata(self.metadata, set(self._by_stored))
        except InputError as e:
            raise InputError(f"{path}: {e}") from None
        family = self.arch.family
        self.tensors = {}
        for t in raw_tensors:
            hf = family.gguf_to_hf_name(t.name)
            if hf is None:  # GGUF-only tensors (llama3's rope_freqs, longrope's factors) stay out of the HF view
                if t.name not in GGUF_ONLY:
                    raise InputError(f"{path}: unknown tensor {t.name!r} for architecture {family.gguf_arch}")
                continue
            shape = tuple(int(d) for d in reversed(t.shape))
            self.tensors[hf] = TensorInfo(hf, t.name, shape, t.tensor_type.name, int(t.n_bytes))
        scaling = rope_scaling_from_gguf(self.arch, self.metadata, {n: np.array(t.data, dtype=np.float32) for n, t in self._by_stored.items()
                                                                    if n in GGUF_ONLY and t.tensor_type in _FLOATS})  # fmt: skip
        if scaling is not None:
            self.arch = replace(self.arch, rope_scaling=scaling)
        check_tensors(self.arch, {n: t.shape for n, t in self.tensors.items()}, str(path))
        self.split_fused()
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and len(tokens) != self.arch.vocab_size:  # llama.cpp refuses it too
            raise InputError(f"{path}: {len(tokens)} tokens in tokenizer.ggml.tokens for a vocabulary of {self.arch.vocab_size}")
        self._tokenizer: TokenizerInfo | None = None
        self._tokenizer_read = False

    def load(self, name: str, dtype: torch.dtype | str | None = "float32") -> torch.Tensor:
        raw, data, shape = self.stored_tensor(name)
        return self._values(name, raw.tensor_type, data, shape, dtype)

    def load_rows(self, name: str, rows: slice, dtype: torch.dtype | str | None = "float32") -> torch.Tensor:
        raw, data, shape = self.stored_tensor(name)
        if len(shape) != 2 or self.arch.family.qk_heads(name, self.arch.num_heads, self.arch.num_kv_heads):
            return super().load_rows(name, rows, dtype)  # permuted rows: undone on the whole tensor
        data = np.asarray(data).reshape(shape[0], -1)[rows]  # values, or block bytes, per row
        if data.shape[0] == 0:  # (the dequantizers take no empty input)
            return super().load_rows(name, rows, dtype)
        return self._values(name, raw.tensor_type, data, (data.shape[0], shape[1]), dtype)

    def _values(self, name: str, qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, ...],
                dtype: torch.dtype | str | None) -> torch.Tensor:
        """`name`'s stored `data` (all of it, or some of its rows) as float values in HF layout."""
        import torch

        dtype = torch_dtype(dtype)
        if qtype == GGMLQuantizationType.F32:
            t = torch.from_numpy(np.array(data, dtype=np.float32))
        elif qtype == GGMLQuantizationType.F16:
            t = torch.from_numpy(np.array(data, dtype=np.float16))
        elif qtype == GGMLQuantizationType.BF16:
            t = torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
        else:
            try:
                t = torch.from_numpy(dequantize(data, qtype))
            except NotImplementedError:
                raise InputError(f"{self.path}: tensor {self.tensors[name].stored_name} is {qtype.name}, which llmopt cannot read") from None
        t = self.hf_rows(name, t.reshape(shape))
        shift = self.arch.family.gguf_shift(name)
        if shift:  # Gemma's norms: the file holds shift + w (exact in float32 for a bf16 checkpoint's w)
            t = t.float() - shift
        return t if dtype is None else t.to(dtype)

    def stored_tensor(self, name: str) -> tuple[Any, np.ndarray, tuple[int, ...]]:
        """The file's tensor that holds `name` (gguf's ReaderTensor), the part of its data that is `name`
        (the map itself, or a view of an expert's or a fused part's rows of values or block bytes: only
        those are read), and `name`'s HF-orientation shape."""
        stored, rows = self.stored_rows(name)
        if rows is None:
            info = self.tensors[name]
            raw = self._by_stored[info.stored_name]
            return raw, raw.data, info.shape
        raw = self._by_stored[self.fused_tensors[stored].stored_name]
        data = np.asarray(raw.data)  # an expert stack [experts, rows, ...]: rows counted over all experts
        return raw, data.reshape(-1, data.shape[-1])[rows], self.tensors[name].shape

    def hf_rows(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`name`'s rows (values, or block bytes per row) in HF order: llama.cpp's Q/K permutation undone."""
        heads = self.arch.family.qk_heads(name, self.arch.num_heads, self.arch.num_kv_heads)
        return t if heads is None else unpermute_from_gguf(t, heads)

    def tokenizer(self) -> TokenizerInfo | None:
        if not self._tokenizer_read:
            self._tokenizer = tokenizer_from_gguf(self.metadata)
            self._tokenizer_read = True
        return self._tokenizer

    def close(self) -> None:
        self._by_stored.clear()
        self._map = None  # drops the memory map

