"""The tensor list an architecture implies must be exactly the tensors real files hold."""

import pytest

from llmopt.model import open_model
from llmopt.plan.arch_tensors import active_parameter_count, arch_tensors, parameter_count
from llmopt.plan.presets import PRESETS, get_preset


@pytest.mark.slow
def test_matches_the_real_smollm2_gguf(smollm2_gguf):
    with open_model(smollm2_gguf) as src:
        real = {t.stored_name: t.shape for t in src.tensors.values()}
        planned = {t.gguf_name: t.shape for t in arch_tensors(src.arch)}
        assert planned == real
        assert parameter_count(arch_tensors(src.arch)) == src.parameter_count


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_matches_hf_checkpoints_of_each_family(tiny_models, family, tie):
    with open_model(tiny_models(family, tie=tie)) as src:
        real = {name: t.shape for name, t in src.tensors.items()}
        planned = {t.hf_name: t.shape for t in arch_tensors(src.arch)}
        assert planned == real
        for t in arch_tensors(src.arch):  # and llama.cpp's names are the family's own
            assert t.gguf_name == src.arch.family.hf_to_gguf_name(t.hf_name)


# Total parameters as the hub reports them (safetensors metadata of each repository).
PUBLISHED = {
    "llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800, "mixtral-8x7b": 46_702_792_704, "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-0.5b": 494_032_768, "smollm2-135m": 134_515_008,
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_the_hub(name):
    assert parameter_count(arch_tensors(get_preset(name).arch)) == PUBLISHED[name]


def test_mixtral_reads_two_of_eight_experts_per_token():
    arch = get_preset("mixtral-8x7b").arch
    active = active_parameter_count(arch, arch_tensors(arch))
    assert 12.8e9 < active < 13.0e9  # Mistral AI: "12.9B active parameters"
    experts = [t for t in arch_tensors(arch) if t.gguf_name == "blk.0.ffn_down_exps.weight"]
    assert experts[0].shape == (8, 4096, 14336) and experts[0].linears == 8


def test_llama31_presets_carry_rope_factors_like_the_converter():
    names = {t.gguf_name for t in arch_tensors(get_preset("llama-3.1-8b").arch)}
    assert "rope_freqs.weight" in names
    assert "rope_freqs.weight" not in {t.gguf_name for t in arch_tensors(get_preset("llama-3-8b").arch)}


def test_every_preset_cites_its_config():
    for p in PRESETS.values():
        assert "/" in p.source and p.arch.head_dim * p.arch.num_heads >= p.arch.hidden_size // 2
