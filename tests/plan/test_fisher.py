"""The streamed Fisher pass equals one backward through the whole model, tensor for tensor.

`whole_model_fisher` is the oracle: the model held whole in float32, one autograd backward per
sample through all of it (what llmopt did before the pass was streamed). The streamed pass must
give the same diagonals and importance (float rounding apart: 1e-4 relative), the same cost table,
with its block inputs in memory or spilled to disk, for untied and tied heads, a fused family and
a mixture of experts, and on SmolLM2.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from llmopt.calibration.activations import ActivationStore
from llmopt.model import open_model
from llmopt.model.decoder import Decoder
from llmopt.plan.fisher import EMBEDDING, FisherPass
from llmopt.plan.sensitivity import measure

RTOL = 1e-4


def whole_model_fisher(source, samples: torch.Tensor, names: Sequence[str], seed: int):  # noqa: ANN001, ANN201
    """(diagonals, importance) from the whole model in float32, one backward per sample."""
    model = Decoder.from_source(source, torch.float32)
    if model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr():
        model.lm_head.weight = model.embed_tokens.weight
    for p in model.parameters():
        p.requires_grad_(False)
    params = {n: model.get_parameter(n.removeprefix("model.")) for n in names}
    for p in params.values():
        p.requires_grad_(True)
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    power: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name in names:
        module = model.get_submodule(name.removeprefix("model.").removesuffix(".weight"))
        if isinstance(module, torch.nn.Linear) and not name.startswith("lm_head"):
            def hook(_m, args, name=name):  # noqa: ANN001, ANN202
                flat = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
                if flat.shape[0]:
                    power[name] = power.get(name, 0) + (flat * flat).sum(dim=0)
                    counts[name] = counts.get(name, 0) + flat.shape[0]
            hooks.append(module.register_forward_pre_hook(hook))
    gen = torch.Generator().manual_seed(seed)
    for i in range(samples.shape[0]):
        logp = torch.log_softmax(model(samples[i : i + 1])[0, :-1].float(), dim=-1)
        with torch.no_grad():
            drawn = torch.multinomial(logp.exp(), 1, generator=gen)
        grads = torch.autograd.grad(-logp.gather(-1, drawn).sum(), list(params.values()), allow_unused=True)
        for s, g in zip(sums.values(), grads):
            if g is not None:
                s.addcmul_(g, g)
    for h in hooks:
        h.remove()
    tokens = samples.shape[0] * (samples.shape[1] - 1)
    return ({n: s / tokens for n, s in sums.items()},
            {n: (s / counts[n]).float() for n, s in power.items()})  # fmt: skip


def streamed_fisher(source, samples: torch.Tensor, names: Sequence[str], seed: int, budget: int = 1 << 30):  # noqa: ANN001, ANN201
    with ActivationStore(budget) as store:
        fisher = FisherPass(source, samples, names, seed=seed, store=store)
        importance = fisher.forward()
        diagonals = {}
        for d in fisher.diagonals():
            dense = d.values
            if d.rows is not None:  # row-sparse: every other row's diagonal is zero
                dense = torch.zeros(source.tensors[d.name].shape)
                dense[d.rows] = d.values
            diagonals[d.name] = dense
        return diagonals, importance, store.spilled


def assert_close(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        scale = float(w.abs().max())
        assert scale > 0, name
        err = float((got[name] - w).abs().max())
        assert err <= RTOL * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


def two_d_names(source) -> list[str]:  # noqa: ANN001
    return [n for n, t in source.tensors.items() if len(t.shape) == 2]


def samples_for(source, n: int = 3, t: int = 24, seed: int = 0) -> torch.Tensor:  # noqa: ANN001
    vocab = source.tensors[EMBEDDING].shape[0]
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_streamed_equals_whole_model(tmp_path: Path, tie: bool) -> None:
    from tests.factories import make_tiny_hf

    with open_model(make_tiny_hf(tmp_path / "m", tie=tie, layers=3)) as source:
        names = two_d_names(source)
        assert ("lm_head.weight" in names) != tie
        samples = samples_for(source)
        want, want_imp = whole_model_fisher(source, samples, names, seed=5)
        got, got_imp, spilled = streamed_fisher(source, samples, names, seed=5)
        assert not spilled
        assert_close(got, want)
        assert_close(got_imp, want_imp)


def test_spilled_block_inputs_give_the_same_diagonals(tmp_path: Path) -> None:
    """With no memory budget every block input goes to disk and comes back bit for bit."""
    from tests.factories import make_tiny_hf

    with open_model(make_tiny_hf(tmp_path / "m", layers=2)) as source:
        names = two_d_names(source)
        samples = samples_for(source, n=2)
        in_memory, _, _ = streamed_fisher(source, samples, names, seed=1)
        on_disk, _, spilled = streamed_fisher(source, samples, names, seed=1, budget=0)
        assert spilled
        for name in names:
            assert torch.equal(in_memory[name], on_disk[name]), name


def test_a_subset_of_tensors(tmp_path: Path) -> None:
    """Only some tensors asked for (no embedding: the backward stops at block 0's weights)."""
    from tests.factories import make_tiny_hf

    with open_model(make_tiny_hf(tmp_path / "m", layers=3)) as source:
        names = ["model.layers.1.mlp.down_proj.weight", "model.layers.2.self_attn.q_proj.weight", "lm_head.weight"]
        samples = samples_for(source)
        want, want_imp = whole_model_fisher(source, samples, names, seed=2)
        got, got_imp, _ = streamed_fisher(source, samples, names, seed=2)
        assert_close(got, want)
        assert_close(got_imp, want_imp)


@pytest.mark.parametrize("family", ["mixtral", "phi3"])
def test_fused_and_expert_families(tmp_path: Path, family: str) -> None:
    if family == "mixtral":
        from tests.model.test_mixtral import make_tiny_mixtral as make
    else:
        from tests.model.test_phi3 import make_tiny_phi3 as make
    with open_model(make(tmp_path / family, layers=2)) as source:
        names = [n for n in two_d_names(source) if not n.endswith("gate.weight")]  # routers stay float
        samples = samples_for(source, n=2, t=16)
        want, want_imp = whole_model_fisher(source, samples, names, seed=3)
        got, got_imp, _ = streamed_fisher(source, samples, names, seed=3)
        assert_close({n: v for n, v in got.items() if want[n].abs().max() > 0},
                     {n: v for n, v in want.items() if v.abs().max() > 0})  # fmt: skip
        for n, v in want.items():  # an expert no token reached: zero in both
            if v.abs().max() == 0:
                assert got[n].abs().max() == 0, n
        assert_close(got_imp, want_imp)


def _cost_table_pair(source, names: dict[str, str], types: list[str], samples: torch.Tensor):  # noqa: ANN001, ANN202
    """(streamed measure, the whole-model diagonals' costs) for `names` rounded to `types`."""
    from llmopt.plan.fisher import predicted_kld
    from llmopt.plan.gguf_automix import rounded

    got = measure(source, names, {n: types for n in names}, rounded, samples, seed=0, key={})
    diag, importance = whole_model_fisher(source, samples, list(names.values()), seed=0)
    want = {}
    for name, hf in names.items():
        w = source.load(hf, dtype=torch.float32)
        imp = importance.get(hf)
        want[name] = [predicted_kld(diag[hf], w, rounded(t, w, imp)) for t in types]
    return got, want


def _assert_costs(got, want: dict) -> None:  # noqa: ANN001
    for name, costs in want.items():
        for t, (a, b) in enumerate(zip(got.cost[name], costs)):
            assert a == pytest.approx(b, rel=RTOL, abs=1e-12), (name, t)


def test_cost_table_equals_the_whole_model_pass(tmp_path: Path) -> None:
    from tests.formats.gguf.models import make_wide_hf

    with open_model(make_wide_hf(tmp_path / "w", layers=2)) as source:
        names = {f"t{i}": n for i, n in enumerate(two_d_names(source))}
        got, want = _cost_table_pair(source, names, ["Q4_K", "Q6_K", "Q8_0", "F16"], samples_for(source, n=2, t=32))
        _assert_costs(got, want)


@pytest.mark.slow
def test_smollm2_cost_table_equals_the_whole_model_pass(smollm2_hf: Path) -> None:
    """SmolLM2 (tied head: the embedding's diagonal has both uses): the first and last blocks and the
    embedding, at types of 32-wide blocks (576 columns), streamed = whole model within 1e-4."""
    with open_model(smollm2_hf) as source:
        last = source.arch.num_layers - 1
        names = {n: n for n in two_d_names(source) if n == EMBEDDING or n.startswith(("model.layers.0.", f"model.layers.{last}."))}
        got, want = _cost_table_pair(source, names, ["Q4_0", "IQ4_NL", "Q8_0"], samples_for(source, n=2, t=64))
        _assert_costs(got, want)


def test_importance_equals_the_imatrix_collectors(tmp_path: Path) -> None:
    """The pass's importance is llama-imatrix's statistic: `compute_imatrix` on the same samples."""
    from llmopt.calibration.imatrix import compute_imatrix
    from tests.factories import make_tiny_hf

    with open_model(make_tiny_hf(tmp_path / "m", layers=2)) as source:
        names = [n for n in two_d_names(source) if n.startswith("model.layers.")]
        samples = samples_for(source)
        _, importance, _ = streamed_fisher(source, samples, names, seed=0)
        imatrix = compute_imatrix(source, samples).importance()
        family = source.arch.family
        assert set(importance) == set(names)
        for name in names:
            want = imatrix[family.hf_to_gguf_name(name)]
            assert torch.allclose(importance[name], want, rtol=1e-6), name
