"""Phi-3, the first family whose files fuse linears (llmopt/model/families/phi3.py): readers split
qkv_proj / gate_up_proj into the Llama block's linears, writers stack them again.

The random model has microsoft/Phi-3-mini-4k-instruct's published config scaled down in layers and
width: head_dim 96, as many KV heads as query heads (no GQA), SwiGLU 8/3 wide, rope base 1e4,
sliding window 2047; the longrope variant takes Phi-3-mini-128k-instruct's rope_scaling form (48
short and long factors, original context 4096, here a 4x extension).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from llmopt.errors import InputError
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.model.rope import attention_factor
from tests.factories import make_tokenizer, perturb_norms

HEAD_DIM = 96


def longrope_scaling(seed: int = 1) -> dict:
    """Phi-3-mini-128k's rope_scaling shape: per-frequency factors >= 1, the long ones larger."""
    g = torch.Generator().manual_seed(seed)
    short = 1.0 + torch.rand(HEAD_DIM // 2, generator=g) * 0.1
    long = short + torch.linspace(0.0, 40.0, HEAD_DIM // 2)
    return {"type": "longrope", "short_factor": [round(v, 4) for v in short.tolist()],
            "long_factor": [round(v, 4) for v in long.tolist()]}


def _phi3_tokenizer(directory: Path):  # noqa: ANN202 - a tokenizers.Tokenizer
    """The tests' BPE with Phi-3's special tokens (llama.cpp marks <unk>, <s>, </s> by name in
    models it sees as Phi-3, and refuses a vocabulary without them)."""
    make_tokenizer(directory)
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>", "<|end|>", "<|user|>", "<|assistant|>")])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|end|>",
        "unk_token": "<unk>", "pad_token": "<|endoftext|>", "add_bos_token": False,
    }))
    return tok


def make_tiny_phi3(directory: Path, longrope: bool = False, layers: int = 2, heads: int = 8, seed: int = 0,
                   original: int = 4096) -> Path:
    """A random Phi-3 saved by transformers (fused qkv_proj / gate_up_proj), with a BPE tokenizer;
    `original` is the context before longrope's 4x extension."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = _phi3_tokenizer(directory)
    hidden = heads * HEAD_DIM
    config = transformers.Phi3Config(
        hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 256 * 256, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=tok.get_vocab_size(),
        max_position_embeddings=4 * original if longrope else original, original_max_position_embeddings=original,
        rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=2047, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("<|end|>"), pad_token_id=0, hidden_act="silu",
        rope_scaling=longrope_scaling() if longrope else None,
    )
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(config)
    perturb_norms(model)
    model.save_pretrained(directory)
    return directory


def ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def _reference(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("longrope", [False, True], ids=["plain", "longrope"])
def test_logits_match_transformers(tmp_path, longrope: bool) -> None:
    path = make_tiny_phi3(tmp_path / "phi3", longrope=longrope)
    stored = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"] \
        if (path / "model.safetensors.index.json").exists() else None  # fmt: skip
    x = ids(40)
    with open_model(path) as src, torch.no_grad():
        arch = src.arch
        assert arch.family.name == "phi3" and stored is None
        assert "model.layers.0.self_attn.qkv_proj.weight" not in src.tensors  # read split into the Llama block
        assert src.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (arch.num_kv_heads * HEAD_DIM, arch.hidden_size)
        assert src.tensors["model.layers.1.mlp.up_proj.weight"].shape == (arch.intermediate_size, arch.hidden_size)
        assert (attention_factor(arch) > 1.0) == longrope
        ours = Decoder.from_source(src)(x)
    diff = (ours - _reference(path)(x).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_split_tensors_are_the_fused_rows(tmp_path) -> None:
    """q/k/v and gate/up are exactly the rows transformers' fused linears hold, in that order."""
    path = make_tiny_phi3(tmp_path / "phi3")
    ref = _reference(path)
    with open_model(path) as src:
        qkv = ref.model.layers[1].self_attn.qkv_proj.weight
        names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
        assert torch.equal(torch.cat([src.load(n) for n in names]), qkv)
        gate_up = ref.model.layers[0].mlp.gate_up_proj.weight
        assert torch.equal(src.load("model.layers.0.mlp.gate_proj.weight"), gate_up[: gate_up.shape[0] // 2])
        assert torch.equal(src.load_stored("model.layers.0.mlp.gate_up_proj.weight"), gate_up)
        assert src.parameter_count == sum(p.numel() for p in ref.parameters())


def test_fused_tensor_of_the_wrong_height_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = make_tiny_phi3(tmp_path / "phi3", layers=1)
    weights = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-HEAD_DIM].contiguous()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match="qkv_proj.weight is"):
        open_model(path)


def test_greedy_generation_matches_transformers_under_longrope(tmp_path) -> None:
    """The runtime's model (row-major linears, q/k/v and gate/up fused again for speed) has
    transformers' logits, and its generation loop (KV cache, decode steps at later positions)
    continues a prompt with transformers' greedy tokens."""
    from llmopt.api import generate
    from llmopt.runtime.weights import load_model

    path = make_tiny_phi3(tmp_path / "phi3", longrope=True)
    prompt = "The quick brown fox jumps over"
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = torch.tensor([hf_tok(prompt, add_special_tokens=False)["input_ids"]])
    ref = _reference(path).generate(prompt_ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    ours = generate(str(path), prompt, max_tokens=16, ignore_eos=True, dtype="float32", device="cpu")
    assert ours.token_ids == ref[0, prompt_ids.shape[1]:].tolist()
    with torch.no_grad():
        runtime = load_model(str(path), "float32", "cpu").model(ref)
        diff = (runtime - _reference(path)(ref).logits).abs().max().item()
    assert diff < 1e-4, diff


SHORT_CONTEXT = 64  # a Phi-3-mini-128k-style config whose original context a test prompt passes


def test_longrope_past_the_original_context_matches_transformers(tmp_path) -> None:
    """100 tokens past an original context of 64: transformers takes the long factors for the whole
    forward (and the attention factor of the 4x extension); so do we. Within the context, the short."""
    path = make_tiny_phi3(tmp_path / "phi3", longrope=True, original=SHORT_CONTEXT)
    ref = _reference(path)
    with open_model(path) as src, torch.no_grad():
        model = Decoder.from_source(src)
        for n in (SHORT_CONTEXT, 100):
            x = ids(n, seed=n)
            diff = (model(x) - ref(x).logits).abs().max().item()
            assert diff < 1e-4, (n, diff)
        short, long = model.rotary(0, SHORT_CONTEXT, torch.float32), model.rotary(0, SHORT_CONTEXT, torch.float32, reach=100)
        assert (short[0][1:] - long[0][1:]).abs().amax(-1).min() > 0  # the tables differ at every position but 0


@pytest.mark.parametrize("prompt_len", [40, 80], ids=["crossed-while-decoding", "crossed-by-the-prompt"])
def test_greedy_generation_past_the_original_context_matches_transformers(tmp_path, prompt_len: int) -> None:
    """transformers picks the factors per forward (a prompt past the original context takes the long
    ones for all its positions) and its Phi-3 generation recomputes the cache at the first step past
    it, so every later token sees the whole sequence under the long factors. Our loop does the same,
    also when the prompt runs in chunks (each chunk takes the whole prompt's table) and in the
    fixed-shape decode step (each position's row from the table its step uses)."""
    from llmopt.model.kv_cache import StaticKVCache
    from llmopt.runtime.compiled import StaticDecodeStep
    from llmopt.runtime.generate import Generator
    from llmopt.runtime.speculative import PromptLookup

    path = make_tiny_phi3(tmp_path / "phi3", longrope=True, original=SHORT_CONTEXT)
    prompt = ids(prompt_len, seed=11)
    ref = _reference(path).generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False)[0].tolist()
    with open_model(path) as src:
        model = Decoder.from_source(src)
    ours = Generator(model, eos=set(), prefill_chunk=32).generate(prompt[0].tolist(), max_tokens=40, ignore_eos=True)
    assert ours.token_ids == ref[prompt_len:]
    lookup = Generator(model, eos=set(), drafter=PromptLookup(2), num_draft=4).generate(prompt[0].tolist(), max_tokens=40, ignore_eos=True)
    assert lookup.token_ids == ours.token_ids  # speculative decoding keeps the plain loop's tokens over the switch
    cache = StaticKVCache(model.arch, 128)
    step = StaticDecodeStep(model, cache)
    x = torch.tensor([ref])
    with torch.no_grad():
        model.hidden(x[:, :prompt_len], 0, cache)  # the prompt in one forward, as transformers runs it
        for pos in range(prompt_len, len(ref) - 1):
            if pos == SHORT_CONTEXT:  # the first step past the context: the keys again, long (as Generator does)
                model.hidden(x[:, :pos], 0, cache, model.rotary(0, pos, torch.float32, reach=pos + 1))
            got = step(x[0, pos:pos + 1], torch.tensor([pos]))
            assert got.argmax().item() == ref[pos + 1], pos
