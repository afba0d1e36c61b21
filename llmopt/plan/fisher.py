"""How much each tensor's rounding costs: the Fisher diagonal, measured one block at a time.

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

The pass never holds the model (`FisherPass`), so it runs at any size that one block fits:
1. forward: each block in turn over every sample, its input kept (`ActivationStore`: in memory up to
   a budget, then on disk), the importance of its linears seen on the way;
2. head: per sample, the final norm and the LM head (kept in its stored dtype, multiplied in float32
   a slab of rows at a time), labels drawn from the model's own distribution (seeded), and the
   gradient of the loss by the logits in closed form (softmax − one-hot): from it the head's
   per-sample gradient, squared slab by slab into its diagonal, and the gradient at the last
   block's output;
3. backward: blocks from the last to the first, each sample's forward recomputed from its kept
   input with gradients on the block's weights, the gradient from above propagated through it; the
   squared per-sample weight gradients are the block's diagonals, handed out as soon as the block is
   done (its tensors' costs are computed and the diagonals dropped before the next block loads);
4. embedding: each sample's input gradient added into the rows of its tokens (rows no token reached
   have F = 0, so an untied embedding's diagonal is kept for the seen rows only); a tied embedding
   also gets its rows' head gradient of the same sample before squaring.
Per sample and per tensor this is the same arithmetic as one backward through the whole model
(`tests/plan/test_fisher.py` holds that whole-model pass as the oracle); resident memory is one
block in float32 with its gradients and diagonals, the head in its stored dtype (with its diagonal
when it is measured), the gradient at one block boundary for every sample, and one sample's logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from llmopt.calibration.activations import ActivationStore
from llmopt.calibration.capture import capture_inputs, embed
from llmopt.calibration.imatrix import input_power
from llmopt.model.decoder import RMSNorm, Rotary, embed_scaled, load_block
from llmopt.model.source import ModelSource
from llmopt.quant.pipeline import head_weight_name

EMBEDDING = "model.embed_tokens.weight"
SLAB_ELEMENTS = 1 << 24  # elements of a big tensor handled at once (64 MB of float32)


@dataclass
class Diagonal:
    """The Fisher diagonal (mean over scored tokens) of one HF tensor: of all its rows, or of `rows`
    (sorted indices) when every other row's is zero."""

    name: str
    values: torch.Tensor
    rows: torch.Tensor | None = None


def slab_rows(cols: int) -> int:
    """Rows of a [rows, cols] tensor handled at once."""
    return max(1, SLAB_ELEMENTS // max(cols, 1))


class FisherPass:
    """The Fisher diagonals of `names` (HF names of 2-D weights) over `samples` [n, t], streamed (see
    the module docstring): `forward()` first (it returns the importance vectors), then `diagonals()`.
    Labels are drawn with a generator seeded by `seed`: the same samples and seed give the same result."""

    def __init__(self, source: ModelSource, samples: torch.Tensor, names: Sequence[str], *, seed: int = 0,
                 device: torch.device | str = "cpu", store: ActivationStore,
                 on_step: Callable[[int, int], None] | None = None):  # fmt: skip
        self.source, self.samples, self.seed = source, samples, seed
        self.device, self.store, self.on_step = torch.device(device), store, on_step
        arch = source.arch
        self.layers = arch.num_layers
        self.head = head_weight_name(source)
        self.tied = self.head == EMBEDDING
        self.blocks: dict[int, dict[str, str]] = {}  # layer -> HF name -> the block's parameter name
        self.globals: set[str] = set()
        for name in names:
            if name.startswith("model.layers."):
                layer, _, param = name.removeprefix("model.layers.").partition(".")
                self.blocks.setdefault(int(layer), {})[name] = param
            elif name in (EMBEDDING, self.head):
                self.globals.add(name)
            else:
                raise ValueError(f"{name}: not a block, embedding or head tensor")
        n, t = samples.shape
        self.tokens = n * (t - 1)
        self.cos, self.sin = Rotary(arch).to(self.device)(0, t, torch.float32)
        self._steps = 0

    def _step(self) -> None:
        self._steps += 1
        if self.on_step is not None:
            self.on_step(self._steps, 2 * self.layers + 2)

    # ------------------------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self) -> dict[str, torch.Tensor]:
        """Run every block over every sample, keeping each block's input; returns the importance
        (mean x² per input channel) of each linear among `names`."""
        power: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        x = embed(self.source, self.samples, torch.float32, self.device)
        for layer in range(self.layers):
            block = load_block(self.source, layer, torch.float32, self.device)
            self.store.put(layer, x)
            with ExitStack() as hooks:
                for name, param in self.blocks.get(layer, {}).items():
                    module = block.get_submodule(param.removesuffix(".weight"))
                    if isinstance(module, torch.nn.Linear):
                        hooks.enter_context(capture_inputs(module, _power_sink(name, power, counts)))
                x = torch.cat([block(x[i : i + 1], self.cos, self.sin) for i in range(x.shape[0])])
            del block
            self._step()
        self.store.put(self.layers, x)
        return {name: (s / max(counts[name], 1)).to(torch.float32).cpu() for name, s in power.items()}

    # ----------------------------------------------------------------------------------- backward
    def diagonals(self) -> Iterator[Diagonal]:
        """Each tensor's diagonal, as soon as it is final: the head's, then the blocks' from the last
        to the first, then the embedding's (after `forward`)."""
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        head_sum, grad, own_rows = self._head(gen)
        self._step()
        if head_sum is not None and not self.tied:
            yield Diagonal(self.head, head_sum.div_(self.tokens).cpu())
            head_sum = None
        for layer in reversed(range(self.layers)):
            yield from self._block(layer, grad)
            self._step()
        if EMBEDDING in self.globals:
            yield self._embedding(grad, head_sum, own_rows)
        self._step()

    def _head(self, gen: torch.Generator) -> tuple[torch.Tensor | None, torch.Tensor, list]:
        """Labels, the head's diagonal sum (when measured) and the gradient at the last block's
        output, per sample; for a tied head also each sample's head gradient on its own tokens' rows."""
        src, arch, dev = self.source, self.source.arch, self.device
        norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.family.norm_shift).to(dev)
        norm.weight.data = src.load("model.norm.weight", dtype=torch.float32).to(dev)
        weight = src.load(self.head, dtype=None).to(dev)  # stored dtype: float32 slabs as they are used
        src.release_pages()
        step = slab_rows(weight.shape[1])
        slabs = [slice(lo, min(lo + step, weight.shape[0])) for lo in range(0, weight.shape[0], step)]
        measured = self.head in self.globals
        total = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if measured else None
        last = self.store.get(self.layers)
        grad = torch.empty(last.shape, dtype=torch.float32, device=dev)
        own_rows = []
        for i in range(last.shape[0]):
            h = last[i].to(dev).requires_grad_(True)
            with torch.enable_grad():
                z = norm(h)
            zt = z[:-1].detach()
            logp = torch.log_softmax(torch.cat([zt @ weight[s].float().T for s in slabs], dim=-1), dim=-1)
            drawn = torch.multinomial(logp.exp().cpu(), 1, generator=gen).to(dev)[:, 0]
            dlogits = logp.exp_()  # d(−Σ log p(drawn)) / d logits = softmax − one-hot
            dlogits[torch.arange(dlogits.shape[0], device=dev), drawn] -= 1
            dz = torch.zeros_like(z)
            own = torch.unique(self.samples[i].clamp(0, weight.shape[0] - 1)).to(dev) if self.tied else None
            kept = []
            for s in slabs:
                w = weight[s].float()
                dz[:-1] += dlogits[:, s] @ w
                if total is not None:
                    g = dlogits[:, s].T @ zt
                    if own is not None:  # squared later, with the embedding's gradient of these rows
                        mine = own[(own >= s.start) & (own < s.stop)] - s.start
                        kept.append(g[mine].clone())
                        g[mine] = 0
                    total[s].addcmul_(g, g)
            own_rows.append(torch.cat(kept) if kept else None)
            z.backward(dz)
            grad[i] = h.grad
            del logp, dlogits, dz, z, h
        del weight
        return total, grad, own_rows

    def _block(self, layer: int, grad: torch.Tensor) -> Iterator[Diagonal]:
        """Backward through block `layer` for every sample: its tensors' diagonals; `grad` (at the
        block's output) becomes the gradient at its input."""
        wanted = self.blocks.get(layer, {})
        pass_down = layer > 0 or EMBEDDING in self.globals
        inputs = self.store.get(layer)
        self.store.drop(layer + 1)
        if not wanted and not pass_down:
            return
        block = load_block(self.source, layer, torch.float32, self.device)
        for p in block.parameters():
            p.requires_grad_(False)
        params = {name: block.get_parameter(param) for name, param in wanted.items()}
        for p in params.values():
            p.requires_grad_(True)
        sums = {name: torch.zeros_like(p) for name, p in params.items()}
        for i in range(inputs.shape[0]):
            x = inputs[i : i + 1].to(self.device).requires_grad_(pass_down)
            with torch.enable_grad():
                y = block(x, self.cos, self.sin)
            leaves = ([x] if pass_down else []) + list(params.values())
            # an expert none of this sample's tokens reached takes no part: no gradient, nothing added
            grads = torch.autograd.grad(y, leaves, grad_outputs=grad[i : i + 1], allow_unused=True)
            if pass_down:
                grad[i] = grads[0][0]
            for s, g in zip(sums.values(), grads[1:] if pass_down else grads):
                if g is not None:
                    s.addcmul_(g, g)
            del y, grads
        del block, params
        for name, s in sums.items():
            yield Diagonal(name, s.div_(self.tokens).cpu())

    def _embedding(self, grad: torch.Tensor, head_sum: torch.Tensor | None, own_rows: list) -> Diagonal:
        """The embedding's diagonal: each sample's input gradient summed into its tokens' rows (with
        the tied head's gradient of those rows, `own_rows`), squared; every other row's is the head's."""
        vocab = self.source.tensors[EMBEDDING].shape[0]
        tokens = self.samples.clamp(0, vocab - 1).to(self.device)
        seen = torch.unique(tokens)
        sums = torch.zeros(seen.shape[0], grad.shape[-1], dtype=torch.float32, device=self.device)
        for i in range(tokens.shape[0]):
            own, where = torch.unique(tokens[i], return_inverse=True)
            g = torch.zeros(own.shape[0], grad.shape[-1], dtype=torch.float32, device=self.device)
            g.index_add_(0, where, embed_scaled(grad[i], self.source.arch))
            if own_rows and own_rows[i] is not None:
                g += own_rows[i]
            sums[torch.searchsorted(seen, own)] += g * g
        if head_sum is None:
            return Diagonal(EMBEDDING, sums.div_(self.tokens).cpu(), seen.cpu())
        head_sum[seen] += sums
        return Diagonal(EMBEDDING, head_sum.div_(self.tokens).cpu())


def predicted_kld(fisher: torch.Tensor, weight: torch.Tensor, rounded: torch.Tensor) -> float:
    """½ Σ F ⊙ (rounded − weight)²: the KL (nats per token) this tensor's rounding adds."""
    delta = rounded.to(torch.float32) - weight.to(torch.float32)
    return 0.5 * float((fisher * delta * delta).sum(dtype=torch.float64))


def _power_sink(name: str, power: dict[str, torch.Tensor], counts: dict[str, int]) -> Callable[[torch.Tensor], None]:
    def sink(x: torch.Tensor) -> None:
        sums, rows = input_power(x)
        if rows == 0:  # an expert no token chose (the calibration block runs it on no rows)
            return
        power[name] = power.get(name, 0) + sums
        counts[name] = counts.get(name, 0) + rows

    return sink
