"""Tokenizers rebuilt from GGUF metadata encode like the original and like transformers' reader."""

import pytest
import transformers

from llmopt.model import open_model

TEXTS = ["The quick brown fox jumps over the lazy dog.", "  leading spaces and\nnew lines\n\n", "quartz 0123 vow!!"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_tokenizer_matches_hf_original(tiny_models, tiny_ggufs, family):
    with open_model(tiny_models(family)) as hf, open_model(tiny_ggufs(family)) as gg:
        for text in TEXTS:
            assert gg.tokenizer().encode(text) == hf.tokenizer().encode(text)
        assert gg.tokenizer().tokenizer.decode(gg.tokenizer().encode(TEXTS[1])) == TEXTS[1]


def test_gguf_tokenizer_matches_transformers_gguf_reader(tiny_ggufs):
    path = tiny_ggufs("llama")
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with open_model(path) as gg:
        for text in TEXTS + ["<|im_start|>user\nhello<|im_end|>"]:
            assert gg.tokenizer().encode(text) == ref(text).input_ids


def test_sentencepiece_gguf_tokenizer(tmp_path):
    """A SentencePiece vocabulary (tokenizer.ggml.model = llama) against transformers' reader."""
    import gguf
    import numpy as np

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    words = ["▁", "t", "h", "e", "▁t", "he", "▁the", "c", "a", "▁c", "at", "▁cat", "s", "▁s", "at s"]
    words = [w for w in words if " " not in w]
    pieces += words
    scores = [0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(len(words))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in dict(context_length=64, embedding_length=8, block_count=1, feed_forward_length=16,
                           head_count=2, head_count_kv=2, layer_norm_rms_eps=1e-5).items():
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    rng = np.random.default_rng(0)
    for name, shape in [("token_embd.weight", (len(pieces), 8)), ("output_norm.weight", (8,)),
                        ("blk.0.attn_norm.weight", (8,)), ("blk.0.ffn_norm.weight", (8,)),
                        ("blk.0.attn_q.weight", (8, 8)), ("blk.0.attn_k.weight", (8, 8)),
                        ("blk.0.attn_v.weight", (8, 8)), ("blk.0.attn_output.weight", (8, 8)),
                        ("blk.0.ffn_gate.weight", (16, 8)), ("blk.0.ffn_up.weight", (16, 8)),
                        ("blk.0.ffn_down.weight", (8, 16))]:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    with open_model(path) as gg:
        tok = gg.tokenizer()
        assert tok.kind == "sentencepiece"
        for text in ["the cat", "the cats sat", "thé ca"]:
            assert tok.encode(text) == ref(text).input_ids, text
