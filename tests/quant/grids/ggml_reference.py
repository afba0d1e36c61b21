"""llama.cpp's own quantizer (ggml_quantize_chunk in the libggml-base that llama-cpp-python ships).

This is the function `llama_model_quantize` calls for every tensor, so it is the reference our grids
must reproduce byte for byte.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import gguf
import numpy as np


@cache
def _lib() -> ctypes.CDLL:
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    return lib


def ggml_quantize(type_name: str, weight: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's bytes for a float32 [rows, cols] weight: uint8 [rows, row_bytes]."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    src = np.ascontiguousarray(weight, dtype=np.float32)
    rows, cols = src.shape
    dst = np.zeros((rows, cols // block * nbytes), dtype=np.uint8)
    imat = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    size = _lib().ggml_quantize_chunk(int(qtype), src.ctypes.data, dst.ctypes.data, 0, rows, cols,
                                      None if imat is None else imat.ctypes.data)
    assert size == dst.nbytes
    return dst
