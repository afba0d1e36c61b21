"""Qwen2-MoE's importance matrix, Mixtral's path unchanged: each expert stack (ffn_*_exps) has a row of
Σx² and a count per expert over the tokens routed to that expert; the shared expert (ffn_*_shexp) is
a plain entry over every token; llama.cpp's quantizer, given the file, quantizes as our writer does."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmopt.api import convert_to_gguf
from llmopt.calibration.imatrix import compute_imatrix
from llmopt.formats.imatrix import read_imatrix, write_imatrix
from llmopt.model import open_model
from tests.formats.gguf.llama_cpp_helpers import llama_quantize
from tests.model.test_qwen2moe import EXPERTS, PER_TOKEN, ids, make_tiny_qwen2moe, reference


def test_expert_entries_are_transformers_routed_activations(tmp_path) -> None:
    """Σx² of each expert's input equals transformers' MoE input summed over the tokens its router sent
    to that expert, the counts those tokens; the shared expert's entries count every token."""
    path = make_tiny_qwen2moe(tmp_path / "m")
    chunks = ids(64, seed=11).view(2, 32)
    with open_model(path) as src:
        ours = compute_imatrix(src, chunks)
    ref = reference(path)
    seen = []
    moe = ref.model.layers[1].mlp
    moe.register_forward_pre_hook(lambda m, args: seen.append(["x", args[0].reshape(-1, args[0].shape[-1])]))
    moe.gate.register_forward_hook(lambda m, args, out: seen[-1].append(out[2]))  # (logits, scores, chosen experts)
    down_in = []
    moe.shared_expert.down_proj.register_forward_pre_hook(lambda m, args: down_in.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        for row in chunks:
            ref(row[None])
    hidden = ref.config.hidden_size
    sums, counts = torch.zeros(EXPERTS, hidden, dtype=torch.float64), torch.zeros(EXPERTS, dtype=torch.int64)
    for _, x, chosen in seen:
        for e in range(EXPERTS):
            rows = (chosen == e).any(-1)
            sums[e] += (x[rows].double() ** 2).sum(0)
            counts[e] += int(rows.sum())
    name = "blk.1.ffn_up_exps.weight"
    assert ours.sums[name].shape == (EXPERTS, hidden) and torch.equal(ours.counts[name], counts)
    assert int(ours.counts[name].sum()) == 64 * PER_TOKEN and int((counts > 0).sum()) > 2 * PER_TOKEN
    assert torch.allclose(ours.sums[name], sums, rtol=1e-4, atol=1e-6)
    assert ours.sums["blk.1.ffn_down_exps.weight"].shape == (EXPERTS, 256)
    shared = torch.cat([x for _, x, _ in seen]).double()
    assert ours.counts["blk.1.ffn_up_shexp.weight"] == 64
    assert torch.allclose(ours.sums["blk.1.ffn_up_shexp.weight"], (shared**2).sum(0), rtol=1e-4, atol=1e-6)
    assert torch.allclose(ours.sums["blk.1.ffn_down_shexp.weight"], (torch.cat(down_in).double() ** 2).sum(0), rtol=1e-4, atol=1e-6)
    write_imatrix(ours, tmp_path / "m.imatrix.gguf")
    back = read_imatrix(tmp_path / "m.imatrix.gguf")
    assert torch.equal(back.counts[name], counts) and torch.allclose(back.sums[name], ours.sums[name].float().double())


@pytest.mark.slow  # ~7 s: our imatrix-weighted K-quant search over 60 experts' rows
def test_imatrix_weighted_q4_k_m_equals_llama_quantize(tmp_path) -> None:
    """Our Q4_K_M of our F16 file (one layer) with our imatrix is, tensor for tensor, what
    llama_model_quantize writes from that file with the same imatrix (each expert with its own row of
    the stack); without the imatrix the expert stacks come out different."""
    path = make_tiny_qwen2moe(tmp_path / "m", layers=1)
    with open_model(path) as src:
        imatrix = compute_imatrix(src, ids(64, seed=2).view(2, 32))
    write_imatrix(imatrix, tmp_path / "m.imatrix.gguf")
    f16, ours = tmp_path / "f16.gguf", tmp_path / "ours.gguf"
    convert_to_gguf(path, f16, "F16")
    convert_to_gguf(f16, ours, "Q4_K_M", imatrix=str(tmp_path / "m.imatrix.gguf"))
    values = {name: np.asarray(v.reshape(-1)) for name, v in read_imatrix(tmp_path / "m.imatrix.gguf").importance().items()}
    theirs = llama_quantize(f16, tmp_path / "theirs.gguf", "Q4_K_M", imatrix=values)
    a = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    b = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
    assert set(a) == set(b)
    for n in a:  # (bytes, not shapes: llama.cpp stores the [hidden, 1] shared-expert gate with ggml_n_dims, as 1-D)
        assert a[n].tensor_type == b[n].tensor_type, n
        assert np.array_equal(np.asarray(a[n].data).reshape(-1), np.asarray(b[n].data).reshape(-1)), n
    plain = convert_to_gguf(f16, tmp_path / "plain.gguf", "Q4_K_M")["output"]
    stacks = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(plain).tensors if "_exps" in t.name}
    weighted = {n: np.asarray(t.data) for n, t in a.items() if "_exps" in n}
    assert all(not np.array_equal(stacks[n], weighted[n]) for n in stacks)
