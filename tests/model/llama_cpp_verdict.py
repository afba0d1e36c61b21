"""llama.cpp's verdict on GGUF files: `python -m tests.model.llama_cpp_verdict FILE...` prints one line
per file, "ok" or "refused".

A file is accepted when ggml's `gguf_init_from_file` reads it (as llama.cpp's model loader calls it:
no data read, tensors made in a context) and every tensor's data lies within the file, the check
llama.cpp's model loader adds ("tensor data is not within the file bounds"). Run in its own
process: a GGML_ASSERT in the library aborts the process, which the caller reads as a crash, not a
verdict.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path


class _InitParams(ctypes.Structure):  # gguf.h `struct gguf_init_params`
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


def _lib() -> ctypes.CDLL:
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _InitParams]
    for name, restype in [("gguf_get_n_tensors", ctypes.c_int64), ("gguf_get_data_offset", ctypes.c_size_t)]:
        getattr(lib, name).restype = restype
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    for name in ["gguf_get_tensor_offset", "gguf_get_tensor_size"]:
        getattr(lib, name).restype = ctypes.c_size_t
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    lib.ggml_free.argtypes = [ctypes.c_void_p]
    return lib


def verdict(lib: ctypes.CDLL, path: str) -> str:
    tensors = ctypes.c_void_p()
    ctx = lib.gguf_init_from_file(path.encode(), _InitParams(True, ctypes.pointer(tensors)))
    if not ctx:
        return "refused"
    try:
        size, base = os.path.getsize(path), lib.gguf_get_data_offset(ctx)
        for i in range(lib.gguf_get_n_tensors(ctx)):
            if base + lib.gguf_get_tensor_offset(ctx, i) + lib.gguf_get_tensor_size(ctx, i) > size:
                return "refused"
        return "ok"
    finally:
        lib.gguf_free(ctx)
        if tensors:
            lib.ggml_free(tensors)


if __name__ == "__main__":
    lib = _lib()
    for arg in sys.argv[1:]:
        print(verdict(lib, arg), flush=True)
