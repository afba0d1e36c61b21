"""GPTQ checkpoints written by `llmopt quantize` run in the runtime: packed int4 kernel and dequantized."""

import json

import pytest
import torch

from llmopt.model import open_model
from llmopt.model.decoder import Decoder
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


def test_packed_int4_equals_dequantized_within_bfloat16(gptq_dirs):
    packed = load_model(str(gptq_dirs["w4g32"]), "float32", "cpu", packed=True).model
    dense = load_model(str(gptq_dirs["w4g32"]), "float32", "cpu", packed=False).model
    assert sum(isinstance(m, PackedInt4Linear) for m in packed.modules()) == 2 * 7  # every block linear
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = packed(ids), dense(ids)
    assert (a - b).abs().max() < 0.02 * b.abs().max()  # activations enter the kernel as bfloat16
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_dequantized_gptq_is_the_source_weights(gptq_dirs):
    """The runtime's GPTQ model holds exactly the weights the GPTQ source dequantizes."""
    model = load_model(str(gptq_dirs["w3"]), "float32", "cpu").model
    with open_model(gptq_dirs["w3"]) as src:
        ref = Decoder.from_source(src)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
    assert not any(isinstance(m, PackedInt4Linear) for m in model.modules())


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
