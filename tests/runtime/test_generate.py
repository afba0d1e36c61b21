"""The generation loop on tiny models: caching, chunked prefill, stopping, seeding, streaming."""

import pytest
import torch

from llmopt.errors import InputError
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.runtime.generate import Generator
from llmopt.model.kv_cache import StaticKVCache
from llmopt.runtime.sampling import SamplingConfig
from llmopt.runtime.stream import TextStream


@pytest.fixture(scope="module")
def tiny(tiny_models):
    with open_model(tiny_models("mistral")) as src:
        return Decoder.from_source(src), src.tokenizer()


def greedy_without_cache(model, ids, n):
    """The definition: re-run the whole sequence for every new token."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[-n:]


def test_cached_greedy_equals_full_recompute(tiny):
    model, tok = tiny
    ids = tok.encode("In the beginning the universe")
    result = Generator(model, tok, prefill_chunk=4).generate(ids, 25, ignore_eos=True)
    assert result.token_ids == greedy_without_cache(model, ids, 25)
    assert result.metrics.generated_tokens == 25 and result.metrics.stop_reason == "max_tokens"


def test_generation_uses_the_cache_factory_it_is_given(tiny):
    """The runtime builds no cache itself: a factory (here a recording one) provides each generation's."""
    model, tok = tiny
    made = []

    def factory(arch, max_len, batch, dtype, device):
        made.append((max_len, batch, dtype))
        return StaticKVCache(arch, max_len, batch, dtype, device)

    ids = tok.encode("In the beginning the universe")
    result = Generator(model, tok, cache_factory=factory).generate(ids, 10, ignore_eos=True)
    assert made == [(len(ids) + 10 + 1, 1, torch.float32)]
    assert result.token_ids == greedy_without_cache(model, ids, 10)


def test_chunked_prefill_equals_one_pass(tiny):
    model, tok = tiny
    ids = torch.tensor(tok.encode("Sphinx of black quartz, judge my vow. " * 3))
    one = Generator(model, tok, prefill_chunk=1024).prefill(ids, StaticKVCache(model.arch, 200))
    chunked = Generator(model, tok, prefill_chunk=7).prefill(ids, StaticKVCache(model.arch, 200))
    assert torch.allclose(one, chunked, atol=1e-5)


def test_kv_cache_truncate_then_overwrite(tiny):
    model, _ = tiny
    cache = StaticKVCache(model.arch, 16)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8]]), 0, cache)
        cache.truncate(2)
        assert cache.length == 2
        rolled = model(torch.tensor([[9]]), 2, cache)[0, -1]
        fresh = model(torch.tensor([[5, 6, 9]]))[0, -1]
    assert torch.allclose(rolled, fresh, atol=1e-5)
    with pytest.raises(InputError, match="does not fit"):
        cache.update(0, torch.zeros(1, model.arch.num_kv_heads, 20, model.arch.head_dim), None, 0)


def test_same_seed_same_text_different_seed_differs(tiny):
    model, tok = tiny
    ids = tok.encode("The quick")
    cfg = SamplingConfig(temperature=1.5)
    runs = [Generator(model, tok).generate(ids, 20, cfg, seed=s, ignore_eos=True).token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]


def test_stops_at_eos_and_leaves_it_out(tiny):
    model, tok = tiny
    ids = tok.encode("The quick")
    free = Generator(model, tok).generate(ids, 10, ignore_eos=True).token_ids
    eos = free[3]
    result = Generator(model, tok, eos={eos}).generate(ids, 10)
    assert result.token_ids == free[:free.index(eos)]
    assert result.metrics.stop_reason == "eos"


def test_stop_string_cuts_text_and_stream_agrees(tiny):
    model, tok = tiny
    ids = tok.encode("The quick")
    full = Generator(model, tok).generate(ids, 30, ignore_eos=True).text
    stop = full[10:13]
    pieces = []
    result = Generator(model, tok).generate(ids, 30, stop=[stop], ignore_eos=True, on_text=pieces.append)
    assert result.metrics.stop_reason == "stop"
    assert result.text == full[:full.index(stop)]
    assert "".join(pieces) == result.text


def test_text_stream_holds_back_partial_characters_and_stop_prefixes(tiny):
    _, tok = tiny
    ids = tok.tokenizer.encode("héllo wörld", add_special_tokens=False).ids
    stream = TextStream(tok, stop=["wör"])
    out = "".join(stream.push(t) for t in ids) + stream.finish()
    assert out == "héllo " and stream.stopped
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == "héllo wörld" and all("\ufffd" not in p for p in pieces)


def test_empty_prompt_is_an_input_error(tiny):
    model, tok = tiny
    with pytest.raises(InputError, match="empty"):
        Generator(model, tok).generate([], 5)


def test_sliding_window_decode_equals_full_recompute(tiny_models, tmp_path):
    """Mistral-style sliding window: cached decode masks the same keys as a full forward."""
    import json
    import shutil

    path = tmp_path / "windowed"
    shutil.copytree(tiny_models("mistral"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = 5
    (path / "config.json").write_text(json.dumps(cfg))
    with open_model(path) as src:
        model, tok = Decoder.from_source(src), src.tokenizer()
    assert model.arch.sliding_window == 5
    ids = tok.encode("Sphinx of black quartz, judge my vow.")
    assert Generator(model, tok, prefill_chunk=3).generate(ids, 12, ignore_eos=True).token_ids == greedy_without_cache(model, ids, 12)


@pytest.mark.parametrize("onednn", [False, True])
def test_row_major_layout_gives_same_logits(tiny_models, onednn: bool):
    """The CPU decode layouts (x @ W^T with W^T stored; oneDNN's reordered weight, the tied head kept
    in slabs) are the same function as nn.Linear, for one row and for a batch."""
    import torch

    from llmopt.model import open_model
    from llmopt.model.decoder import Decoder
    from llmopt.runtime.row_major import OneDNNLinear, RowMajorLinear, TiedEmbedding, onednn_packs, use_row_major_linears

    if onednn and not onednn_packs(torch.float32):
        pytest.fail("this torch has no oneDNN: the runtime would fall back to RowMajorLinear")
    kind = OneDNNLinear if onednn else RowMajorLinear
    for family, tie in (("qwen2", True), ("llama", False)):
        for width in (6144, 64):  # 64: the head (and wider linears) split into slabs
            with open_model(tiny_models(family, tie)) as src:
                plain = Decoder.from_source(src)
                fast = use_row_major_linears(Decoder.from_source(src), width, onednn=onednn)
            assert isinstance(fast.layers[0].self_attn.qkv, kind)  # q/k/v fused
            assert isinstance(fast.layers[0].mlp.gate_up, kind) and not hasattr(fast.layers[0].mlp, "up_proj")
            assert isinstance(fast.embed_tokens, TiedEmbedding) == tie
            assert isinstance(fast.lm_head, RowMajorLinear if tie or not onednn else OneDNNLinear)
            if isinstance(fast.lm_head, RowMajorLinear):
                assert (fast.lm_head.weight_t.shape[0] > 1) == (width == 64)
            for batch in (1, 3):
                ids = torch.randint(0, 300, (batch, 17), generator=torch.Generator().manual_seed(3))
                with torch.no_grad():
                    assert (plain(ids) - fast(ids)).abs().max().item() < 1e-5


def test_row_major_slabs_pad_an_output_count_with_no_even_split():
    """97 outputs (prime) in slabs of at most 10: the last slab is padded, the result is the same."""
    import torch

    from llmopt.runtime.row_major import RowMajorLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 97, bias=True)
    fast = RowMajorLinear(linear, width=10)
    assert fast.weight_t.shape == (10, 16, 10)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert (fast(x) - linear(x)).abs().max().item() < 1e-5
        ids = torch.tensor([[0, 9, 10, 96]])
        assert torch.equal(fast.column(ids), linear.weight[ids])


def test_contiguous_weights_give_same_logits(tiny_models):
    """arena.py: every float weight moves into one block (tied weights stay one tensor); same function."""
    import torch

    from llmopt.model import open_model
    from llmopt.model.decoder import Decoder
    from llmopt.runtime.arena import pack_contiguously
    from llmopt.runtime.row_major import use_row_major_linears

    for family, tie in (("qwen2", True), ("llama", False)):
        with open_model(tiny_models(family, tie)) as src:
            plain = Decoder.from_source(src)
            fast = use_row_major_linears(Decoder.from_source(src))
        nbytes = pack_contiguously(fast)
        storages = {p.untyped_storage().data_ptr() for p in fast.parameters()}
        assert len(storages) == 1 and nbytes >= sum(p.nbytes for p in fast.parameters())
        ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            assert (plain(ids) - fast(ids)).abs().max().item() < 1e-5


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_loading_a_model_does_not_import_dynamo(tiny_models, tmp_path, fmt):
    """A load builds the model on the meta device; a meta tensor's first arithmetic (a random init, the
    rotary frequencies) imports torch._dynamo, a second of every `generate`'s start. Checked in a fresh
    process, as a user's run starts."""
    import subprocess
    import sys

    path = tiny_models("llama")
    if fmt == "gguf":
        from llmopt.api.convert import convert_to_gguf

        path = convert_to_gguf(path, tmp_path / "m.gguf", "Q4_K_M")["output"]
    code = ("import sys; from llmopt.runtime.weights import load_model; "
            f"load_model({str(path)!r}, quantized=False); print('torch._dynamo' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
