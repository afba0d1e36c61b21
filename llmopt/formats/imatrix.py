"""Importance-matrix files as llama.cpp reads and writes them.

The GGUF imatrix format (`<tensor>.in_sum2` and `<tensor>.counts`, with `imatrix.datasets`,
`imatrix.chunk_count`, `imatrix.chunk_size`) is what `llmopt imatrix` writes; it and the legacy
`.dat` format (per entry the mean x² times the number of chunks) are both read. The statistics
themselves (`Imatrix`) are computed in `llmopt.calibration.imatrix`.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import torch

from llmopt.calibration.imatrix import Imatrix
from llmopt.errors import InputError, OptionError
from llmopt.formats.atomic import atomic_output_file
from llmopt.model.gguf_header import read_gguf


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
    for name in sorted(imatrix.sums):  # one row per expert of a stack (llama-imatrix: [n_expert, ncols])
        sums = imatrix.sums[name].to(torch.float32)
        w.add_tensor(f"{name}.in_sum2", sums.reshape(-1, sums.shape[-1]).numpy())
        w.add_tensor(f"{name}.counts", np.asarray(imatrix.counts[name], dtype=np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_dat(imatrix: Imatrix, path: Path) -> None:
    """Legacy format: per entry the mean x² times the number of chunks (llama-imatrix's `ncall`)."""
    size = max(imatrix.chunk_size, 1)
    if any(isinstance(c, torch.Tensor) for c in imatrix.counts.values()):
        raise OptionError("<legacy_dat> the legacy .dat format keeps one count per entry; a mixture-of-experts "
                          "imatrix (a count per expert) is written in the GGUF format")
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
        raise OptionError(f"<imatrix> {path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    result = _read_gguf(path) if magic == b"GGUF" else _read_dat(path)
    result.path = path
    return result


def _read_gguf(path: Path) -> Imatrix:
    """Through llmopt's own GGUF header reader, which checks the container before anything is read."""
    header = read_gguf(path)
    meta = header.metadata

    def scalar(key: str) -> int:
        value = meta.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{path}: {key} is {value!r:.30}; expected a count")
        return value

    datasets = meta.get("imatrix.datasets", [])
    if not isinstance(datasets, list) or not all(isinstance(d, str) for d in datasets):
        raise InputError(f"{path}: imatrix.datasets is not a list of strings")
    result = Imatrix(datasets=datasets, chunk_count=scalar("imatrix.chunk_count"), chunk_size=scalar("imatrix.chunk_size"))
    tensors = {t.name: t for t in header.tensors}
    for name, t in tensors.items():
        if not name.endswith(".in_sum2"):
            continue
        base = name.removesuffix(".in_sum2")
        counts = tensors.get(f"{base}.counts")
        if counts is None:
            raise InputError(f"{path}: {base} has in_sum2 but no counts")
        if t.tensor_type.name != "F32" or counts.tensor_type.name != "F32":
            raise InputError(f"{path}: {base}: imatrix entries are F32, not {t.tensor_type.name}/{counts.tensor_type.name}")
        experts = counts.data.size  # more than one: an expert stack, a row of sums and a count per expert
        if np.asarray(t.data).size % experts:
            raise InputError(f"{path}: {base} has {np.asarray(t.data).size} sums for {experts} experts")
        with np.errstate(invalid="ignore", over="ignore"):  # judged just below
            sums = np.asarray(t.data, dtype=np.float64).reshape(experts, -1) if experts > 1 else np.asarray(t.data, dtype=np.float64).reshape(-1)
            count = np.asarray(counts.data, dtype=np.float64).reshape(-1)
        if not np.isfinite(sums).all() or (sums < 0).any() or not (np.isfinite(count).all() and (count >= 0).all()):
            raise InputError(f"{path}: {base}: sums of squares must be finite and non-negative")
        result.sums[base] = torch.from_numpy(sums.copy())
        result.counts[base] = torch.from_numpy(count.astype(np.int64)) if experts > 1 else int(count[0])
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
            if not 0 < length <= len(data) - pos - 4:
                raise ValueError(f"an entry name of {length} bytes")
            name = data[pos + 4 : pos + 4 + length].decode()
            pos += 4 + length
            ncall, nval = struct.unpack_from("<ii", data, pos)
            pos += 8
            if not 0 < nval <= (len(data) - pos) // 4:
                raise ValueError(f"{name}: {nval} values")
            values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos)
            if not np.isfinite(values).all():
                raise ValueError(f"{name}: values that are not finite")
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
        raise InputError(f"{path}: not an imatrix file ({str(e).splitlines()[0][:80]})") from None
    if n < 1 or not result.sums:
        raise InputError(f"{path}: not an imatrix file (no entries)")
    return result
