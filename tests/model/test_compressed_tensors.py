"""compressed-tensors checkpoints written by the compressed-tensors package itself (llm-compressor's writer) read
in llmopt: the logits transformers gives, the package's own decompressed weights, old checkpoints with
`weight_g_idx`, and bad input as one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                             preset_name_to_scheme)
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from safetensors.torch import load_file, save_file

from llmopt.errors import InputError
from llmopt.model import open_model
from llmopt.model.packing import pack_rows
from llmopt.quantized_tensor import QuantizedTensor
from llmopt.runtime.group_int import GroupIntLinear
from llmopt.runtime.weights import build_decoder

IDS = torch.tensor([[1, 5, 9, 33, 70, 100, 7, 8, 250, 3, 41, 17]])


def _fill_minmax(model: torch.nn.Module, bits: int, group_size: int, sym: bool, fp8: bool = False) -> None:
    """Each quantized module's scale and zero point from its weights' range, as a min-max observer would."""
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data
        g = w.view(w.shape[0], -1, group_size) if group_size > 0 else w.unsqueeze(1)
        half = 1 << (bits - 1)
        if fp8:
            scale, zp = g.abs().amax(-1) / torch.finfo(torch.float8_e4m3fn).max, torch.zeros(g.shape[:2])
        elif sym:
            scale, zp = g.abs().amax(-1) / (half - 1), torch.zeros(g.shape[:2])
        else:
            lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
            scale = (hi - lo) / (2 * half - 1)
            zp = (-half - torch.round(lo / scale)).clamp(-half, half - 1)
        module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zp.reshape(module.weight_zero_point.shape).to(module.weight_zero_point.dtype)


def package_checkpoint(source: Path, out: Path, bits: int, group_size: int, sym: bool, fp8: bool = False) -> Path:
    """A tiny Llama quantized and saved by the compressed-tensors package: its config applied to the model, the
    min-max parameters filled in, its ModelCompressor compressing and writing the config, as llm-compressor does
    (`fp8`: the FP8_DYNAMIC preset's scheme, float-quantized)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    weights = {"num_bits": bits, "type": "float" if fp8 else "int", "symmetric": sym,
               "strategy": "group" if group_size > 0 else "channel", "group_size": group_size if group_size > 0 else None}
    group = {"targets": ["Linear"], "weights": weights}
    if fp8:
        group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    fmt = "float-quantized" if fp8 else "pack-quantized"
    config = QuantizationConfig(config_groups={"group_0": group}, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.FROZEN, format=fmt)  # fmt: skip
    apply_quantization_config(model, config)
    _fill_minmax(model, bits, group_size, sym, fp8)
    return _compress_and_save(model, fmt, source, out)


def _compress_and_save(model: torch.nn.Module, fmt: str, source: Path, out: Path) -> Path:
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, out / name)
    return out


def package_fp4_checkpoint(source: Path, out: Path, preset: str, fmt: str) -> Path:
    """An FP4 preset (NVFP4A16, MXFP4A16) applied by the package, each module's scales (NVFP4: and global scale)
    from its own helpers (generate_gparam, calculate_qparams: what its min-max observer computes), compressed and
    saved."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"], quantization_status=QuantizationStatus.FROZEN, format=fmt)  # fmt: skip
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w, args = module.weight.data, module.quantization_scheme.weights
            gs = None
            if hasattr(module, "weight_global_scale"):
                gs = module.weight_global_scale.data = generate_gparam(w.min(), w.max()).reshape(module.weight_global_scale.shape)
            g = w.view(w.shape[0], -1, args.group_size)
            scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
            module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
    return _compress_and_save(model, fmt, source, out)


@pytest.fixture(scope="module")
def package_dirs(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("ct-package")
    settings = {"w4g32": (4, 32, True), "w8ch": (8, -1, True), "w4g32-asym": (4, 32, False), "fp8": (8, -1, True, True)}
    dirs = {name: package_checkpoint(tiny_models("llama"), root / name, *s) for name, s in settings.items()}
    fp4 = {"nvfp4": ("NVFP4A16", "nvfp4-pack-quantized"), "mxfp4": ("MXFP4A16", "mxfp4-pack-quantized")}
    return {**dirs, **{name: package_fp4_checkpoint(tiny_models("llama"), root / name, *s) for name, s in fp4.items()}}


@pytest.mark.parametrize("name", ["w4g32", "w8ch"])
def test_package_written_checkpoint_gives_transformers_logits(package_dirs, name):
    """transformers (its compressed-tensors quantizer, decompressing on the first forward) and llmopt's runtime,
    the packed layers kept as bit planes, agree within 1e-4."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(package_dirs[name], dtype=torch.float32)
    with torch.no_grad():
        expected = ref(IDS).logits
    with open_model(package_dirs[name]) as src:
        assert src.kind == "hf-compressed-tensors"
        model = build_decoder(src, torch.float32, torch.device("cpu"), quantized=True)
    assert any(isinstance(m, GroupIntLinear) for m in model.modules())
    with torch.no_grad():
        got = model(IDS)
    assert (got - expected).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["w4g32", "w8ch", "w4g32-asym", "fp8", "nvfp4", "mxfp4"])
def test_package_written_weights_are_the_packages_decompressed_ones(package_dirs, name):
    """The package's own decompressor and llmopt's reader give the same weights (the scales are float32 here, so
    exactly; NVFP4's decompressor casts its float32 result to bfloat16, so ours rounded to bfloat16). Asymmetric
    files are checked this way only: transformers 5.25 with compressed-tensors 0.20.1 does not load them (it
    expects the zero points unpacked, [out, groups], and stops on the size mismatch)."""
    out = package_dirs[name]
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    state = load_file(out / "model.safetensors")
    modules = sorted({k.rpartition(".")[0] for k in state if k.endswith(".weight_scale")})
    assert len(modules) == 14
    compressor = BaseCompressor.get_value_from_registry(config.format)
    assert (compressor is PackedQuantizationCompressor) == (name not in ("fp8", "nvfp4", "mxfp4"))
    with open_model(out) as src:
        for module in modules:
            local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
            theirs = compressor.decompress(local, scheme)["weight"]
            assert torch.equal(src.load(f"{module}.weight").to(theirs.dtype), theirs), module


def test_package_written_nvfp4_loads_in_transformers_with_our_weights(package_dirs):
    """transformers 5.25 loads NVFP4A16 on the CPU in bfloat16 only (its decompressed weights are bfloat16; a
    float32 model stops in F.linear: "expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16").
    Its weights are llmopt's rounded to bfloat16, and llmopt's runtime (float32) gives its logits within bfloat16's
    precision."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(package_dirs["nvfp4"], dtype=torch.bfloat16)
    with torch.no_grad():
        expected = ref(IDS).logits.float()  # the first forward decompresses
    with open_model(package_dirs["nvfp4"]) as src:
        assert src.tensors["model.layers.0.mlp.up_proj.weight"].dtype == "CT-NVFP4"
        for name, module in ref.named_modules():
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
                assert torch.equal(module.weight, src.load(f"{name}.weight").to(torch.bfloat16)), name
        model = build_decoder(src, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        assert (model(IDS) - expected).abs().max() < 0.05 * expected.abs().max()


def test_package_written_fp8_gives_transformers_logits_without_activation_quantization(package_dirs):
    """FP8_DYNAMIC quantizes activations per token at run time; llmopt's runtime keeps them in its dtype (W8A16).
    With transformers' activation quantization turned off, the logits agree within 1e-4: the weights are the same."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(package_dirs["fp8"], dtype=torch.float32)
    for module in ref.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            module.quantization_scheme.input_activations = None
    with torch.no_grad():
        expected = ref(IDS).logits
    with open_model(package_dirs["fp8"]) as src:
        assert src.tensors["model.layers.0.mlp.up_proj.weight"].dtype == "CT-FP8"
        model = build_decoder(src, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        assert (model(IDS) - expected).abs().max() < 1e-4


def _edit(src: Path, out: Path, config=None, tensors=None) -> Path:
    """A copy of checkpoint `src` with its quantization_config and tensors changed by the given functions."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    if config is not None:
        config(cfg["quantization_config"])
        (out / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(out / "model.safetensors")
        tensors(state)
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_old_checkpoint_with_g_idx_reads_its_permuted_groups(package_dirs, tmp_path):
    """Before compressed-tensors 0.18, actorder "group" stored `weight_g_idx`: column i in group g_idx[i]. One
    module rewritten with permuted groups reads as the QuantizedTensor it was packed from."""
    module = "model.layers.0.mlp.down_proj"  # [64, 128], 4 groups of 32
    gen = torch.Generator().manual_seed(0)
    qt = QuantizedTensor(codes=torch.randint(0, 16, (64, 128), generator=gen), scales=torch.rand(64, 4, generator=gen) / 10,
                         bits=4, group_size=32, g_idx=torch.randperm(128, generator=gen) // 32)  # fmt: skip

    def with_g_idx(state):
        state[f"{module}.weight_packed"] = pack_rows(qt.codes.t(), 4).t().contiguous()
        state[f"{module}.weight_scale"] = qt.scales.clone()
        state[f"{module}.weight_g_idx"] = qt.g_idx.to(torch.int32)

    out = _edit(package_dirs["w4g32"], tmp_path / "g_idx", lambda q: q["config_groups"]["group_0"]["weights"].update(
        actorder="group"), with_g_idx)  # fmt: skip
    with open_model(out) as src:
        assert torch.equal(src.load(f"{module}.weight"), qt.dequantize())
        assert torch.equal(src.quantized(module).group_index(), qt.g_idx)


def _unknown_format(q):
    q["config_groups"]["group_0"]["format"] = "marlin-24"


def _float_scheme(q):
    q["config_groups"]["group_0"]["weights"]["type"] = "float"


def _activations(q):
    q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}


def _shape_lies(state):
    state["model.layers.1.self_attn.o_proj.weight_shape"] = torch.tensor([64, 96])


def _no_scale(state):
    del state["model.layers.1.mlp.up_proj.weight_scale"]


@pytest.mark.parametrize("config,tensors,expect", [
    (_unknown_format, None, "config_groups.group_0: format 'marlin-24' is not supported"),
    (_float_scheme, None, "weight scheme float 4-bit group"),
    (_activations, None, "quantized activations are not supported"),
    (lambda q: q.update(quantization_status="frozen"), None, "quantization_status 'frozen'"),
    (None, _shape_lies, "model.layers.1.self_attn.o_proj.weight_packed has shape [64, 8]; weight_shape [64, 96]"),
    (None, _no_scale, "model.layers.1.mlp.up_proj.weight_scale is missing"),
])  # fmt: skip
def test_bad_input_is_one_line_naming_the_path(package_dirs, tmp_path, config, tensors, expect):
    out = _edit(package_dirs["w4g32"], tmp_path / "bad", config, tensors)
    with pytest.raises(InputError) as e:
        open_model(out)
    assert expect in str(e.value) and str(out) in str(e.value) and "\n" not in str(e.value)


def test_static_activations_without_their_scale_are_one_line(package_dirs, tmp_path):
    """FP8 with static per-tensor activations (the FP8 preset's) stores `input_scale` per linear; a file whose config
    says so but lacks one stops with one line."""
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    out = _edit(package_dirs["fp8"], tmp_path / "static", lambda q: q["config_groups"]["group_0"].update(input_activations=acts))
    with pytest.raises(InputError) as e:
        open_model(out)
    assert "model.layers.0.mlp.down_proj.input_scale is missing" in str(e.value) and "\n" not in str(e.value)
