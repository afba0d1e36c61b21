"""NVFP4 compressed-tensors checkpoints written by llmopt (`--scheme nvfp4a16`, `nvfp4-pack-quantized`): the
layout is the package's, its NVFP4PackedCompressor decompresses them to llmopt's weights (it computes in float32
and casts to bfloat16, so to ours rounded to bfloat16), the rounding is the package's own, the linears vLLM fuses
share one global scale, and bad files are one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.utils.match import match_name
from safetensors.torch import load_file, save_file

from llmopt.formats.compressed_tensors import LAYOUT
from llmopt.model import open_model
from llmopt.model.packing import unpack_fp4_pairs
from llmopt.quant.grids.nvfp4 import NVFP4
from tests.factories import CORPUS


@pytest.fixture(scope="module")
def nvfp4_dir(tiny_models, tmp_path_factory):
    from llmopt.cli.app import main

    out = tmp_path_factory.mktemp("nvfp4") / "nvfp4"
    assert main(["quantize", str(tiny_models("llama")), "--scheme", "nvfp4a16", "-o", str(out), "--json"]) == 0
    return out


@pytest.fixture(scope="module")
def w4a4_dir(tiny_models, tmp_path_factory):
    """`--scheme nvfp4`: the same weights, and each linear's activation global scale from calibration."""
    from llmopt.cli.app import main

    root = tmp_path_factory.mktemp("nvfp4-w4a4")
    (root / "calib.txt").write_text("\n".join(CORPUS))
    out = root / "nvfp4"
    assert main(["quantize", str(tiny_models("llama")), "--scheme", "nvfp4", "--calib", str(root / "calib.txt"),
                 "--nsamples", "4", "--seqlen", "32", "-o", str(out), "--json"]) == 0  # fmt: skip
    return out


def test_nvfp4a16_is_the_packages_layout_and_decompresses_to_our_weights(nvfp4_dir, tiny_models):
    qc = json.loads((nvfp4_dir / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert (qc["format"], group["format"], group["input_activations"]) == ("nvfp4-pack-quantized",) * 2 + (None,)
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"]) == (4, "float", "tensor_group", 16)
    config = QuantizationConfig.model_validate(qc)
    state = load_file(nvfp4_dir / "model.safetensors")
    down = "model.layers.0.mlp.down_proj"  # [64, 128]
    assert (state[f"{down}.weight_packed"].dtype, tuple(state[f"{down}.weight_packed"].shape)) == (torch.uint8, (64, 64))
    assert (state[f"{down}.weight_scale"].dtype, tuple(state[f"{down}.weight_scale"].shape)) == (torch.float8_e4m3fn, (64, 8))
    assert (state[f"{down}.weight_global_scale"].dtype, tuple(state[f"{down}.weight_global_scale"].shape)) == (torch.float32, (1,))
    modules = sorted({k.rpartition(".")[0] for k in state if k.endswith(".weight_packed")})
    assert len(modules) == 14 and not any(k.endswith(".weight_shape") for k in state)
    with open_model(nvfp4_dir) as q, open_model(tiny_models("llama")) as src:
        assert q.tensors[f"{down}.weight"].dtype == "CT-NVFP4"
        for module in modules:
            (scheme,) = [g for g in config.config_groups.values() if any(match_name(module, t) for t in g.targets)]
            local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
            theirs = NVFP4PackedCompressor.decompress(local, scheme)["weight"]
            ours = q.load(f"{module}.weight")
            assert theirs.dtype == torch.bfloat16 and torch.equal(theirs, ours.to(torch.bfloat16)), module
            assert torch.equal(ours, NVFP4.quantize(src.load(f"{module}.weight")).dequantize()) or module.endswith(
                ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")), module  # fused ones share the stage's scale  # fmt: skip
    for layer in range(2):  # vLLM fuses q/k/v and gate/up and keeps one global scale for them
        for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            scales = {float(state[f"model.layers.{layer}.{m}.weight_global_scale"]) for m in fused}
            assert len(scales) == 1, (layer, fused)


def test_rounding_is_the_packages_compressor(tmp_path):
    """Given the same scales, the package's compressor picks the same E2M1 values (it writes the sign of a negative
    value that rounds to zero, llmopt +0), and ties go to the even mantissa as in its cast_to_fp4."""
    w = torch.randn(48, 160, generator=torch.Generator().manual_seed(3)) * 0.02
    w[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
    qt = NVFP4.quantize(w)
    assert float(qt.aux["group_scale"][0, 0] / qt.aux["global_scale"][0, 0]) == 1.0  # ties are exact ties
    ours = LAYOUT.tensors(qt)
    state = {"weight": w, "weight_scale": qt.aux["group_scale"], "weight_global_scale": qt.aux["global_scale"].reshape(1)}
    theirs = NVFP4PackedCompressor.compress(state, preset_name_to_scheme("NVFP4A16", ["Linear"]))
    assert torch.equal(unpack_fp4_pairs(theirs["weight_packed"]), unpack_fp4_pairs(ours["weight_packed"]))
    assert torch.equal(theirs["weight_scale"].view(torch.uint8), ours["weight_scale"].view(torch.uint8))
    assert (qt.dequantize()[0, :16] == torch.tensor([0, 1, 1, 2, 2, 4, 4, 6, 0, -1, -1, -2, -2, -4, -4, -6.0])).all()


def _missing_global_scale(state):
    del state["model.layers.1.mlp.up_proj.weight_global_scale"]


def _scale_shape_lies(state):
    state["model.layers.0.mlp.down_proj.weight_scale"] = state["model.layers.0.mlp.down_proj.weight_scale"][:, :4].contiguous()


@pytest.mark.parametrize("edit,expect", [
    (_missing_global_scale, "model.layers.1.mlp.up_proj.weight_global_scale is missing"),
    (_scale_shape_lies, "model.layers.0.mlp.down_proj.weight_scale has shape [64, 4]; weight_packed [64, 64] (NVFP4) "
                        "needs [64, 8]"),
])  # fmt: skip
def test_bad_nvfp4_file_is_one_line_exit_2(nvfp4_dir, tmp_path, llmopt_here, edit, expect):
    out = tmp_path / "bad"
    shutil.copytree(nvfp4_dir, out)
    state = load_file(out / "model.safetensors")
    edit(state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    result = llmopt_here("inspect", out)
    assert result.returncode == 2 and expect in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_transformers_loads_it_with_our_weights(nvfp4_dir):
    """transformers (its compressed-tensors quantizer, bfloat16 on the CPU: see tests/model) holds llmopt's weights
    rounded to bfloat16."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(nvfp4_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        ref(torch.tensor([[1, 2, 3]]))  # the first forward decompresses
    linears = {n: m for n, m in ref.named_modules() if n.startswith("model.layers.") and isinstance(m, torch.nn.Linear)}
    assert len(linears) == 14
    with open_model(nvfp4_dir) as q:
        for name, module in linears.items():
            assert torch.equal(module.weight, q.load(f"{name}.weight").to(torch.bfloat16)), name


def test_nvfp4_w4a4_has_the_presets_activations_and_calibrated_global_scales(w4a4_dir, nvfp4_dir):
    """NVFP4 (W4A4): input_activations as the package's NVFP4 preset states them, one `input_global_scale` per
    linear (448·6 / the largest |x| its input took), the same for the linears that read one input, which
    transformers loads as the module's own; the weights are nvfp4a16's."""
    import transformers

    qc = json.loads((w4a4_dir / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    preset = preset_name_to_scheme("NVFP4", ["Linear"]).input_activations
    config = QuantizationConfig.model_validate(qc)
    assert next(iter(config.config_groups.values())).input_activations == preset
    state, a16 = load_file(w4a4_dir / "model.safetensors"), load_file(nvfp4_dir / "model.safetensors")
    scales = {k.removesuffix(".input_global_scale"): v for k, v in state.items() if k.endswith(".input_global_scale")}
    assert len(scales) == 14 and all(v.shape == (1,) and v.dtype == torch.float32 and 0 < float(v) < 1e6 for v in scales.values())
    for layer in range(2):
        for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            assert len({float(scales[f"model.layers.{layer}.{m}"]) for m in fused}) == 1
    assert all(torch.equal(a16[k], v) for k, v in state.items() if k in a16)  # the weights do not depend on the data
    ref = transformers.AutoModelForCausalLM.from_pretrained(w4a4_dir, dtype=torch.bfloat16)
    for module, scale in scales.items():
        assert torch.equal(ref.get_submodule(module).input_global_scale.data.float(), scale), module
    with open_model(w4a4_dir) as q:
        assert q.tensors["model.layers.0.mlp.down_proj.weight"].dtype == "CT-NVFP4"


def test_static_input_scales_are_the_packages_observers():
    """FP8's `input_scale` and NVFP4's `input_global_scale` from an input range, as compressed-tensors' observers
    make them (calculate_qparams for FP8 per tensor, generate_gparam for NVFP4)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    from llmopt.formats.compressed_tensors import input_scale
    from llmopt.quant.grids import fp8

    for absmax in (0.37, 12.5, 1e-3):
        a = torch.tensor([[absmax]])
        fp8_args = preset_name_to_scheme("FP8", ["Linear"]).input_activations
        theirs, _ = calculate_qparams(-a.reshape(1), a.reshape(1), fp8_args)
        assert torch.equal(input_scale(fp8.NAME, a), theirs.to(torch.float32))
        assert torch.equal(input_scale(NVFP4.name, a), generate_gparam(-a.reshape(1), a.reshape(1)))


def test_mxfp4a16_is_the_packages_layout_and_decompresses_to_our_weights(tiny_models, tmp_path, llmopt_here):
    """`--scheme mxfp4a16`: llama.cpp's MXFP4 blocks (the GGUF grid) as `mxfp4-pack-quantized`, the block exponent as
    the E8M0 scale byte. The package's MXFP4PackedCompressor gives exactly llmopt's weights (powers of two times
    E2M1 values are exact in its bfloat16), and transformers holds them."""
    import transformers
    from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor

    from llmopt.quant.grids.fp4 import MXFP4

    out = tmp_path / "mxfp4"
    result = llmopt_here("quantize", tiny_models("llama"), "--scheme", "mxfp4a16", "-o", out)
    assert result.returncode == 0, result.stderr
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    preset = preset_name_to_scheme("MXFP4A16", ["Linear"]).weights
    fields = ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic", "scale_dtype")
    assert [getattr(scheme.weights, f) for f in fields] == [getattr(preset, f) for f in fields]
    assert config.format == "mxfp4-pack-quantized" and scheme.input_activations is None
    state = load_file(out / "model.safetensors")
    down = "model.layers.0.mlp.down_proj"  # [64, 128]
    assert (state[f"{down}.weight_scale"].dtype, tuple(state[f"{down}.weight_scale"].shape)) == (torch.uint8, (64, 4))
    modules = sorted({k.rpartition(".")[0] for k in state if k.endswith(".weight_packed")})
    assert len(modules) == 14
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    with torch.no_grad():
        ref(torch.tensor([[1, 2, 3]]))  # the first forward decompresses
    with open_model(out) as q, open_model(tiny_models("llama")) as src:
        assert q.tensors[f"{down}.weight"].dtype == "CT-MXFP4"
        for module in modules:
            local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
            ours = q.load(f"{module}.weight")
            assert torch.equal(MXFP4PackedCompressor.decompress(local, scheme)["weight"].float(), ours), module
            assert torch.equal(ours, MXFP4.quantize(src.load(f"{module}.weight")).dequantize()), module
            assert torch.equal(ref.get_submodule(module).weight.float(), ours), module


def test_gptq_onto_nvfp4_keeps_one_global_scale_per_fused_stage(tiny_models, tmp_path, llmopt_here):
    """`--scheme nvfp4a16 --method gptq`: GPTQ rounds onto the NVFP4 grid (its scales chosen up front from the stage's
    weights, stacked, so q/k/v and gate/up share their global scale); the package decompresses it to our weights."""
    (tmp_path / "calib.txt").write_text("\n".join(CORPUS))
    out = tmp_path / "gptq"
    result = llmopt_here("quantize", tiny_models("llama"), "--scheme", "nvfp4a16", "--method", "gptq", "--calib",
                         tmp_path / "calib.txt", "--nsamples", "4", "--seqlen", "32", "-o", out)  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    state = load_file(out / "model.safetensors")
    for layer in range(2):
        for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            assert len({float(state[f"model.layers.{layer}.{m}.weight_global_scale"]) for m in fused}) == 1
    modules = sorted({k.rpartition(".")[0] for k in state if k.endswith(".weight_packed")})
    with open_model(out) as q:
        for module in modules:
            local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
            theirs = NVFP4PackedCompressor.decompress(local, scheme)["weight"]
            assert torch.equal(theirs, q.load(f"{module}.weight").to(torch.bfloat16)), module


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_learned_rounding_onto_fp4_is_what_the_package_and_transformers_read(tiny_models, tmp_path, llmopt_here,
                                                                             scheme):  # fmt: skip
    """`--scheme nvfp4a16|mxfp4a16 --iters`: codes tuned along FP4's levels from round-to-nearest, under its scales;
    the package's decompressor and transformers hold exactly the weights llmopt reads back."""
    import transformers
    from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor

    (tmp_path / "calib.txt").write_text("\n".join(CORPUS))
    common = ["quantize", tiny_models("llama"), "--scheme", scheme]
    plain, tuned = tmp_path / "plain", tmp_path / "tuned"
    assert llmopt_here(*common, "-o", plain).returncode == 0
    result = llmopt_here(*common, "--iters", "40", "--calib", tmp_path / "calib.txt", "--nsamples", "8", "--seqlen", "32",
                         "--batch-size", "4", "-o", tuned, "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    layers = json.loads(result.stdout)["layers"]
    assert all(r["tune_mse"] <= r["tune_start_mse"] for r in layers) and any(r["tune_kept"] for r in layers)
    config = QuantizationConfig.model_validate(json.loads((tuned / "config.json").read_text())["quantization_config"])
    (group,) = config.config_groups.values()
    compressor = NVFP4PackedCompressor if scheme == "nvfp4a16" else MXFP4PackedCompressor
    a, b = load_file(plain / "model.safetensors"), load_file(tuned / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a if "scale" in k)  # the grid's scales are the untuned run's
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith(".weight_packed"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tuned, dtype=torch.bfloat16)
    with torch.no_grad():
        ref(torch.tensor([[1, 2, 3]]))  # the first forward decompresses
    with open_model(tuned) as q:
        for module in sorted({k.rpartition(".")[0] for k in b if k.endswith(".weight_packed")}):
            local = {k.rpartition(".")[2]: v for k, v in b.items() if k.rpartition(".")[0] == module}
            ours = q.load(f"{module}.weight").to(torch.bfloat16)
            assert torch.equal(compressor.decompress(local, group)["weight"].to(torch.bfloat16), ours), module
            assert torch.equal(ref.get_submodule(module).weight, ours), module
