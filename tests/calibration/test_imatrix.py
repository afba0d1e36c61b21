"""The importance matrix: llama.cpp's definition (mean x² of each linear's input), its two file formats."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmopt.calibration.imatrix import Imatrix, chunk_tokens, compute_imatrix
from llmopt.formats.imatrix import read_imatrix, write_imatrix
from llmopt.errors import InputError
from llmopt.model import open_model


def test_definition_matches_transformers_hooks(tiny_models) -> None:
    """Σx²/count of every linear's input, checked against hooks on the transformers model."""
    import transformers

    for family in ("llama", "qwen2"):
        path = tiny_models(family)
        tokens = torch.randint(0, 300, (3, 24), generator=torch.Generator().manual_seed(0))
        with open_model(path) as src:
            ours = compute_imatrix(src, tokens).importance()
            names = {src.arch.family.hf_to_gguf_name(n): n for n in src.tensors}
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        seen: dict[str, list[torch.Tensor]] = {}
        hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, []).append(args[0]))
                 for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in name]
        with torch.no_grad():
            model(tokens)
        for h in hooks:
            h.remove()
        assert len(ours) == 7 * model.config.num_hidden_layers
        for gguf_name, values in ours.items():
            x = torch.cat(seen[names[gguf_name].removesuffix(".weight")]).reshape(-1, values.numel()).double()
            assert torch.allclose(values.double(), (x * x).mean(0), rtol=1e-4, atol=1e-7), gguf_name


def sample() -> Imatrix:
    g = torch.Generator().manual_seed(0)
    return Imatrix(sums={"blk.0.attn_q.weight": torch.rand(64, generator=g, dtype=torch.float64) * 100,
                         "blk.0.ffn_down.weight": torch.rand(128, generator=g, dtype=torch.float64) * 10},
                   counts={"blk.0.attn_q.weight": 1024, "blk.0.ffn_down.weight": 1024},
                   datasets=["wiki.valid.txt"], chunk_count=2, chunk_size=512)


def test_gguf_format_is_llama_cpps(tmp_path: Path) -> None:
    path = write_imatrix(sample(), tmp_path / "im.gguf")
    reader = gguf.GGUFReader(str(path))
    f = reader.fields
    assert f["general.type"].contents() == "imatrix"
    assert f["imatrix.datasets"].contents() == ["wiki.valid.txt"]
    assert f["imatrix.chunk_count"].contents() == 2 and f["imatrix.chunk_size"].contents() == 512
    t = {x.name: x for x in reader.tensors}
    assert list(t["blk.0.attn_q.weight.in_sum2"].shape) == [64, 1]  # ne0 = columns, ne1 = matrices
    assert list(t["blk.0.attn_q.weight.counts"].shape) == [1, 1]
    assert t["blk.0.attn_q.weight.counts"].data.reshape(-1)[0] == 1024
    back = read_imatrix(path)
    for name, value in sample().importance().items():
        assert torch.allclose(back.importance()[name], value)
    assert back.chunk_count == 2 and back.datasets == ["wiki.valid.txt"]


def test_legacy_dat_round_trip_and_layout(tmp_path: Path) -> None:
    path = write_imatrix(sample(), tmp_path / "im.dat", legacy_dat=True)
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<i", raw, 0)
    (length,) = struct.unpack_from("<i", raw, 4)
    assert n == 2 and raw[8 : 8 + length] == b"blk.0.attn_q.weight"
    ncall, nval = struct.unpack_from("<ii", raw, 8 + length)
    assert (ncall, nval) == (2, 64)  # ncall = ceil(tokens / chunk size); values are mean x² · ncall
    values = np.frombuffer(raw, dtype="<f4", count=nval, offset=16 + length)
    assert np.allclose(values / ncall, sample().importance()["blk.0.attn_q.weight"].numpy())
    back = read_imatrix(path)
    for name, value in sample().importance().items():
        assert torch.allclose(back.importance()[name], value)
    assert back.datasets == ["wiki.valid.txt"] and back.chunk_count == 2


def test_not_an_imatrix(tmp_path: Path) -> None:
    bad = tmp_path / "x.dat"
    bad.write_bytes(b"\x00\x00\x00\x00junk")
    with pytest.raises(InputError):
        read_imatrix(bad)
    with pytest.raises(InputError):
        read_imatrix(tmp_path / "missing.gguf")


def test_chunks_are_consecutive_with_bos() -> None:
    stream = torch.arange(100)
    chunks = chunk_tokens(stream, 16, 3, bos_id=7)
    assert chunks.shape == (3, 16) and chunks[1, 0] == 7 and chunks[1, 1] == 17
    assert chunk_tokens(stream, 16, None, None).shape == (6, 16)
    with pytest.raises(InputError):
        chunk_tokens(stream, 200, None, None)


def test_imatrix_over_self_written_samples(tiny_models, tmp_path: Path) -> None:
    """`imatrix --calib self` reads the samples `quantize --calib self --seed 0` takes: the file's sums
    are compute_imatrix's over exactly those tokens."""
    from llmopt.api.imatrix import imatrix
    from llmopt.calibration.self_text import generate_samples
    from llmopt.device import resolve_calib_dtype

    path = tiny_models("llama")
    summary = imatrix(path, "self", tmp_path / "im.gguf", chunks=3, ctx_size=20, device="cpu")
    assert summary["chunks"] == 3 and summary["chunk_size"] == 20
    with open_model(path) as src:
        tokens = generate_samples(src, 3, 20, seed=0, dtype=resolve_calib_dtype("auto", torch.device("cpu")))
        expected = compute_imatrix(src, tokens).importance()
    got = read_imatrix(tmp_path / "im.gguf").importance()
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(torch.as_tensor(got[name]), torch.as_tensor(expected[name]))
