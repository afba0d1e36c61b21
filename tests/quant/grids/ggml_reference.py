"""llama.cpp's own quantizer (ggml_quantize_chunk in the libggml-base that llama-cpp-python ships) and
its own dequantizer (the type traits' to_float).

ggml_quantize_chunk is the function `llama_model_quantize` calls for every tensor, so it is the
reference our grids must reproduce byte for byte. Type ids and block geometry come from ggml itself
(ggml_type_name / ggml_blck_size / ggml_type_size), so types the `gguf` package does not know yet
(Q2_0) are reachable too.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import numpy as np

GGML_TYPE_COUNT = 43  # ggml.h of llama-cpp-python 0.3.36's llama.cpp (ggml reads past its table for larger ids)
_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _TypeTraits(ctypes.Structure):  # ggml.h `struct ggml_type_traits`
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]  # fmt: skip


@cache
def _lib() -> ctypes.CDLL:
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib


@cache
def ggml_type_id(type_name: str) -> int:
    """The ggml_type enum value of a type name ("IQ1_S"), as ggml names it."""
    for i in range(GGML_TYPE_COUNT):
        traits = _lib().ggml_get_type_traits(i).contents
        if traits.type_name and traits.type_name.decode().upper() == type_name and traits.blck_size > 0:
            return i
    raise KeyError(type_name)


def ggml_geometry(type_name: str) -> tuple[int, int]:
    """(elements, bytes) per block, from ggml's type traits."""
    traits = _lib().ggml_get_type_traits(ggml_type_id(type_name)).contents
    return int(traits.blck_size), int(traits.type_size)


def ggml_quantize(type_name: str, weight: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's bytes for a float32 [rows, cols] weight: uint8 [rows, row_bytes]."""
    block, nbytes = ggml_geometry(type_name)
    src = np.ascontiguousarray(weight, dtype=np.float32)
    rows, cols = src.shape
    dst = np.zeros((rows, cols // block * nbytes), dtype=np.uint8)
    imat = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    size = _lib().ggml_quantize_chunk(ggml_type_id(type_name), src.ctypes.data, dst.ctypes.data, 0, rows, cols,
                                      None if imat is None else imat.ctypes.data)
    assert size == dst.nbytes
    return dst


def ggml_dequantize(type_name: str, data: np.ndarray) -> np.ndarray:
    """llama.cpp's own float32 values of a type's bytes [rows, row_bytes] (its to_float), [rows, cols]."""
    block, nbytes = ggml_geometry(type_name)
    src = np.ascontiguousarray(data, dtype=np.uint8)
    rows = src.shape[0]
    out = np.zeros((rows, src.shape[1] // nbytes * block), dtype=np.float32)
    to_float = _TO_FLOAT(_lib().ggml_get_type_traits(ggml_type_id(type_name)).contents.to_float)
    to_float(src.ctypes.data, out.ctypes.data, out.size)
    return out
