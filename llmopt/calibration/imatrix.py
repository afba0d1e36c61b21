"""Importance matrices as llama.cpp defines them: per linear input channel, the mean of x² over tokens.

`compute_imatrix` runs the model a block at a time over consecutive chunks of calibration tokens
(as llama-imatrix does) and sums x² of the input of every linear in every block. The result is
written in llama.cpp's GGUF imatrix format (`<tensor>.in_sum2` and `<tensor>.counts`, with
`imatrix.datasets`, `imatrix.chunk_count`, `imatrix.chunk_size`), and both that format and the
legacy `.dat` format are read back; `importance()` gives what the quantizer weighs with,
in_sum2 / counts per tensor.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from llmopt.calibration.capture import capture_inputs, embed
from llmopt.errors import InputError
from llmopt.formats.atomic import atomic_output_file
from llmopt.model.decoder import Rotary, load_block
from llmopt.model.source import ModelSource

# The linears of a block whose inputs are collected, by their HF suffix.
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


@dataclass
class Imatrix:
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # GGUF tensor name -> Σx² per input channel
    counts: dict[str, int] = field(default_factory=dict)  # tokens seen per tensor
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    path: Path | None = None  # the file it was read from

    def importance(self) -> dict[str, torch.Tensor]:
        """Per tensor, mean x² per input channel (float32): the quantizer's importance weights."""
        return {name: (s / max(self.counts[name], 1)).to(torch.float32) for name, s in self.sums.items()}


# ---------------------------------------------------------------------------------------- compute
def chunk_tokens(stream: torch.Tensor, chunk_size: int, max_chunks: int | None, bos_id: int | None) -> torch.Tensor:
    """Consecutive chunks of `chunk_size` tokens [n, chunk_size]; with a BOS id, each chunk starts
    with it in place of its first token (llama-imatrix's recipe)."""
    n = stream.numel() // chunk_size
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n < 1:
        raise InputError(f"the calibration text has {stream.numel()} tokens; one chunk needs {chunk_size}")
    chunks = stream[: n * chunk_size].reshape(n, chunk_size).clone()
    if bos_id is not None:
        chunks[:, 0] = bos_id
    return chunks


def compute_imatrix(source: ModelSource, chunks: torch.Tensor, *, device: torch.device | str = "cpu",
                    dataset: str | None = None, on_layer: Callable[[int, int], None] | None = None) -> Imatrix:  # fmt: skip
    """Σx² and token counts of every block linear's input over `chunks` [n, t], one block in memory at a time."""
    arch = source.arch
    family = arch.family
    result = Imatrix(datasets=[dataset] if dataset else [], chunk_count=int(chunks.shape[0]),
                     chunk_size=int(chunks.shape[1]))  # fmt: skip
    hidden = embed(source, chunks, device=device)
    cos, sin = Rotary(arch).to(device)(0, chunks.shape[1], hidden.dtype)
    for layer in range(arch.num_layers):
        block = load_block(source, layer, device=device)
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}

        def sink_for(name: str) -> Callable[[torch.Tensor], None]:
            def sink(x: torch.Tensor) -> None:
                flat = x.reshape(-1, x.shape[-1]).to(torch.float64)
                sums[name] = sums.get(name, 0) + (flat * flat).sum(dim=0)
                counts[name] = counts.get(name, 0) + flat.shape[0]

            return sink

        hooks = []
        for suffix in LINEARS:
            name = family.hf_to_gguf_name(f"model.layers.{layer}.{suffix}.weight")
            hooks.append(capture_inputs(block.get_submodule(suffix), sink_for(name)))
        for h in hooks:
            h.__enter__()
        try:
            with torch.no_grad():
                hidden = torch.cat([block(hidden[i : i + 1], cos, sin) for i in range(hidden.shape[0])])
        finally:
            for h in hooks:
                h.__exit__(None, None, None)
        for name, s in sums.items():
            result.sums[name] = s.cpu()
            result.counts[name] = counts[name]
        del block
        if on_layer is not None:
            on_layer(layer + 1, arch.num_layers)
    return result


# ------------------------------------------------------------------------------------------ files
def write_imatrix(imatrix: Imatrix, path: Path, *, legacy_dat: bool = False) -> Path:
    """Write llama.cpp's GGUF imatrix format (or its legacy .dat format), atomically."""
    with atomic_output_file(Path(path)) as tmp:
        if legacy_dat:
            _write_dat(imatrix, tmp)
        else:
            _write_gguf(imatrix, tmp)
    return Path(path).expanduser().resolve()


def _write_gguf(imatrix: Imatrix, path: Path) -> None:
    w = gguf.GGUFWriter(str(path), arch=None)  # an imatrix file has no general.architecture
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", imatrix.datasets or ["unnamed"])  # llama.cpp requires the key
    w.add_uint32("imatrix.chunk_count", imatrix.chunk_count)
    w.add_uint32("imatrix.chunk_size", imatrix.chunk_size)
    for name in sorted(imatrix.sums):
        w.add_tensor(f"{name}.in_sum2", imatrix.sums[name].to(torch.float32).numpy().reshape(1, -1))
        w.add_tensor(f"{name}.counts", np.array([[imatrix.counts[name]]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_dat(imatrix: Imatrix, path: Path) -> None:
    """Legacy format: per entry the mean x² times the number of chunks (llama-imatrix's `ncall`)."""
    size = max(imatrix.chunk_size, 1)
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(imatrix.sums)))
        for name in sorted(imatrix.sums):
            ncall = (imatrix.counts[name] + size - 1) // size
            values = (imatrix.sums[name] / max(imatrix.counts[name], 1) * ncall).to(torch.float32).numpy()
            raw = name.encode()
            f.write(struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, values.size))
            f.write(values.astype("<f4").tobytes())
        f.write(struct.pack("<i", imatrix.chunk_count))
        dataset = (imatrix.datasets[-1] if imatrix.datasets else "").encode()
        f.write(struct.pack("<i", len(dataset)) + dataset)


def read_imatrix(path: Path) -> Imatrix:
    """An imatrix file in llama.cpp's GGUF format or its legacy .dat format."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"--imatrix {path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    result = _read_gguf(path) if magic == b"GGUF" else _read_dat(path)
    result.path = path
    return result


def _read_gguf(path: Path) -> Imatrix:
    reader = gguf.GGUFReader(str(path))
    fields = reader.fields

    def scalar(key: str, default: int = 0) -> int:
        return int(fields[key].contents()) if key in fields else default

    datasets = list(fields["imatrix.datasets"].contents()) if "imatrix.datasets" in fields else []
    result = Imatrix(datasets=datasets, chunk_count=scalar("imatrix.chunk_count"), chunk_size=scalar("imatrix.chunk_size"))
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    for name, sums in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name.removesuffix(".in_sum2")
        counts = tensors.get(f"{base}.counts")
        if counts is None:
            raise InputError(f"{path}: {base} has in_sum2 but no counts")
        if counts.size != 1:
            raise InputError(f"{path}: {base} has {counts.size} experts; llmopt supports dense models")
        result.sums[base] = torch.from_numpy(sums.reshape(-1).astype(np.float64))
        result.counts[base] = int(counts.reshape(-1)[0])
    if not result.sums:
        raise InputError(f"{path}: not an imatrix file (no <tensor>.in_sum2 entries)")
    return result


def _read_dat(path: Path) -> Imatrix:
    data = path.read_bytes()
    try:
        (n,) = struct.unpack_from("<i", data, 0)
        pos, result = 4, Imatrix()
        for _ in range(n):
            (length,) = struct.unpack_from("<i", data, pos)
            name = data[pos + 4 : pos + 4 + length].decode()
            pos += 4 + length
            ncall, nval = struct.unpack_from("<ii", data, pos)
            pos += 8
            values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos)
            pos += 4 * nval
            # stored: mean x² · ncall; keep it as a sum over `ncall` pseudo-tokens so importance() = mean
            result.sums[name] = torch.from_numpy(values.astype(np.float64))
            result.counts[name] = max(ncall, 1)
        if pos + 4 <= len(data):
            (result.chunk_count,) = struct.unpack_from("<i", data, pos)
            pos += 4
            if pos + 4 <= len(data):
                (length,) = struct.unpack_from("<i", data, pos)
                if length > 0:
                    result.datasets = [data[pos + 4 : pos + 4 + length].decode()]
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not an imatrix file ({e})") from None
    if n < 1 or not result.sums:
        raise InputError(f"{path}: not an imatrix file (no entries)")
    return result
