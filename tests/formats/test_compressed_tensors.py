"""compressed-tensors `pack-quantized` checkpoints written by llmopt: the packing is the package's own, what
llmopt writes reads back exactly, and the compressed-tensors package decompresses it to the same weights
(computed in the scale's float16, so equal to ours rounded to float16)."""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor, pack_to_int32
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_name
from safetensors.torch import load_file

from llmopt.calibration.samples import CalibConfig, calibration_tokens
from llmopt.calibration.text import CalibText
from llmopt.errors import OptionError
from llmopt.formats.checkpoint import check_spec
from llmopt.model import open_model
from llmopt.model.packing import pack_rows
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from llmopt.quant.rtn import RTNConfig
from tests.factories import CORPUS, write_checkpoint


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("cols", [64, 70])  # a last word only partly filled
def test_packing_is_the_packages(bits, cols) -> None:
    """Our codes packed along the inputs are pack_to_int32 of the signed values (code − 2^(b−1)), and zero points
    packed along the outputs are its packed_dim=0."""
    codes = torch.randint(0, 1 << bits, (5, cols), generator=torch.Generator().manual_seed(bits + cols))
    signed = (codes - (1 << (bits - 1))).to(torch.int8)
    assert torch.equal(pack_rows(codes.t(), bits).t(), pack_to_int32(signed, bits))
    assert torch.equal(pack_rows(codes, bits), pack_to_int32(signed, bits, packed_dim=0))


def package_weights(out) -> dict[str, torch.Tensor]:
    """Every packed module of `out` as the compressed-tensors package decompresses it, each with the scheme of
    the config group whose targets match its name (the package's own matching)."""
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    state = load_file(out / "model.safetensors")
    modules = sorted({k.rpartition(".")[0] for k in state if k.endswith(".weight_packed")})
    weights = {}
    for module in modules:
        schemes = [g for g in config.config_groups.values() if any(match_name(module, t) for t in g.targets)]
        assert len(schemes) == 1, module  # every module in exactly one group
        local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
        weights[module] = PackedQuantizationCompressor.decompress(local, schemes[0])["weight"]
    return weights


def write(tiny_models, tmp_path, method, name: str = "ct", tokens=None, **spec_fields) -> tuple:
    spec = QuantizeSpec(method, **spec_fields)
    produced = {}
    with open_model(tiny_models("llama")) as src:
        out = write_checkpoint(src, spec, quantize_model(src, spec, tokens), tmp_path / name, fmt="compressed-tensors",
                               on_block=lambda b: produced.update({k: v.dequantize() for k, v in b.tensors.items()}))
    return out, produced


@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, True), (4, 32, False), (8, -1, True), (8, -1, False), (4, 0, False)])
def test_reads_back_exactly_and_the_package_decompresses_the_same_weights(tiny_models, tmp_path, bits, group_size, sym):
    out, produced = write(tiny_models, tmp_path, RTNConfig(bits, group_size, sym))
    ours = {}
    with open_model(out) as q:
        assert q.kind == "hf-compressed-tensors"
        for module, w in produced.items():
            ours[module] = q.load(f"{module}.weight")
            assert torch.equal(ours[module], w), module
    theirs = package_weights(out)
    assert set(theirs) == set(produced) and len(theirs) == 14
    for module, w in theirs.items():
        assert w.dtype == torch.float16  # the scale's dtype
        assert torch.equal(w, ours[module].half()), module  # max abs diff 0 against ours rounded to float16
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert (qc["quant_method"], qc["format"], qc["quantization_status"], qc["ignore"]) == \
        ("compressed-tensors", "pack-quantized", "compressed", ["lm_head"])  # fmt: skip
    strategy = "group" if group_size > 0 else "channel"
    assert (group["weights"]["num_bits"], group["weights"]["strategy"], group["weights"]["symmetric"]) == (bits, strategy, sym)
    state = load_file(out / "model.safetensors")
    down = "model.layers.0.mlp.down_proj"  # [64, 128]
    groups = 128 // group_size if group_size > 0 else 1
    assert state[f"{down}.weight_packed"].shape == (64, 128 * bits // 32) and state[f"{down}.weight_packed"].dtype == torch.int32
    assert state[f"{down}.weight_scale"].shape == (64, groups) and state[f"{down}.weight_scale"].dtype == torch.float16
    assert state[f"{down}.weight_shape"].tolist() == [64, 128] and state[f"{down}.weight_shape"].dtype == torch.int64
    assert (f"{down}.weight_zero_point" in state) == (not sym) and f"{down}.weight_g_idx" not in state
    if not sym:
        assert state[f"{down}.weight_zero_point"].shape == (64 * bits // 32, groups)


def test_per_module_bits_are_several_groups_naming_their_modules(tiny_models, tmp_path):
    """spec.dynamic (what --target-bpw chooses) becomes one config group per setting; the package's matching
    puts each module in its own setting's group, and both readers give its weights."""
    dynamic = {"model.layers.1.self_attn.q_proj": (8, -1), "model.layers.1.self_attn.k_proj": (8, -1),
               "model.layers.0.mlp.down_proj": (4, 64)}  # fmt: skip
    out, produced = write(tiny_models, tmp_path, RTNConfig(4, 32, True), dynamic=dynamic)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert len(qc["config_groups"]) == 3
    theirs = package_weights(out)
    with open_model(out) as q:
        for module, w in produced.items():
            assert q.module_config(module) == dynamic.get(module, (4, 32))
            assert torch.equal(q.load(f"{module}.weight"), w) and torch.equal(theirs[module], w.half()), module


def test_act_order_with_static_groups_is_actorder_weight(tiny_models, tmp_path):
    """GPTQ's act-order with static groups keeps contiguous groups: `actorder: "weight"`, no g_idx, read back
    exactly by both readers."""
    with open_model(tiny_models("llama")) as src:
        tokens = calibration_tokens(CalibText([CORPUS], "c", "0"), src.tokenizer().encode, CalibConfig("c", None, 4, 32, 0))
    out, produced = write(tiny_models, tmp_path, GPTQConfig(4, 32, act_order=True, static_groups=True), tokens=tokens)
    (group,) = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    assert group["weights"]["actorder"] == "weight"
    theirs = package_weights(out)
    with open_model(out) as q:
        for module, w in produced.items():
            assert torch.equal(q.load(f"{module}.weight"), w) and torch.equal(theirs[module], w.half()), module


@pytest.mark.parametrize("method,expect", [
    (RTNConfig(3, 32), "`bits` 3: compressed-tensors checkpoints hold 4 or 8 bits"),
    (RTNConfig(2, 32), "`bits` 2"),
    (GPTQConfig(4, 32, act_order=True), "`act_order` needs `static_groups`"),
])  # fmt: skip
def test_what_the_format_cannot_hold_is_one_line(method, expect):
    with pytest.raises(OptionError) as e:
        check_spec(QuantizeSpec(method), "compressed-tensors")
    assert expect in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(OptionError, match="`bits` 3"):
        check_spec(QuantizeSpec(RTNConfig(4, 32), dynamic={"model.layers.0.mlp.up_proj": (3, 32)}), "compressed-tensors")


def test_groups_must_divide_every_input_width(tiny_models, tmp_path):
    """compressed-tensors' decompressor (and vLLM) take whole groups only: a group size that leaves a partial
    last group is refused before anything is written."""
    spec = QuantizeSpec(RTNConfig(4, 48))
    with open_model(tiny_models("llama")) as src, pytest.raises(OptionError) as e:
        write_checkpoint(src, spec, quantize_model(src, spec), tmp_path / "g48", fmt="compressed-tensors")
    assert "`group_size` 48 does not divide a linear's 128 inputs" in str(e.value)
    assert not (tmp_path / "g48").exists()


def test_target_bpw_chooses_among_the_bits_the_format_holds(tiny_models, tmp_path):
    """`--target-bpw` with this format: each stage takes 4 or 8 bits (never GPTQ's 2 or 3), the checkpoint's
    quantized linears fit the target, and the package's decompressor agrees with llmopt's reader on every
    module under its own group."""
    from llmopt.api.quantize import quantize
    from llmopt.plan.gptq_automix import module_nbytes
    from llmopt.formats.checkpoint import layout

    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    out = tmp_path / "mix"
    result = quantize(tiny_models("llama"), out, method="gptq", bits=4, group_size=32, calib=str(calib), nsamples=4,
                      seqlen=48, target_bpw=6.0, sensitivity_samples=2, fmt="compressed-tensors")  # fmt: skip
    assert result.automix is not None and result.automix.bits_per_weight <= 6.0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    bits = {g["weights"]["num_bits"] for g in qc["config_groups"].values()}
    assert bits == {4, 8}  # a mix, of what the format holds
    theirs = package_weights(out)
    stored = weights = 0
    with open_model(out) as q:
        for module, w in theirs.items():
            assert torch.equal(w, q.load(f"{module}.weight").half()), module
            out_f, in_f = q.modules[module]
            stored += module_nbytes(out_f, in_f, *q.module_config(module), layout("compressed-tensors"), result.spec)
            weights += out_f * in_f
    assert 8 * stored / weights <= 6.0


@pytest.mark.parametrize("tuned", [False, True], ids=["rtn", "tuned"])
def test_fp8_dynamic_is_float_quantized_and_the_package_decompresses_it_exactly(tiny_models, tmp_path, llmopt_here,
                                                                                tuned):  # fmt: skip
    """`--scheme fp8-dynamic`: float8 e4m3 `weight` and a float32 scale per row, activations per token at run
    time in the config; the package's FloatQuantizationCompressor gives llmopt's weights exactly (float32
    scales, e4m3 values exact in float32), and transformers holds the same weights. With `--iters` (learned
    rounding along the e4m3 values, row scales kept) the file is the same format, read the same way."""
    from compressed_tensors.compressors.base import BaseCompressor

    out = tmp_path / "fp8"
    extra = []
    if tuned:
        (tmp_path / "calib.txt").write_text("\n".join(CORPUS))
        extra = ["--iters", "30", "--calib", tmp_path / "calib.txt", "--nsamples", "8", "--seqlen", "32",
                 "--batch-size", "4"]  # fmt: skip
    result = llmopt_here("quantize", tiny_models("llama"), "--scheme", "fp8-dynamic", *extra, "-o", out, "--json")
    assert result.returncode == 0, result.stderr
    if tuned:
        layers = json.loads(result.stdout)["layers"]
        assert all(r["tune_mse"] <= r["tune_start_mse"] for r in layers) and any(r["tune_kept"] for r in layers)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert (qc["format"], group["format"], group["weights"]["type"], group["weights"]["strategy"]) == \
        ("float-quantized", "float-quantized", "float", "channel")  # fmt: skip
    acts = group["input_activations"]
    assert (acts["type"], acts["num_bits"], acts["strategy"], acts["dynamic"]) == ("float", 8, "token", True)
    config = QuantizationConfig.model_validate(qc)
    state = load_file(out / "model.safetensors")
    down = "model.layers.0.mlp.down_proj"
    assert state[f"{down}.weight"].dtype == torch.float8_e4m3fn and state[f"{down}.weight"].shape == (64, 128)
    assert state[f"{down}.weight_scale"].dtype == torch.float32 and state[f"{down}.weight_scale"].shape == (64, 1)
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    modules = sorted({k.rpartition(".")[0] for k in state if k.endswith(".weight_scale")})
    assert len(modules) == 14
    with open_model(out) as q, open_model(tiny_models("llama")) as src:
        assert q.tensors[f"{down}.weight"].dtype == "CT-FP8"
        for module in modules:
            (scheme,) = [g for g in config.config_groups.values() if any(match_name(module, t) for t in g.targets)]
            local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
            ours = q.load(f"{module}.weight")
            assert torch.equal(compressor.decompress(local, scheme)["weight"], ours), module
            w = src.load(f"{module}.weight")
            assert (ours - w).abs().max() <= w.abs().amax() / 16  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("args,expect", [
    (["--format", "gptq"], "--scheme fp8-dynamic is written as --format compressed-tensors or dense, not gptq"),
    (["--method", "awq"], "--scheme fp8-dynamic rounds to nearest or by gptq: --method awq does not apply"),
    (["--method", "gptq", "--refit-scales"], "--refit-scales, --gptaq and --group-aware-order do not apply"),
])  # fmt: skip
def test_fp8_scheme_bad_input_is_one_line(tiny_models, tmp_path, llmopt_here, args, expect):
    result = llmopt_here("quantize", tiny_models("llama"), "--scheme", "fp8-dynamic", *args, "-o", tmp_path / "o")
    assert result.returncode == 2 and expect in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "o").exists()


def test_fp8_static_has_calibrated_per_tensor_input_scales(tiny_models, tmp_path, llmopt_here):
    """`--scheme fp8`: fp8-dynamic's weights with the FP8 preset's static per-tensor activations: one float32
    `input_scale` per linear (the largest |x| of its input / 448), which transformers loads as the module's own;
    the package decompresses the weights exactly as for fp8-dynamic."""
    import transformers
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    (tmp_path / "calib.txt").write_text("\n".join(CORPUS))
    out = tmp_path / "fp8"
    result = llmopt_here("quantize", tiny_models("llama"), "--scheme", "fp8", "--calib", tmp_path / "calib.txt",
                         "--nsamples", "4", "--seqlen", "32", "-o", out, "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    assert scheme.input_activations == preset_name_to_scheme("FP8", ["Linear"]).input_activations
    assert (scheme.weights.strategy, scheme.format) == ("channel", "float-quantized")  # the preset's are per tensor
    state = load_file(out / "model.safetensors")
    scales = {k.removesuffix(".input_scale"): v for k, v in state.items() if k.endswith(".input_scale")}
    assert len(scales) == 14 and all(v.shape == (1,) and v.dtype == torch.float32 and float(v) > 0 for v in scales.values())
    for layer in range(2):
        assert len({float(scales[f"model.layers.{layer}.self_attn.{m}_proj"]) for m in "qkv"}) == 1
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    with open_model(out) as q:
        for module, scale in scales.items():
            assert torch.equal(ref.get_submodule(module).input_scale.data, scale), module
            local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
            assert torch.equal(compressor.decompress(local, scheme)["weight"], q.load(f"{module}.weight")), module


def test_gptq_onto_the_fp8_grid(tiny_models, tmp_path, llmopt_here):
    """`--scheme fp8-dynamic --method gptq`: GPTQ's error feedback onto the FP8 grid (one scale per row, chosen from
    the weights before any column is rounded). The file is the same float-quantized layout, the package decompresses
    it to llmopt's weights exactly, and the rounding is not round-to-nearest's."""
    from compressed_tensors.compressors.base import BaseCompressor

    (tmp_path / "calib.txt").write_text("\n".join(CORPUS))
    outs = {}
    for method in ("rtn", "gptq"):
        outs[method] = tmp_path / method
        calib = ["--calib", tmp_path / "calib.txt", "--nsamples", "4", "--seqlen", "32"] if method == "gptq" else []
        result = llmopt_here("quantize", tiny_models("llama"), "--scheme", "fp8-dynamic", "--method", method, *calib,
                             "-o", outs[method])  # fmt: skip
        assert result.returncode == 0, result.stderr
    config = QuantizationConfig.model_validate(json.loads((outs["gptq"] / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    state, rtn = load_file(outs["gptq"] / "model.safetensors"), load_file(outs["rtn"] / "model.safetensors")
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    modules = sorted({k.rpartition(".")[0] for k in state if k.endswith(".weight_scale")})
    with open_model(outs["gptq"]) as q:
        for module in modules:
            local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
            assert torch.equal(compressor.decompress(local, scheme)["weight"], q.load(f"{module}.weight")), module
            assert torch.equal(state[f"{module}.weight_scale"], rtn[f"{module}.weight_scale"])  # the same row scales
    changed = [m for m in modules if not torch.equal(state[f"{m}.weight"].view(torch.uint8), rtn[f"{m}.weight"].view(torch.uint8))]
    assert len(changed) == len(modules)
