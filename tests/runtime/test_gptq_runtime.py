"""GPTQ checkpoints written by `llmopt quantize` run in the runtime: packed int4 kernel, bit planes
(runtime/group_int.py) and dequantized."""

import json

import pytest
import torch

from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.group_int import GroupIntLinear
from llmopt.runtime.int4 import PackedInt4Linear
from llmopt.runtime.weights import load_model


@pytest.fixture(scope="module")
def gptq_dirs(tiny_models, tmp_path_factory):
    """RTN 4-bit group 32 asym (int4 kernel applies) and 3-bit (it does not) GPTQ checkpoints."""
    from llmopt.cli.app import main

    out = {}
    for name, args in (("w4g32", ["--bits", "4", "--group-size", "32", "--asym"]), ("w3", ["--bits", "3", "--group-size", "32"])):
        path = tmp_path_factory.mktemp("gptq") / name
        assert main(["quantize", str(tiny_models("qwen2")), "-o", str(path), "--method", "rtn", "--json", *args]) == 0
        out[name] = path
    return out


def test_bfloat16_model_takes_the_int4_kernel_within_its_rounding(gptq_dirs):
    packed = load_model(str(gptq_dirs["w4g32"]), "bfloat16", "cpu", quantized=True).model
    dense = load_model(str(gptq_dirs["w4g32"]), "float32", "cpu", quantized=False).model
    assert sum(isinstance(m, PackedInt4Linear) for m in packed.modules()) == 2 * 7  # every block linear
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = packed(ids).float(), dense(ids)
    assert (a - b).abs().max() < 0.05 * b.abs().max()  # a bfloat16 model, the kernel's bfloat16 scales
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_dequantized_gptq_is_the_source_weights(gptq_dirs):
    """The runtime's GPTQ model dequantized (`--dequantize`) holds exactly the weights the GPTQ source
    dequantizes."""
    model = load_model(str(gptq_dirs["w3"]), "float32", "cpu", quantized=False).model
    with open_model(gptq_dirs["w3"]) as src:
        ref = Decoder.from_source(src)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
    assert not any(isinstance(m, (PackedInt4Linear, GroupIntLinear)) for m in model.modules())


@pytest.mark.parametrize("name", ["w3", "w4g32"])
def test_float32_gptq_stays_in_bit_planes_with_the_dequantized_logits(gptq_dirs, name):
    """3 bits, and 4 in a float32 model (the int4 kernel would round activations to bfloat16): every block
    linear held as bit planes, the logits the dequantized model's within float32 rounding of the summation
    order."""
    kept = load_model(str(gptq_dirs[name]), "float32", "cpu", quantized=True).model
    dense = load_model(str(gptq_dirs[name]), "float32", "cpu", quantized=False).model
    a = kept.arch  # q/k/v and gate/up stacked
    block_rows = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + 2 * a.hidden_size + 2 * a.intermediate_size
    assert sum(m.out_features for m in kept.modules() if isinstance(m, GroupIntLinear)) == a.num_layers * block_rows
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = kept(ids), dense(ids)
    assert (a - b).abs().max() <= 1e-3 * b.abs().max()


def test_a_gptq_model_is_dequantized_where_it_fits_and_kept_packed_where_not(gptq_dirs, monkeypatch):
    """The default (no --keep-quantized/--dequantize): on CPU, dequantized while the float model takes at most
    half the available memory (the faster path there), packed above it, by the same rule as a GGUF."""
    from llmopt.runtime import weights

    path = str(gptq_dirs["w4g32"])
    with open_model(path) as src:
        dequantized_bytes = src.parameter_count * 4
    monkeypatch.setattr(weights, "available_memory", lambda: 2 * dequantized_bytes)
    roomy = load_model(path, "float32", "cpu").model
    assert not any(isinstance(m, (PackedInt4Linear, GroupIntLinear)) for m in roomy.modules())
    monkeypatch.setattr(weights, "available_memory", lambda: 2 * dequantized_bytes - 2)
    tight = load_model(path, "float32", "cpu").model
    assert sum(isinstance(m, GroupIntLinear) for m in tight.modules()) == 2 * 4  # q/k/v and gate/up stacked


def test_the_registry_alone_decides_what_a_packed_layer_becomes(gptq_dirs, monkeypatch):
    """weights.py asks runtime/linear.py's registry for every packed layer: with GPTQ's entry left only its
    bit planes, a bfloat16 model that took the int4 kernel holds bit planes; with no entry, it is dequantized
    (the logits of `quantized=False`, exactly)."""
    from llmopt.runtime import linear

    path = str(gptq_dirs["w4g32"])
    _, planes = linear.REGISTRY["gptq"]
    monkeypatch.setitem(linear.REGISTRY, "gptq", (planes,))
    model = load_model(path, "bfloat16", "cpu", quantized=True).model
    assert not any(isinstance(m, PackedInt4Linear) for m in model.modules())
    assert sum(isinstance(m, GroupIntLinear) for m in model.modules()) == 2 * 4  # q/k/v and gate/up stacked
    monkeypatch.delitem(linear.REGISTRY, "gptq")
    model = load_model(path, "float32", "cpu", quantized=True).model
    dense = load_model(path, "float32", "cpu", quantized=False).model
    assert not any(isinstance(m, (PackedInt4Linear, GroupIntLinear)) for m in model.modules())
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(ids), dense(ids))


def test_cli_generate_and_eval_on_gptq(llmopt_here, gptq_dirs, tiny_models, tmp_path):
    from tests.factories import CORPUS

    r = llmopt_here("generate", gptq_dirs["w4g32"], "-p", "The quick", "-n", "8", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 8
    data = tmp_path / "corpus.txt"
    data.write_text(CORPUS)
    r = llmopt_here("eval", gptq_dirs["w4g32"], "--data", data, "--ctx", "32", "--windows", "3",
                    "--ref", tiny_models("qwen2"), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["kl_divergence"] > 0 and result["top1_agreement"] > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_smollm2_gptq_in_bit_planes_decodes_the_dequantized_tokens(smollm2_hf, tmp_path, bits):
    """SmolLM2 as a 3-, 4- and 8-bit GPTQ checkpoint (RTN, group 64) kept as bit planes: 64 greedy tokens
    equal the dequantized model's, holding about the checkpoint's bits."""
    from llmopt.api.generate import generate
    from llmopt.cli.app import main

    out = tmp_path / f"w{bits}"
    assert main(["quantize", str(smollm2_hf), "-o", str(out), "--method", "rtn", "--bits", str(bits),
                 "--group-size", "64", "--json"]) == 0
    kept = load_model(str(out), "float32", "cpu", quantized=True)
    dense = load_model(str(out), "float32", "cpu", quantized=False)
    planes = [m for m in kept.model.modules() if isinstance(m, GroupIntLinear)]
    assert len(planes) == 30 * 4  # per layer: q/k/v stacked, o, gate/up stacked, down
    held = sum(b.numel() * b.element_size() for m in planes for b in m.buffers())
    weights = sum(m.out_features * m.in_features for m in planes)
    assert held * 8 / weights < bits + 0.5  # bits per weight, with a float16 scale and a zero per 64
    prompt = "The history of the Roman Empire"
    a = generate(kept, prompt, max_tokens=64, ignore_eos=True).token_ids
    b = generate(dense, prompt, max_tokens=64, ignore_eos=True).token_ids
    assert len(a) == 64 and a == b and len(set(a)) > 20


def test_act_order_gptq_stays_in_bit_planes_with_the_dequantized_logits(tiny_models, tmp_path):
    """GPTQ with --act-order (desc_act: g_idx permutes the columns): kept as bit planes in group order, each
    layer permuting its input, with the dequantized model's logits within float32 rounding."""
    from llmopt.cli.app import main
    from tests.factories import CORPUS

    calib_txt = tmp_path / "calib.txt"
    calib_txt.write_text(CORPUS)
    out = tmp_path / "act"
    assert main(["quantize", str(tiny_models("llama")), "-o", str(out), "--method", "gptq", "--bits", "3",
                 "--group-size", "32", "--act-order", "--calib", str(calib_txt), "--nsamples", "4",
                 "--seqlen", "32", "--json"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["desc_act"] is True
    kept = load_model(str(out), "float32", "cpu", quantized=True).model
    dense = load_model(str(out), "float32", "cpu", quantized=False).model
    planes = [m for m in kept.modules() if isinstance(m, GroupIntLinear)]
    assert len(planes) >= 2 * 4 and all(m.order is not None for m in planes)
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = kept(ids), dense(ids)
    assert (a - b).abs().max() <= 1e-3 * b.abs().max()
