"""Gemma 3's tokenizer rebuilt from GGUF metadata (tokenizer.ggml.model "llama": SentencePiece pieces,
scores and token types) gives llama.cpp's ids on the same file.

No Gemma tokenizer is available offline, so the test trains a small SentencePiece BPE with Gemma's
trainer settings (byte fallback, digits split, no dummy prefix, whitespace kept and allowed as
pieces; ids 0-3 pad/eos/bos/unk; <start_of_turn>/<end_of_turn> as whole tokens) and writes it as
Gemma's tokenizer.json lays it out (BPE with byte fallback, " " -> "▁", no prefix space)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from llmopt.api import convert_to_gguf
from llmopt.model import open_model
from tests.factories import CORPUS, perturb_norms
from tests.model.test_gemma3 import gemma3_config

TURNS = ("<start_of_turn>", "<end_of_turn>")
# Gemma's turn format (its chat template's output for a conversation), written here as a template
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                 "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_TRAINING = CORPUS + ("def add(a, b):\n    return a + b\n\nclass Foo:\n    pass\n" * 5
                      + "東京は日本の首都です。 Привет, как дела? 12345 67890 " * 10 + "a  b   c    d\t\te\n\n\nf " * 5)
TEXTS = {
    "digits": "In 2024 there were 1234567 runs, 3.14159 each, 42 and 007.",
    "code": "def add(a, b):\n    return a + b  # sum\n\nprint(add(2, 3))",
    "chat": "<bos><start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>model\nHi.<end_of_turn>\n",
    "non-latin": "東京は日本の首都です。 Привет, мир! Ελληνικά",
    "whitespace": "a  b   c    d\t\te\n\n\nf      g \u3000 end   ",
}


def make_gemma_tokenizer(directory: Path) -> int:
    """Train the SentencePiece model and save it as an HF tokenizer; returns the vocabulary size."""
    import sentencepiece as spm
    from tokenizers import AddedToken, pre_tokenizers

    from llmopt.model.tokenizer import _sentencepiece_bpe

    directory.mkdir(parents=True, exist_ok=True)
    lines = [line for line in _TRAINING.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(directory / "spm"), vocab_size=400, model_type="bpe",
        byte_fallback=True, split_digits=True, add_dummy_prefix=False, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, normalization_rule_name="identity", character_coverage=1.0,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", user_defined_symbols=list(TURNS), minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=str(directory / "spm.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(len(pieces))]
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1 for i in range(len(pieces))]
    tok = _sentencepiece_bpe(pieces, scores, types, add_space_prefix=False)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")  # Gemma's tokenizer.json
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<eos>", "<bos>", *TURNS)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
        "pad_token": "<pad>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
    }))
    return len(pieces)


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gemma3tok") / "g"
    vocab = make_gemma_tokenizer(directory)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(gemma3_config(vocab, layers=1, bos_token_id=2, eos_token_id=1))
    perturb_norms(model)
    model.save_pretrained(directory)
    out = directory.parent / "g.gguf"
    convert_to_gguf(directory, out, "F16")
    return out


@pytest.mark.parametrize("kind", list(TEXTS))
def test_gguf_tokenizer_gives_llama_cpps_ids(gemma3_gguf, kind: str) -> None:
    from llama_cpp import Llama

    text = TEXTS[kind]
    llm = Llama(model_path=str(gemma3_gguf), vocab_only=True, verbose=False)
    theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
    with open_model(gemma3_gguf) as src:
        tok = src.tokenizer()
        assert tok is not None and tok.kind == "sentencepiece" and tok.add_bos
        ours = tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert ours == theirs, (kind, ours, theirs)
    assert len(theirs) >= 8


def test_gguf_keeps_gemmas_vocabulary_conventions(gemma3_gguf) -> None:
    """The file says what llama.cpp's converter says for Gemma: sentencepiece ("llama"), no space
    prefix, BOS added, ids 2/1/0 for bos/eos/pad, the turn tokens whole, the chat template kept."""
    import gguf

    fields = gguf.GGUFReader(str(gemma3_gguf)).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
    assert fields["tokenizer.ggml.add_bos_token"].contents() is True
    assert [fields[f"tokenizer.ggml.{k}_token_id"].contents() for k in ("bos", "eos", "padding")] == [2, 1, 0]
    with open_model(gemma3_gguf) as src:
        tok = src.tokenizer()
        assert tok.chat_template == CHAT_TEMPLATE
        assert tok.encode("<start_of_turn>user")[:2] == [2, tok.token_id("<start_of_turn>")]
