"""Fixtures for the planner's tests: SmolLM2 as an F16 GGUF, the input llama.cpp's quantizer expects."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def write_f16_copy(src: Path, dst: Path) -> Path:
    """`src` with every tensor dequantized (2-D to F16, 1-D to F32) and every key kept with its type,
    as llama.cpp's converter would have written the same model in F16."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
            continue
        sub_type = fld.types[1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, fld.contents(), fld.types[0], sub_type=sub_type)
    for t in reader.tensors:
        value = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        w.add_tensor(t.name, value.astype(np.float32 if value.ndim == 1 else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="session")
def smollm2_f16_gguf(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_f16_copy(smollm2_gguf, tmp_path_factory.mktemp("smollm2-f16") / "smollm2-135m-f16.gguf")
