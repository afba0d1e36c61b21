"""Calibration sources (.txt, .jsonl, .parquet, presets offline, self-generated) and token sampling."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.calibration.samples import CalibConfig, calibration_tokens, random_windows
from llmopt.calibration.self_text import GREEDY_STEPS, document_layout, generate_samples, special_token_ids
from llmopt.calibration.text import read_texts
from llmopt.errors import InputError
from llmopt.model import open_model
from llmopt.model.decoder import Decoder


def test_txt_jsonl_parquet_give_the_same_documents(tmp_path) -> None:
    docs = ["first document.", "second one, with more words.", "third"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": docs}), tmp_path / "a.parquet")
    (tmp_path / "a.txt").write_text("\n\n".join(docs))
    j = read_texts(str(tmp_path / "a.jsonl"), "content")
    p = read_texts(str(tmp_path / "a.parquet"), "content")
    t = read_texts(str(tmp_path / "a.txt"))
    assert j.documents == p.documents == docs
    assert j.sha256 == p.sha256 and t.documents == ["\n\n".join(docs)]


@pytest.mark.parametrize("content, field, message", [
    ("", None, "holds no text"),
    ("  \n\n", None, "holds no text"),
])
def test_empty_text(tmp_path, content, field, message) -> None:
    (tmp_path / "e.txt").write_text(content)
    with pytest.raises(InputError, match=message):
        read_texts(str(tmp_path / "e.txt"), field)


def test_bad_jsonl(tmp_path) -> None:
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(InputError, match=r"b.jsonl:2: not a JSON line"):
        read_texts(str(tmp_path / "b.jsonl"))
    (tmp_path / "c.jsonl").write_text('{"body": "ok"}\n')
    with pytest.raises(InputError, match="no field 'text'"):
        read_texts(str(tmp_path / "c.jsonl"))


def test_missing_and_offline_presets(tmp_path, monkeypatch) -> None:
    with pytest.raises(InputError, match="no such file"):
        read_texts(str(tmp_path / "nowhere.txt"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(InputError) as e:
        read_texts("wikitext2")
    assert "\n" not in str(e.value) and "wikitext2" in str(e.value)


def test_windows_are_seeded() -> None:
    stream = torch.arange(10_000)
    a = random_windows(stream, 16, 64, seed=0)
    assert a.shape == (16, 64)
    assert torch.equal(a, random_windows(stream, 16, 64, seed=0))
    assert not torch.equal(a, random_windows(stream, 16, 64, seed=1))
    assert bool((a[:, 1:] - a[:, :-1] == 1).all())  # contiguous windows of the stream
    with pytest.raises(InputError, match="needs at least"):
        random_windows(torch.arange(10), 1, 64, 0)


def test_calibration_tokens_from_a_model_tokenizer(tiny_models, tmp_path) -> None:
    (tmp_path / "c.txt").write_text("The quick brown fox jumps over the lazy dog. " * 50)
    with open_model(tiny_models("llama")) as src:
        text = read_texts(str(tmp_path / "c.txt"))
        tokens = calibration_tokens(text, src.tokenizer().encode, CalibConfig(str(tmp_path / "c.txt"), None, 4, 32, 0))
        ids = src.tokenizer().encode(text.documents[0])
    assert tokens.shape == (4, 32)
    stream = ids
    for row in tokens.tolist():  # every window is a slice of the tokenized text
        assert any(stream[i:i + 32] == row for i in range(len(stream) - 31))


def test_self_generated_samples_are_reproducible(tiny_models) -> None:
    with open_model(tiny_models("llama")) as src:
        a = generate_samples(src, 3, 20, seed=0, batch_size=2)
        b = generate_samples(src, 3, 20, seed=0, batch_size=2)
        c = generate_samples(src, 3, 20, seed=1, batch_size=2)
        specials = {src.tokenizer().token_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert a.shape == (3, 20) and torch.equal(a, b) and not torch.equal(a, c)
    assert not set(a.flatten().tolist()) & specials


def test_self_samples_generate_in_bfloat16(tiny_models) -> None:
    with open_model(tiny_models("llama")) as src:
        a = generate_samples(src, 3, 20, seed=0, batch_size=2, dtype=torch.bfloat16)
        b = generate_samples(src, 3, 20, seed=0, batch_size=2, dtype=torch.bfloat16)
    assert a.shape == (3, 20) and a.dtype == torch.int64 and torch.equal(a, b)


@pytest.mark.parametrize("seqlen, layout", [(512, (4, 128)), (300, (3, 100)), (129, (2, 65)), (100, (1, 100))])
def test_rows_hold_as_few_documents_as_fit(seqlen, layout) -> None:
    assert document_layout(seqlen) == layout


@torch.no_grad()
def test_each_packed_document_starts_afresh(tiny_models) -> None:
    """Every document in a row restarts: its first GREEDY_STEPS tokens are the model's greedy
    continuation of its own first token alone, not of the row so far."""
    with open_model(tiny_models("llama")) as src:
        rows = generate_samples(src, 2, 300, seed=0, batch_size=4)
        model = Decoder.from_source(src)
        banned = sorted(special_token_ids(src))
    per_row, doc_len = document_layout(300)
    assert rows.shape == (2, 300)
    for row in rows:
        for d in range(per_row):
            doc = row[d * doc_len:(d + 1) * doc_len]
            greedy = doc[:1]
            for _ in range(GREEDY_STEPS):
                logits = model(greedy[None])[0, -1]
                logits[banned] = -float("inf")
                greedy = torch.cat([greedy, logits.argmax().view(1)])
            assert torch.equal(greedy, doc[:GREEDY_STEPS + 1])
