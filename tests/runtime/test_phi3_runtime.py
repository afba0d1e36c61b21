"""Phi-3 in the runtime: continuous batching over the paged cache (q/k/v and gate/up split from the
fused tensors, longrope's short factors) gives each prompt the tokens it gets alone. (Greedy tokens
against transformers: tests/model/test_phi3.py; against llama.cpp on our GGUF: tests/formats/test_phi3_gguf.py.)"""

from __future__ import annotations

import pytest

from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from tests.runtime.batching import assert_paged_batch_equals_each_prompt_alone
from tests.model.test_phi3 import ids, make_tiny_phi3


@pytest.mark.parametrize("longrope", [False, True], ids=["plain", "longrope"])
def test_paged_batch_equals_each_prompt_alone(tmp_path, longrope: bool) -> None:
    """Four prompts of 3 to 33 tokens, batched in chunks with decode steps, over 4-token blocks."""
    with open_model(make_tiny_phi3(tmp_path / "phi3", longrope=longrope)) as src:
        model = Decoder.from_source(src)
    assert_paged_batch_equals_each_prompt_alone(model, ids, prompts=4, max_tokens=8)
