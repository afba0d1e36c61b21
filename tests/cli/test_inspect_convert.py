"""`llmopt inspect` and `llmopt convert --to hf` on tiny models, through the real entry point."""

import json

import torch
import transformers

from llmopt.model import open_model


def test_help_lists_commands(llmopt_cli):
    result = llmopt_cli("--help")
    assert result.returncode == 0
    for command in ("inspect", "convert"):
        assert command in result.stdout


def test_version(llmopt_cli):
    import llmopt

    result = llmopt_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"llmopt {llmopt.__version__}"


def test_inspect_json_is_only_json(llmopt_cli, tiny_ggufs):
    for args in (["inspect", tiny_ggufs("qwen2"), "--json"], ["--json", "inspect", tiny_ggufs("qwen2")]):
        result = llmopt_cli(*args, "--tensors")
        assert result.returncode == 0, result.stderr
        info = json.loads(result.stdout)
        assert info["format"] == "gguf" and info["architecture"]["family"] == "qwen2"
        assert info["tokenizer"]["kind"] == "bpe"
        assert len(info["tensors"]) == info["tensor_count"]
        assert sum(row["tensors"] for row in info["types"].values()) == info["tensor_count"]


def test_inspect_human_output(llmopt_cli, tiny_models):
    result = llmopt_cli("inspect", tiny_models("mistral"), "--tensors")
    assert result.returncode == 0, result.stderr
    for text in ("MistralForCausalLM", "parameters", "Tokenizer", "model.layers.1.mlp.down_proj.weight"):
        assert text in result.stdout


def test_convert_gguf_to_hf_matches_transformers_gguf_loader(llmopt_cli, tiny_ggufs, tmp_path):
    gguf_path = tiny_ggufs("llama", "Q8_0")
    out = tmp_path / "hf"
    result = llmopt_cli("convert", gguf_path, "--to", "hf", "-o", out, "--dtype", "float32", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["output"] == str(out.resolve())
    ours = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                             dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids).logits - ref(ids).logits).abs().max().item() < 1e-4
    with open_model(out) as a, open_model(gguf_path) as b:
        assert a.arch == b.arch and a.parameter_count == b.parameter_count


def test_convert_dtype_and_force(llmopt_cli, tiny_ggufs, tmp_path):
    """Missing parent folders are created; --force replaces; no temporary folder is left."""
    out = tmp_path / "hf"
    for dtype in ("bfloat16", "float16"):
        result = llmopt_cli("convert", tiny_ggufs("qwen2"), "--to", "hf", "-o", out, "--dtype", dtype, "--force")
        assert result.returncode == 0, result.stderr
    with open_model(out) as src:
        assert {t.dtype for t in src.tensors.values()} == {"F16"}
        assert src.metadata["torch_dtype"] == "float16"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    nested = tmp_path / "a" / "b" / "hf"
    assert llmopt_cli("convert", tiny_ggufs("qwen2"), "--to", "hf", "-o", nested).returncode == 0
    assert (nested / "config.json").is_file()


def test_inspect_counts_the_files_own_tensors(tmp_path):
    """Experts stacked in one GGUF tensor (Mixtral) and Phi-3's fused attn_qkv / ffn_up are read as
    one HF tensor per expert and per part, but inspect counts what the file holds, as llama.cpp does."""
    import gguf

    from llmopt.api import convert_to_gguf, inspect
    from tests.model.test_mixtral import make_tiny_mixtral
    from tests.model.test_phi3 import make_tiny_phi3

    for name, make in (("mixtral", make_tiny_mixtral), ("phi3", make_tiny_phi3)):
        out = convert_to_gguf(make(tmp_path / name), tmp_path / f"{name}.gguf", "Q4_K_M")["output"]
        info = inspect(out, tensors=True)
        reader = gguf.GGUFReader(str(out))
        assert info["tensor_count"] == len(reader.tensors) < len(info["tensors"])
        by_type: dict[str, int] = {}
        for t in reader.tensors:
            by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + 1
        assert {k: row["tensors"] for k, row in info["types"].items()} == by_type
