"""Predicted GGUF file sizes against the files llama.cpp's own quantizer writes (SmolLM2-135M)."""

from collections import Counter

import pytest

from llmopt.plan.gguf_file import gguf_file_bytes, tensor_directory
from llmopt.plan.models import from_preset, resolve_model
from llmopt.plan.presets import get_preset
from llmopt.plan.weights import gguf_format, gguf_tensor_types, weight_size
from tests.formats.gguf.llama_cpp_helpers import llama_quantize

TYPES = ("F16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K")


@pytest.mark.slow
def test_predicted_file_sizes_match_llama_quantize(smollm2_f16_gguf, tmp_path):
    from_file = resolve_model(str(smollm2_f16_gguf))  # metadata measured from the file
    from_preset_only = from_preset(get_preset("smollm2-135m"))  # no file: metadata estimated
    report = {}
    for mix in TYPES:
        actual_path = llama_quantize(smollm2_f16_gguf, tmp_path / f"{mix}.gguf", mix, nthread=2)
        actual = actual_path.stat().st_size
        size = weight_size(from_file.arch, from_file.tensors, gguf_format(mix))
        written = tensor_directory(actual_path)
        types = gguf_tensor_types(from_file.arch, from_file.tensors, mix)
        assert types == {name: t for name, (t, _) in written.items()}, mix  # every tensor's type
        assert size.type_counts == Counter((types[t.gguf_name], t.shape) for t in from_file.tensors), mix
        predicted = gguf_file_bytes(from_file.tensors, size.type_counts, from_file.metadata_bytes, from_file.alignment)
        preset = weight_size(from_preset_only.arch, from_preset_only.tensors, gguf_format(mix))
        predicted_preset = gguf_file_bytes(from_preset_only.tensors, preset.type_counts, from_preset_only.metadata_bytes)
        report[mix] = (predicted, predicted_preset, actual)
        actual_path.unlink()
    for mix, (predicted, predicted_preset, actual) in report.items():
        print(f"{mix:7} predicted {predicted:>11,} (preset {predicted_preset:>11,}) llama.cpp {actual:>11,} "
              f"error {100 * (predicted - actual) / actual:+.4f}% (preset {100 * (predicted_preset - actual) / actual:+.4f}%)")
        assert abs(predicted - actual) / actual < 0.01, mix
        assert abs(predicted_preset - actual) / actual < 0.01, mix
