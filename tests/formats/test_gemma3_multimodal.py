"""Gemma 3 4B+ (Gemma3ForConditionalGeneration) through convert, quantize and generate: the text
model is what is written. The GGUF holds the language model alone, as llama.cpp's converter writes
a text GGUF of it (its vision tensors skipped), and llama.cpp runs it with our logits and our greedy
tokens; `quantize` writes the language model as a checkpoint that reads back and generates;
`generate` on the multimodal directory continues a prompt with transformers' greedy tokens."""

from __future__ import annotations

import gguf
import torch
import transformers

from llmopt.api import convert_to_gguf, generate, quantize
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from tests.formats.gguf.llama_cpp_helpers import assert_same_greedy, assert_same_top1, llama_cpp_greedy, llama_cpp_logits
from tests.model.test_gemma3 import WINDOW, ids
from tests.model.test_gemma3_multimodal import make_tiny_gemma3_4b, reference


def test_gguf_is_the_text_model_and_runs_in_llama_cpp(tmp_path) -> None:
    """F16 GGUF: gemma3 with the text model's tensors only; llama.cpp's logits on 64 positions (four
    windows, a global layer with the linear rope scaling) have our top-1."""
    path = make_tiny_gemma3_4b(tmp_path / "g")
    out = tmp_path / "g.gguf"
    convert_to_gguf(path, out, "F16")
    reader = gguf.GGUFReader(str(out))
    names = [t.name for t in reader.tensors]
    assert reader.fields["general.architecture"].contents() == "gemma3"
    assert reader.fields["gemma3.rope.scaling.factor"].contents() == 8.0
    assert reader.fields["gemma3.attention.sliding_window"].contents() == WINDOW
    with open_model(path) as src:
        assert len(names) == len(src.tensors) and "blk.6.post_ffw_norm.weight" in names and "output.weight" not in names
    x = ids(64, seed=5)
    with open_model(out) as src, torch.no_grad():
        ours = Decoder.from_source(src)(x)[0]
    assert_same_top1(ours, llama_cpp_logits(out, x[0].tolist()), "gemma3 4b-style (64 positions)")


def test_greedy_generation_equals_llama_cpps(tmp_path) -> None:
    """32 greedy tokens of our runtime on the GGUF are llama.cpp's on the same file."""
    from llmopt.runtime.generate import Generator
    from llmopt.runtime.weights import load_model

    out = tmp_path / "g.gguf"
    convert_to_gguf(make_tiny_gemma3_4b(tmp_path / "g"), out, "F16")
    prompt = ids(12, seed=7)[0].tolist()
    theirs = llama_cpp_greedy(out, prompt, 32)
    mine = Generator(load_model(str(out), "float32", "cpu").model, eos=set()).generate(prompt, max_tokens=32, ignore_eos=True)
    assert len(set(theirs)) >= 3  # a continuation that changes token, not one repeated
    assert_same_greedy(out, prompt, mine.token_ids, theirs)


def test_generate_and_quantize_the_multimodal_directory(tmp_path) -> None:
    """`generate` on the directory: transformers' greedy tokens. `quantize` (RTN 4-bit into a GPTQ
    checkpoint; GPTQ's calibration on Gemma 3 is tests/formats/test_gemma3_checkpoint.py's) writes the
    language model as a Gemma3ForCausalLM checkpoint that reads back and generates."""
    path = make_tiny_gemma3_4b(tmp_path / "g")
    prompt = "The quick brown fox jumps over"
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    ref = reference(path).generate(input_ids=prompt_ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    ours = generate(str(path), prompt, max_tokens=24, ignore_eos=True, dtype="float32", device="cpu")
    assert ours.token_ids == ref[0, prompt_ids.shape[1]:].tolist()

    quantize(path, tmp_path / "gptq", method="rtn", bits=4, group_size=32)
    with open_model(tmp_path / "gptq") as back:
        assert back.arch.hf_architecture == "Gemma3ForCausalLM" and back.kind == "hf-gptq"
        assert back.quantization_config["quant_method"] == "gptq" and not back.set_aside
        assert back.tensors["model.layers.5.self_attn.o_proj.weight"].dtype == "GPTQ4"
    again = generate(str(tmp_path / "gptq"), prompt, max_tokens=8, ignore_eos=True, dtype="float32", device="cpu")
    assert len(again.token_ids) == 8
