"""Reading models: HF directories and GGUF files give the same architecture and tensors."""

import json

import pytest
import torch

from llmopt.errors import InputError
from llmopt.model import open_model
from llmopt.model.families.base import permute_for_gguf, unpermute_from_gguf
from tests.factories import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_dir_reads_architecture(tiny_models, family):
    hidden, head_dim = (128, 64) if family == "qwen3" else (64, 16)  # Qwen3's head size is its own
    with open_model(tiny_models(family)) as src:
        a = src.arch
        assert (a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == (hidden, 2, 4, 2, head_dim)
        assert a.family.name == family
        assert a.attention_bias == (family == "qwen2")
        assert "model.layers.0.self_attn.q_proj.weight" in src.tensors
        assert src.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * head_dim, hidden)
        assert src.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * head_dim, hidden)
        assert ("model.layers.0.self_attn.q_norm.weight" in src.tensors) == (family == "qwen3")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q8_0"])
def test_gguf_tensors_equal_hf_tensors(tiny_models, tiny_ggufs, family, tensor_type):
    """A GGUF in llama.cpp's layout (Q/K permuted for llama) reads back as the HF weights."""
    tol = {"F32": 0, "F16": 1e-3, "Q8_0": 2e-2}[tensor_type]
    with open_model(tiny_models(family)) as hf, open_model(tiny_ggufs(family, tensor_type)) as gg:
        assert hf.arch == gg.arch or (family == "mistral" and gg.arch.family.name == "llama")
        assert set(hf.tensors) == set(gg.tensors)
        assert hf.parameter_count == gg.parameter_count
        for name in hf.tensors:
            a, b = hf.load(name), gg.load(name)
            assert a.shape == b.shape, name
            assert (a - b).abs().max().item() <= tol * max(1.0, a.abs().max().item()), name


def test_permutation_round_trip():
    w = torch.randn(96, 8)
    assert torch.equal(unpermute_from_gguf(permute_for_gguf(w, 3), 3), w)
    assert not torch.equal(permute_for_gguf(w, 3), w)


def test_sharded_directory(tiny_models, tmp_path):
    from llmopt.formats.hf import write_hf_dir

    with open_model(tiny_models("llama")) as src:
        out = write_hf_dir(src, tmp_path / "sharded", dtype="float32", max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((out / s).is_file() for s in shards)
    with open_model(out) as resharded, open_model(tiny_models("llama")) as original:
        for name in original.tensors:
            assert torch.equal(resharded.load(name), original.load(name))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(InputError, match="unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM"):
        open_model(tmp_path)


def test_hub_id_offline_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(InputError, match="not in the cache"):
        open_model("nobody-here/no-such-model")


def test_relative_path_under_existing_folder_is_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "build").mkdir()
    with pytest.raises(InputError, match="build/missing: no such file or directory"):
        open_model("build/missing")


def test_fast_header_reader_agrees_with_gguf_package(smollm2_gguf):
    """Our numpy-backed header parser against the gguf package's GGUFReader on the real file."""
    import gguf
    import numpy as np

    from llmopt.model.gguf_header import read_gguf

    header = read_gguf(smollm2_gguf)
    meta, tensors = header.metadata, header.tensors
    ref = gguf.GGUFReader(smollm2_gguf)
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert meta == ref_meta
    assert [t.name for t in tensors] == [t.name for t in ref.tensors]
    for ours, theirs in zip(tensors, ref.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.n_bytes == theirs.n_bytes
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert np.array_equal(np.asarray(ours.data).view(np.uint8), np.asarray(theirs.data).view(np.uint8))
