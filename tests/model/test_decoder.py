"""The pure-PyTorch decoder against transformers' own modelling code on the same weights."""

import pytest
import torch
import transformers

from llmopt.model import open_model
from llmopt.model.decoder import Decoder, attention_mask, load_block
from tests.factories import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(tiny_models, family, tie):
    path = tiny_models(family, tie)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with open_model(path) as src, torch.no_grad():
        ours = Decoder.from_source(src)
        diff = (ours(ids) - ref(ids).logits).abs().max().item()
    assert diff < 1e-4, diff


def test_prefix_then_step_equals_full_forward(tiny_models):
    """Running a prompt in two pieces through a cache gives the same logits as one pass."""

    class ListCache:
        def __init__(self):
            self.kv = {}

        def update(self, layer, k, v, start):
            if layer in self.kv:
                pk, pv = self.kv[layer]
                k, v = torch.cat([pk[:, :, :start], k], 2), torch.cat([pv[:, :, :start], v], 2)
            self.kv[layer] = (k, v)
            return k, v

    with open_model(tiny_models("qwen2")) as src, torch.no_grad():
        model = Decoder.from_source(src)
        ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(2))
        full = model(ids)
        cache = ListCache()
        first = model(ids[:, :13], 0, cache)
        rest = model(ids[:, 13:], 13, cache)
    assert torch.allclose(torch.cat([first, rest], 1), full, atol=1e-5)


def test_load_block_matches_full_model(tiny_models):
    with open_model(tiny_models("llama")) as src:
        block = load_block(src, 1)
        model = Decoder.from_source(src)
    for name, p in block.state_dict().items():
        assert torch.equal(p, model.layers[1].state_dict()[name])


def test_sliding_window_mask():
    m = attention_mask(4, 6, 2, window=3, device=torch.device("cpu"))
    # query at position 4 sees keys 2..4 only
    assert m[2].tolist() == [False, False, True, True, True, False]
    assert attention_mask(1, 6, 5, None, torch.device("cpu")) is None
