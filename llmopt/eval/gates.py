"""Quality gates: turn an evaluation into pass/fail (the CLI exits 1 when any gate fails)."""

from __future__ import annotations

from dataclasses import dataclass

from llmopt.errors import OptionError
from llmopt.eval.perplexity import EvalResult


NEEDS_REF = "<max_ppl_increase>, <min_top1> and <max_kld> compare against a reference: give <ref> MODEL"


@dataclass
class Gate:
    name: str
    value: float
    limit: float
    passed: bool

    def line(self) -> str:
        op = ">=" if self.name == "top1_agreement_pct" else "<="
        return f"{self.name} {self.value:.{5 if self.name == 'kl_divergence' else 3}f} {op} {self.limit:g}: {'pass' if self.passed else 'FAIL'}"


def check_gates(result: EvalResult, max_ppl_increase: float | None = None, min_top1: float | None = None,
                max_kld: float | None = None) -> list[Gate]:
    """Gates in percent: perplexity may rise at most `max_ppl_increase` % over the reference's, and
    top-1 agreement with the reference must be at least `min_top1` %; the mean KL divergence from
    the reference at most `max_kld` nats per token."""
    gates = []
    if (max_ppl_increase is not None or min_top1 is not None or max_kld is not None) and result.ref_perplexity is None:
        raise OptionError(NEEDS_REF)
    if max_ppl_increase is not None:
        rise = result.ppl_increase_pct
        gates.append(Gate("ppl_increase_pct", rise, max_ppl_increase, rise <= max_ppl_increase))
    if min_top1 is not None:
        top1 = 100.0 * result.top1_agreement
        gates.append(Gate("top1_agreement_pct", top1, min_top1, top1 >= min_top1))
    if max_kld is not None:
        kld = result.kl_divergence
        gates.append(Gate("kl_divergence", kld, max_kld, kld <= max_kld))
    return gates
