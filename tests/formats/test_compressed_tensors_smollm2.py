"""SmolLM2 in compressed-tensors, written once per module: the compressed-tensors package decompresses it to the
weights llmopt reads, transformers greedy-decodes the tokens llmopt's runtime does, and GPTQ written in this
format holds the same codes as the same run's GPTQ checkpoint; the same holds for GPTQ with learned rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from llmopt.calibration.samples import CalibConfig, calibration_tokens
from llmopt.calibration.text import read_texts
from llmopt.formats.checkpoint import CheckpointWriter
from llmopt.model import open_model
from llmopt.quant.gptq import GPTQConfig
from llmopt.quant.pipeline import QuantizeSpec, quantize_model
from llmopt.quant.rtn import RTNConfig
from llmopt.quant.tune import TuneConfig
from tests.factories import write_checkpoint
from tests.formats.test_compressed_tensors import package_weights
from tests.formats.gguf.llama_cpp_helpers import assert_near_tie, first_difference

pytestmark = pytest.mark.slow
VALID = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2" / "valid.txt"
PROMPT = "The history of the Roman Empire"


@pytest.fixture(scope="module")
def smol_ct(smollm2_hf, tmp_path_factory):
    """W4A16 g64 by GPTQ with act-order and static groups, written by one pipeline run both as a GPTQ and as a
    compressed-tensors checkpoint; the same GPTQ with a few steps of learned rounding (`--iters`); RTN W4A16
    asymmetric g64 and W8A16 per channel. (Group 64, not 128: SmolLM2's
    576-wide inputs hold 4.5 groups of 128, and compressed-tensors' decompressor, like vLLM, takes whole groups.)"""
    root = tmp_path_factory.mktemp("smol-ct")
    out = {}
    with open_model(smollm2_hf) as src:
        tokens = calibration_tokens(read_texts(str(VALID)), src.tokenizer().encode, CalibConfig(str(VALID), None, 8, 128, 0))
        spec = QuantizeSpec(GPTQConfig(4, 64, act_order=True, static_groups=True, damp=0.05))
        with CheckpointWriter(src, spec, root / "gptq", "gptq") as gptq, \
                CheckpointWriter(src, spec, root / "w4-gptq", "compressed-tensors") as ct:  # fmt: skip
            for block in quantize_model(src, spec, tokens):
                gptq.add(block)
                ct.add(block)
            out["gptq"], out["w4-gptq"] = gptq.finish(), ct.finish()
        tuned = QuantizeSpec(spec.method, batch_size=4, tune=TuneConfig(5, None, 4, seed=0))
        out["w4-gptq-tuned"] = write_checkpoint(src, tuned, quantize_model(src, tuned, tokens), root / "w4-gptq-tuned",
                                                fmt="compressed-tensors")  # fmt: skip
        for name, method in (("w4-asym", RTNConfig(4, 64, sym=False)), ("w8-channel", RTNConfig(8, -1))):
            spec = QuantizeSpec(method)
            out[name] = write_checkpoint(src, spec, quantize_model(src, spec), root / name, fmt="compressed-tensors")
    return out


@pytest.mark.parametrize("name", ["w4-gptq", "w4-gptq-tuned", "w4-asym", "w8-channel"])
def test_package_decompresses_the_weights_llmopt_reads(smol_ct, name):
    """Every linear: the package's decompressor (in the float16 of the scales) equals llmopt's float32 weights
    rounded to float16, max abs diff 0."""
    theirs = package_weights(smol_ct[name])
    assert len(theirs) == 30 * 7
    with open_model(smol_ct[name]) as src:
        for module, w in theirs.items():
            assert torch.equal(w, src.load(f"{module}.weight").half()), module


@pytest.mark.parametrize("name", ["w4-gptq", "w4-gptq-tuned", "w8-channel"])
def test_transformers_greedy_tokens_are_llmopts(smol_ct, name):
    """32 greedy tokens from transformers (its compressed-tensors quantizer) and from llmopt's runtime (packed
    layers as bit planes), float32. transformers 5.25 with compressed-tensors 0.20.1 does not load asymmetric
    pack-quantized files, the package's own included (tests/model/test_compressed_tensors.py)."""
    from llmopt.api.generate import generate
    from llmopt.runtime.weights import load_model

    loaded = load_model(str(smol_ct[name]), "float32", "cpu", quantized=True)
    ours = generate(loaded, PROMPT, max_tokens=32, ignore_eos=True, temperature=0).token_ids
    ids = torch.tensor([loaded.tokenizer.encode(PROMPT)])
    model = transformers.AutoModelForCausalLM.from_pretrained(smol_ct[name], dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    theirs = out.sequences[0, ids.shape[1]:].tolist()
    assert len(ours) == 32 and len(set(ours)) > 10
    # other thread counts round the products otherwise: a near-tie may break the other way (under `-n 2` the
    # tuned checkpoint split at token 16, where llmopt took the end-of-text token that min_new_tokens keeps
    # transformers from), and past it the two continuations are no longer comparable: the raw logits decide
    first = first_difference(ours, theirs)
    if first is not None:
        assert_near_tie(first, 32, float(out.logits[first][0, theirs[first]] - out.logits[first][0, ours[first]]))


def test_gptq_in_compressed_tensors_has_the_gptq_checkpoints_codes(smol_ct):
    """The same run written both ways: codes, scales and zero points of every linear equal, groups the same."""
    with open_model(smol_ct["gptq"]) as gptq, open_model(smol_ct["w4-gptq"]) as ct:
        assert set(gptq.modules) == set(ct.modules) and len(ct.modules) == 30 * 7
        for module in ct.modules:
            a, b = gptq.quantized(module), ct.quantized(module)
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), module
            assert torch.equal(a.zeros, b.zeros) and torch.equal(a.group_index(), b.group_index()), module


def test_learned_rounding_moved_codes_off_gptqs(smol_ct):
    """The tuned file is not GPTQ's again: learned rounding changed codes, on the same groups."""
    with open_model(smol_ct["w4-gptq"]) as gptq, open_model(smol_ct["w4-gptq-tuned"]) as tuned:
        moved = [m for m in gptq.modules if not torch.equal(gptq.quantized(m).codes, tuned.quantized(m).codes)]
        assert all(torch.equal(gptq.quantized(m).group_index(), tuned.quantized(m).group_index()) for m in gptq.modules)
    assert len(moved) > 30, moved


@pytest.fixture(scope="module")
def smol_fp8(smollm2_hf, tmp_path_factory):
    """SmolLM2 as `--scheme fp8-dynamic` (round to nearest: no calibration, seconds)."""
    from llmopt.api.quantize import quantize

    out = tmp_path_factory.mktemp("smol-fp8") / "fp8"
    quantize(str(smollm2_hf), out, scheme="fp8-dynamic")
    return out


def test_fp8_package_decompresses_llmopts_weights_and_transformers_decodes_its_tokens(smol_fp8):
    """Every linear's float8 weight times its float32 scale, as the package's FloatQuantizationCompressor computes
    it, is llmopt's weight exactly; transformers, its per-token activation quantization turned off (llmopt runs
    FP8 as W8A16), greedy-decodes llmopt's 32 tokens."""
    import json

    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from llmopt.api.generate import generate
    from llmopt.runtime.weights import load_model

    (scheme,) = QuantizationConfig.model_validate(
        json.loads((smol_fp8 / "config.json").read_text())["quantization_config"]).config_groups.values()  # fmt: skip
    state = load_file(smol_fp8 / "model.safetensors")
    modules = sorted({k.rpartition(".")[0] for k in state if k.endswith(".weight_scale")})
    assert len(modules) == 30 * 7
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    with open_model(smol_fp8) as src:
        for module in modules:
            local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
            assert torch.equal(compressor.decompress(local, scheme)["weight"], src.load(f"{module}.weight")), module
    loaded = load_model(str(smol_fp8), "float32", "cpu")
    ours = generate(loaded, PROMPT, max_tokens=32, ignore_eos=True, temperature=0).token_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(smol_fp8, dtype=torch.float32)
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            m.quantization_scheme.input_activations = None
    ids = torch.tensor([loaded.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(ours) == 32 and ours == theirs


@pytest.fixture(scope="module")
def smol_fp4(smollm2_hf, tmp_path_factory):
    """SmolLM2 as `--scheme nvfp4a16` and `--scheme mxfp4a16` (round to nearest: no calibration, seconds)."""
    from llmopt.api.quantize import quantize

    root = tmp_path_factory.mktemp("smol-fp4")
    for scheme in ("nvfp4a16", "mxfp4a16"):
        quantize(str(smollm2_hf), root / scheme, scheme=scheme)
    return root


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_fp4_package_and_transformers_hold_llmopts_weights(smol_fp4, scheme):
    """Every linear: the package's NVFP4/MXFP4 decompressor and transformers (bfloat16: its FP4 weights are
    bfloat16 on the CPU) hold llmopt's weights rounded to bfloat16 (MXFP4's are exact in bfloat16). Greedy tokens
    are not compared: transformers runs the whole model in bfloat16, and on this prompt NVFP4's first two logits
    tie there (27.625 both; 27.642 and 27.535 in float32 over the same weights)."""
    import json

    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    out = smol_fp4 / scheme
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    (scheme_args,) = config.config_groups.values()
    state = load_file(out / "model.safetensors")
    modules = sorted({k.rpartition(".")[0] for k in state if k.endswith(".weight_packed")})
    assert len(modules) == 30 * 7
    compressor = BaseCompressor.get_value_from_registry(config.format)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # the first forward decompresses
    with open_model(out) as src:
        for module in modules:
            ours = src.load(f"{module}.weight")
            local = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == module}
            assert torch.equal(compressor.decompress(local, scheme_args)["weight"], ours.to(torch.bfloat16)), module
            assert torch.equal(model.get_submodule(module).weight, ours.to(torch.bfloat16)), module
            if scheme == "mxfp4a16":
                assert torch.equal(ours.to(torch.bfloat16).float(), ours), module
