"""How much each tensor's rounding costs: predicted KL divergence from the float model, per type.

The KL divergence of the quantized model from the float one, for a small weight change ΔW, is
½ ΔWᵀ F ΔW to second order, where F is the Fisher information of the model's own predictive
distribution. llmopt keeps F's diagonal: per weight, the mean over tokens of the squared gradient of
log p(y | context) with y drawn from the float model (the true Fisher, not the empirical one, so the
estimate is of KL(float ‖ quantized) and needs no labels). One sequence's summed gradient squared is
an unbiased estimate of the sum of its tokens' squared gradients (the draws are independent, so
cross terms vanish in expectation), so one backward pass per calibration sample suffices.

A tensor rounded to type t then costs ½ Σ F ⊙ (Q_t(W) − W)², in nats per token, and the costs of
different tensors add (`benchmarks/gguf_quality.py` shows how well this predicts measured KL). The
same pass collects the importance matrix (mean x² per linear input channel), which llama.cpp's
searches weigh with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from llmopt.model.decoder import Decoder
from llmopt.model.source import ModelSource


@dataclass
class Fisher:
    """Per HF tensor name, the Fisher diagonal (mean over tokens); per linear, its imatrix vector."""

    diagonal: dict[str, torch.Tensor] = field(default_factory=dict)
    importance: dict[str, torch.Tensor] = field(default_factory=dict)  # HF name -> mean x² per input channel
    tokens: int = 0


def fisher_diagonal(source: ModelSource, samples: torch.Tensor, names: Sequence[str], *, seed: int = 0,
                    device: torch.device | str = "cpu",
                    on_sample: Callable[[int, int], None] | None = None) -> Fisher:  # fmt: skip
    """The Fisher diagonal of the tensors `names` (HF names of 2-D weights) over `samples` [n, t].

    The whole model is held in float32 with gradients on those tensors only; labels are drawn from
    the model's own next-token distribution with a generator seeded by `seed`, so the result is the
    same for the same samples and seed.
    """
    model = Decoder.from_source(source, torch.float32, device)
    if model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr():
        model.lm_head.weight = model.embed_tokens.weight  # one leaf, so both uses reach its gradient
    params = {n: model.get_parameter(_param_name(n)) for n in names}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    power: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name in names:
        module_name = _param_name(name).removesuffix(".weight")
        module = model.get_submodule(module_name)
        if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
            hooks.append(module.register_forward_pre_hook(_power_hook(name, power, counts)))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = samples.shape[0]
    try:
        for i in range(n):
            ids = samples[i : i + 1].to(device)
            logits = model(ids)[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            with torch.no_grad():
                drawn = torch.multinomial(logp.exp().cpu(), 1, generator=gen).to(device)
            loss = -logp.gather(-1, drawn).sum()
            # a MoE expert no token of this sample was routed to takes no part: no gradient, nothing added
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for (pname, s), g in zip(sums.items(), grads):
                if g is not None:
                    s.addcmul_(g, g)
            del logits, logp, loss, grads
            if on_sample is not None:
                on_sample(i + 1, n)
    finally:
        for h in hooks:
            h.remove()
    tokens = n * (samples.shape[1] - 1)
    result = Fisher(tokens=tokens)
    for pname, s in sums.items():
        result.diagonal[pname] = (s / tokens).cpu()
    for pname, s in power.items():
        result.importance[pname] = (s / max(counts[pname], 1)).to(torch.float32).cpu()
    del model, params, sums
    return result


def predicted_kld(fisher: torch.Tensor, weight: torch.Tensor, rounded: torch.Tensor) -> float:
    """½ Σ F ⊙ (rounded − weight)²: the KL (nats per token) this tensor's rounding adds."""
    delta = rounded.to(torch.float32) - weight.to(torch.float32)
    return 0.5 * float((fisher * delta * delta).sum(dtype=torch.float64))


def _param_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


def _power_hook(name: str, power: dict[str, torch.Tensor], counts: dict[str, int]) -> Callable:
    def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        flat = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
        power[name] = power.get(name, 0) + (flat * flat).sum(dim=0)
        counts[name] = counts.get(name, 0) + flat.shape[0]

    return hook
