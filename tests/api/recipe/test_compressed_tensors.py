"""A recipe output `format: compressed-tensors` (its schema is generated from the quantize options)."""

from __future__ import annotations

import json


def test_recipe_output_in_compressed_tensors(llmopt_here, tiny_models, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_models('llama')}\noutputs:\n"
                      "  w8: {format: compressed-tensors, method: rtn, bits: 8, group_size: -1}\n")  # fmt: skip
    result = llmopt_here("run", recipe, "--json")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out" / "w8"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert qc["quant_method"] == "compressed-tensors" and group["weights"]["strategy"] == "channel"
    card = (out / "README.md").read_text()
    assert "- compressed-tensors\nlibrary_name: transformers\n" in card and "8-bit compressed-tensors" in card


def test_recipe_output_fp8_dynamic(llmopt_here, tiny_models, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_models('llama')}\noutputs:\n  fp8: {{format: compressed-tensors, scheme: fp8-dynamic}}\n")
    result = llmopt_here("run", recipe, "--json")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out" / "fp8"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "float-quantized"
    assert "# model fp8-dynamic compressed-tensors" in (out / "README.md").read_text()


def test_recipe_output_fp8_static_reads_the_recipes_calibration(llmopt_here, tiny_models, tmp_path):
    """`scheme: fp8` measures activation ranges, so it takes the recipe's calibration (QuantizeOptions.calibrated)."""
    from tests.factories import CORPUS

    (tmp_path / "calib.txt").write_text("\n".join(CORPUS))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_models('llama')}\ncalibration: {{data: {tmp_path / 'calib.txt'}, nsamples: 4, "
                      f"seqlen: 32}}\noutputs:\n  fp8: {{format: compressed-tensors, scheme: fp8}}\n")  # fmt: skip
    result = llmopt_here("run", recipe, "--json")
    assert result.returncode == 0, result.stderr
    qc = json.loads((tmp_path / "out" / "fp8" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "tensor"
