"""The bandwidth a decode roofline divides by: given (GB/s or a catalog GPU), or measured here.

Measured: the best of several full reads (a sum) of a buffer far larger than the caches, with the
threads the engine uses, on the engine's device. That is what this process can stream, the honest
ceiling for a memory-bound decode step on a shared CPU; a datasheet number can be given instead.
"""

from __future__ import annotations

import time

from llmopt.errors import OptionError

BUFFER_BYTES = {"cpu": 512 << 20, "cuda": 2 << 30}
READS = 5


def resolve_bandwidth(value: str | float | None, device: str, threads: int = 0) -> tuple[float, str]:
    """(GB/s, where the number came from)."""
    if value is None:
        return measure_read_bandwidth(device, threads)
    try:
        gbs = float(value)
    except (TypeError, ValueError):
        from llmopt.errors import InputError
        from llmopt.plan.gpus import get_gpu

        try:
            gpu = get_gpu(str(value))
        except InputError as e:
            raise OptionError(f"<bandwidth> {value!r}: expected GB/s or a GPU name ({e})") from None
        return gpu.bandwidth_gbs, f"{gpu.name} datasheet"
    if not 0 < gbs < 1e6:
        raise OptionError(f"<bandwidth> {value}: expected GB/s, a positive number")
    return gbs, "given"


def measure_read_bandwidth(device: str, threads: int = 0) -> tuple[float, str]:
    """(GB/s, description) of the fastest of READS full reads of a large buffer on `device`."""
    import torch

    kind = "cuda" if device.startswith("cuda") else "cpu"
    nbytes = BUFFER_BYTES[kind]
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    used = torch.get_num_threads()
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        best = float("inf")
        for _ in range(READS):
            if kind == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            buf.sum().item()  # .item() waits for the device
            best = min(best, time.perf_counter() - t)
        del buf
    finally:
        torch.set_num_threads(before)
    where = f"{used} thread(s)" if kind == "cpu" else device
    return nbytes / best / 1e9, f"measured: read of {nbytes >> 20} MiB, {where}"
