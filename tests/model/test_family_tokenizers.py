"""The added families' tokenizers from GGUF metadata give llama.cpp's token ids on the five kinds of
text the families issue names (digits, code, a chat template, non-Latin script, whitespace runs).
The random Mixtral, Qwen2-MoE and Phi-3 carry the test suite's byte-level BPE (GGUF `gpt2`); the
check is that our GGUF's tokenizer block, read back by us and by llama.cpp, splits text the same way.
(Gemma 3's SentencePiece vocabulary: tests/model/test_gemma3_tokenizer.py; the Llama SentencePiece
path Mixtral and Phi-3 checkpoints really carry: tests/model/test_tokenizer.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmopt.api import convert_to_gguf
from llmopt.model import open_model
from tests.model.test_mixtral import make_tiny_mixtral
from tests.model.test_phi3 import make_tiny_phi3
from tests.model.test_qwen2moe import make_tiny_qwen2moe

TEXTS = {
    "digits": "In 2024 there were 1234567 runs, 3.14159 each, 42 and 007.",
    "code": "def add(a, b):\n    return a + b  # sum\n\nprint(add(2, 3))",
    "chat": "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>\n",
    "non-latin": "東京は日本の首都です。 Привет, мир! Ελληνικά",
    "whitespace": "a  b   c    d\t\te\n\n\nf      g \u3000 end   ",
}
MAKERS = {"mixtral": make_tiny_mixtral, "qwen2moe": make_tiny_qwen2moe, "phi3": make_tiny_phi3}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family, make in MAKERS.items():
        directory = tmp_path_factory.mktemp(family)
        out[family] = convert_to_gguf(make(directory / "hf", layers=1), directory / "m.gguf", "F16")["output"]
    return out


@pytest.mark.parametrize("kind", list(TEXTS))
@pytest.mark.parametrize("family", list(MAKERS))
def test_gguf_tokenizer_gives_llama_cpps_ids(ggufs, family: str, kind: str) -> None:
    from llama_cpp import Llama

    text = TEXTS[kind]
    llm = Llama(model_path=str(ggufs[family]), vocab_only=True, verbose=False)
    theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
    with open_model(ggufs[family]) as src:
        ours = src.tokenizer().encode(text)
    assert ours == theirs, (family, kind, ours, theirs)
    assert len(theirs) >= 8
