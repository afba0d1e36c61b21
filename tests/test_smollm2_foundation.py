"""The real model end to end: SmolLM2-135M GGUF -> HF, checked against transformers' GGUF loader."""

import json

import pytest
import torch
import transformers

pytestmark = pytest.mark.slow

PROMPT = ("The history of natural language processing generally started in the 1950s, although work can be "
          "found from earlier periods. In 1950, Alan Turing published an article titled Computing Machinery "
          "and Intelligence which proposed what is now called the Turing test as a criterion of intelligence. "
          "The Georgetown experiment in 1954 involved fully automatic translation of more than sixty Russian "
          "sentences into English.")


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """transformers' own reading of the GGUF file: model and tokenizer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                               dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return model, tok


def test_inspect_gguf_and_converted_dir_agree(llmopt_cli_module, smollm2_gguf, smollm2_hf):
    infos = []
    for path in (smollm2_gguf, smollm2_hf):
        result = llmopt_cli_module("inspect", path, "--json")
        assert result.returncode == 0, result.stderr
        infos.append(json.loads(result.stdout))
    gguf_info, hf_info = infos
    assert abs(gguf_info["parameters"] - 134.5e6) < 0.1e6
    assert gguf_info["parameters"] == hf_info["parameters"]
    assert gguf_info["architecture"] == hf_info["architecture"]
    assert gguf_info["architecture"]["num_layers"] == 30 and gguf_info["architecture"]["num_kv_heads"] == 3
    assert gguf_info["types"].keys() == {"Q4_1", "Q8_0", "F32"} and hf_info["types"].keys() == {"F16"}
    assert hf_info["tokenizer"]["vocab_size"] == gguf_info["tokenizer"]["vocab_size"] == 49152


def test_converted_logits_match_transformers_gguf_loader(reference, smollm2_hf_f32):
    ref_model, ref_tok = reference
    ours_tok = transformers.AutoTokenizer.from_pretrained(smollm2_hf_f32)
    ids = ours_tok(PROMPT).input_ids
    assert ids == ref_tok(PROMPT).input_ids
    assert len(ids) >= 64
    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf_f32, dtype=torch.float32).eval()
    x = torch.tensor([ids[:64]])
    with torch.no_grad():
        diff = (ours(x).logits - ref_model(x).logits).abs().max().item()
    print(f"max abs logit difference on 64 tokens: {diff:.3g}")
    assert diff < 1e-3


@pytest.mark.parametrize("text", [PROMPT, "Call 555-0199 in 2024!\n\n<|im_start|>user\nHi there<|im_end|>\n",
                                  "  indented\tcode = {'a': [1, 2, 3]}  # comment"])
def test_tokenizer_ids_match(reference, smollm2_hf, text):
    from llmopt.model import open_model

    _, ref_tok = reference
    ours = transformers.AutoTokenizer.from_pretrained(smollm2_hf)
    assert ours(text).input_ids == ref_tok(text).input_ids
    with open_model(smollm2_hf) as src:
        assert src.tokenizer().encode(text) == ref_tok(text).input_ids


def test_tokenizer_ids_match_llama_cpp(smollm2_gguf):
    """llama.cpp itself, reading the same GGUF: our rebuilt tokenizer must split text as it does."""
    import llama_cpp

    from llmopt.model import open_model

    llm = llama_cpp.Llama(model_path=str(smollm2_gguf), vocab_only=True, verbose=False)
    with open_model(smollm2_gguf) as src:
        tok = src.tokenizer()
        for text in (PROMPT, "Digits 1234567 and   spaces\n\nnew lines", "café naïve – “quotes”"):
            assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text
