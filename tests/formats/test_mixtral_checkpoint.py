"""Mixtral through the layer-sequential pipeline: GPTQ quantizes each expert from the calibration
tokens routed to it (its own Hessian), experts no token reached are rounded to nearest with a
warning naming them, and the checkpoint (one quantized linear per expert, as GPTQModel writes
Mixtral) reads back."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from llmopt.api import quantize
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from tests.factories import CORPUS
from tests.model.test_mixtral import EXPERTS, make_tiny_mixtral, reference


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_mixtral(tmp_path_factory.mktemp("mixtral") / "m")


def _calib(tmp_path):  # noqa: ANN001, ANN202
    calib = tmp_path / "c.txt"
    calib.write_text(CORPUS)
    return str(calib)


def test_gptq_checkpoint_end_to_end(mixtral, tmp_path) -> None:
    """GPTQ 4-bit g32 writes every expert's w1/w2/w3 packed; llmopt reads the checkpoint back, and on
    text like its calibration its logits are closer to the float model's than round-to-nearest's."""
    blocks = []
    quantize(mixtral, tmp_path / "gptq", method="gptq", bits=4, group_size=32, calib=_calib(tmp_path), nsamples=8,
             seqlen=64, on_block=lambda block, total: blocks.append(block))  # fmt: skip
    reports = {r.name: r for b in blocks for r in b.reports}
    experts = [n for n in reports if ".experts." in n]
    assert len(experts) == 2 * EXPERTS * 3 and all(reports[n].details["routed_tokens"] > 0 for n in experts)
    assert sum(reports[f"model.layers.0.block_sparse_moe.experts.{e}.w1"].details["routed_tokens"]
               for e in range(EXPERTS)) == 2 * 8 * 64  # each token reaches two experts
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq" and config["num_local_experts"] == EXPERTS
    with safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.1.block_sparse_moe.experts.{e}.w2.qweight" for e in range(EXPERTS)} <= names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names  # the router stays float
    quantize(mixtral, tmp_path / "rtn", method="rtn", bits=4, group_size=32)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(mixtral)
    x = torch.tensor([tok(CORPUS[300:900], add_special_tokens=False)["input_ids"][:96]])
    want = reference(mixtral)(x).logits[0].detach()
    errors = {}
    for method in ("gptq", "rtn"):
        with open_model(tmp_path / method) as back, torch.no_grad():
            assert back.arch.family.name == "mixtral"
            ours = Decoder.from_source(back)(x)[0]
        errors[method] = ((ours - want).norm() / want.norm()).item()
        print(f"mixtral {method} 4-bit g32: relative logit error {errors[method]:.3f}")
    assert errors["gptq"] < errors["rtn"]


def test_experts_without_routed_tokens_fall_back_to_rtn(mixtral, tmp_path, caplog) -> None:
    """Calibration of 6 tokens: experts no token was routed to are rounded to nearest (the very codes
    `--method rtn` writes), named in a warning; the others are GPTQ's."""
    blocks = []
    with caplog.at_level(logging.WARNING, logger="llmopt.quant.pipeline"):
        quantize(mixtral, tmp_path / "gptq", method="gptq", bits=4, group_size=32, calib=_calib(tmp_path), nsamples=1,
                 seqlen=6, on_block=lambda block, total: blocks.append(block))  # fmt: skip
    tokens = {r.name.rpartition(".")[0]: r.details["routed_tokens"] for b in blocks for r in b.reports if ".experts." in r.name}
    unrouted = sorted(m for m, n in tokens.items() if n == 0)
    assert unrouted, tokens  # 6 tokens x 2 experts cannot reach all 8 experts of each layer
    warned = " ".join(r.getMessage() for r in caplog.records)
    for module in unrouted:
        layer, _, expert = module.removeprefix("model.layers.").partition(".")
        assert f"layer {layer} " in warned and expert in warned
    quantize(mixtral, tmp_path / "rtn", method="rtn", bits=4, group_size=32)
    with safe_open(str(tmp_path / "gptq" / "model.safetensors"), "pt") as g, \
            safe_open(str(tmp_path / "rtn" / "model.safetensors"), "pt") as r:  # fmt: skip
        for module, n in tokens.items():
            same = torch.equal(g.get_tensor(f"{module}.w1.qweight"), r.get_tensor(f"{module}.w1.qweight"))
            assert same == (n == 0), (module, n)


@pytest.mark.slow  # ~9 s: two conversions and a GPTQ pass
def test_gptq_onto_the_q4_k_m_grids_runs_in_llama_cpp(mixtral, tmp_path) -> None:
    """`convert --to gguf --method gptq`: each expert rounded by GPTQ onto its stack's type, the stacks
    packed from those codes; the file has Q4_K_M's types and llama.cpp's top-1 is ours."""
    from llmopt.api import convert_to_gguf
    from tests.formats.gguf.llama_cpp_helpers import assert_same_top1, gguf_types, llama_cpp_logits
    from tests.model.test_mixtral import ids

    plain, out = tmp_path / "rtn.gguf", tmp_path / "gptq.gguf"
    convert_to_gguf(mixtral, plain, "Q4_K_M")
    convert_to_gguf(mixtral, out, "Q4_K_M", method="gptq", calib=_calib(tmp_path), nsamples=8, seqlen=64)
    assert gguf_types(out) == gguf_types(plain)  # (the header differs: it names the method)
    x = ids(40)
    with open_model(out) as src, torch.no_grad():
        ours = Decoder.from_source(src)(x)[0]
    theirs = llama_cpp_logits(out, x[0].tolist())
    # llama.cpp rounds the activations to Q8_K for Q4_K/Q6_K dot products: 0.0163 measured on an AMD EPYC,
    # 0.0336 on an Intel Xeon (AVX512-VNNI), hence atol 0.05; there 11 of the 40 positions are clear of a
    # near-tie at 4x that difference, so a quarter must be
    assert_same_top1(ours, theirs, "mixtral GPTQ Q4_K_M", atol=0.05, min_clear=0.25)


def test_gptaq_is_refused_for_experts_with_a_one_line_error(mixtral, tmp_path) -> None:
    """GPTAQ needs each stage's inputs in the full-precision model, which routes tokens differently:
    refused before any work (AWQ and GPTQ run: tests/quant/test_awq_moe.py, above)."""
    from llmopt.errors import OptionError

    with pytest.raises(OptionError, match="mixture-of-experts"):
        quantize(mixtral, tmp_path / "g", method="gptq", gptaq=0.25, bits=4, group_size=32, calib=_calib(tmp_path),
                 nsamples=2, seqlen=16)  # fmt: skip
    assert not (tmp_path / "g").exists()
