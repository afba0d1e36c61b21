"""Every option of the commands, declared once: type, default, range, choices, help and flag.

A command's options are a frozen dataclass (an `Options` subclass) whose fields are declared with
`option(...)`. From that one declaration come the Python API's keywords and defaults
(`QuantizeOptions.of(bits=3)` checks type and range), the CLI's flags (`cli/signature.py` builds
each command's Typer parameters from it) and the recipe schema (`api/recipe/schema.py` builds its
pydantic models from it). Rules that relate several options, or an option and a format, live in
each command's `prepare` (api/quantize.py, api/convert.py), which the API, the CLI and the recipe
preflight all call. Importable without torch or pydantic: every command line reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from llmopt.errors import OptionError
from llmopt.names import CALIB_DTYPES, CALIBRATED_SCHEMES, CHECKPOINT_FORMATS, FLOAT_DTYPES, METHODS, SCHEMES, SYM_SCALES

# An options class: an immutable value with no generated __eq__ or __repr__ (there are twenty such classes
# and every command line defines them all: each generated method is start-up time).
_options = dataclass(frozen=True, eq=False, repr=False)
GGUF_METHODS: tuple[str, ...] = tuple(m for m in METHODS if m != "rtn")  # calibrated roundings onto GGUF types


@dataclass(frozen=True)
class Spec:
    """What an option is besides its type and default: help, range, choices, flag, recipe name."""

    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    hint: str | None = None  # what the range error says ("choose 2 to 8"); default: the interval
    flags: tuple[str, ...] = ()  # CLI flags; default: --name-with-dashes. "--a/--b" for an on/off pair
    recipe: str | None = None  # its key in a recipe when it differs from the API's keyword
    show_default: bool = True

    def interval(self) -> str:
        lo = f"[{_number(self.ge)}" if self.ge is not None else f"({_number(self.gt)}" if self.gt is not None else "(-inf"
        hi = f"{_number(self.le)}]" if self.le is not None else f"{_number(self.lt)})" if self.lt is not None else "inf)"
        return f"{lo}, {hi}"

    def check(self, name: str, value: Any) -> None:
        if value is None:
            return
        if self.choices is not None and value not in self.choices:
            raise OptionError(f"<{name}> {value!r}: choose one of {', '.join(self.choices)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            low_ok = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
            high_ok = (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
            if not (low_ok and high_ok):
                raise OptionError(f"<{name}> {value}: {self.hint or 'expected a value in ' + self.interval()}")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def option(default: Any, help: str, **spec: Any) -> Any:
    """A field of an `Options` dataclass: its default and its `Spec`."""
    factory = {"default_factory": lambda: default} if isinstance(default, (list, dict)) else {"default": default}
    return field(metadata={"option": Spec(help, **spec)}, **factory)


@dataclass(frozen=True)
class Declared:
    """One option as the CLI and the recipe schema read it."""

    name: str
    type: Any  # the annotation, resolved (int, float | None, tuple[str, ...], ...)
    default: Any
    spec: Spec

    @property
    def flag(self) -> str:
        """The flag a user types to set it (its first one, the 'on' side of a pair)."""
        return self.spec.flags[0].split("/")[0] if self.spec.flags else "--" + self.name.replace("_", "-")


O = typing.TypeVar("O", bound="Options")



@_options
class Options:
    """A command's options: construct with `of(**values)`, which checks every value."""

    command: ClassVar[str] = ""

    @classmethod
    def of(cls: type[O], **values: Any) -> O:
        known = {d.name: d for d in cls.declared()}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise OptionError(f"<{unknown[0]}>: not an option of {cls.command or cls.__name__}")
        for name, value in values.items():
            check_type(name, value, known[name].type)
            known[name].spec.check(name, value)
        return cls(**values)

    @classmethod
    @functools.cache
    def declared(cls) -> tuple[Declared, ...]:
        """Every option, the class's own first, then its groups' in the order they are listed."""
        hints = typing.get_type_hints(cls)
        owner = {name: i for i, klass in enumerate(cls.__mro__) for name in vars(klass).get("__annotations__", {})}
        fields = sorted(dataclasses.fields(cls), key=lambda f: owner[f.name])
        return tuple(Declared(f.name, hints[f.name], f.default if f.default is not dataclasses.MISSING else f.default_factory(),
                              f.metadata["option"]) for f in fields)  # fmt: skip

    @classmethod
    def merged(cls: type[O], options: Options | None, kwargs: dict[str, Any]) -> O:
        """The API's way in: `options` (this command's, or another's: only this class's fields are taken)
        with keyword arguments over them, checked."""
        names = {d.name for d in cls.declared()}
        given = {k: v for k, v in (options.changed() if options else {}).items() if k in names}
        return cls.of(**{**given, **kwargs})

    def values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def changed(self) -> dict[str, Any]:
        """The options given a value other than their default."""
        return {d.name: getattr(self, d.name) for d in self.declared() if getattr(self, d.name) != d.default}


def check_type(name: str, value: Any, annotation: Any) -> None:
    """Plain Python types only (what a CLI, a YAML file or a caller gives); an int is a float too."""
    allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else (annotation,)
    for t in allowed:
        origin = typing.get_origin(t) or t
        if t is type(None) and value is None or origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if origin in (int, float, str) and isinstance(value, origin) and not isinstance(value, bool) or origin is bool and isinstance(value, bool):
            return
        if origin is Path and isinstance(value, (str, Path)):
            return
        if origin in (tuple, list) and isinstance(value, (tuple, list)):
            item = (typing.get_args(t) or (str,))[0]
            if all(isinstance(v, item) and not isinstance(v, bool) for v in value):
                return
    raise OptionError(f"<{name}> {value!r}: expected {_type_name(annotation)}")


def _type_name(annotation: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", Path: "a path", type(None): "none"}
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return " or ".join(names.get(typing.get_origin(a) or a, "a list of strings") for a in args)


# ------------------------------------------------------------------------------------------- groups
@_options
class CalibFieldOptions(Options):
    calib_field: str | None = option(None, "Text field of .jsonl/.parquet records (default: text).",
                                     flags=("--calib-field", "--field"), recipe="field", show_default=False)  # fmt: skip


@_options
class CalibrationOptions(CalibFieldOptions):
    """The calibration samples of the calibrated methods (a recipe's `calibration:` section)."""

    calib: str | None = option(None, "Calibration text: a .txt/.jsonl/.parquet file, a preset (wikitext2, c4, pileval; "
                               "online), or 'self' (model-generated, the default).", recipe="data", show_default=False)
    nsamples: int = option(128, "Calibration samples.", ge=1, le=1_000_000)
    seqlen: int = option(512, "Tokens per calibration sample.", ge=1, le=1 << 20)
    seed: int = option(0, "Seed for sampling windows (and for --calib self).", ge=0, le=2**63 - 1)
    calib_dtype: str = option("auto", f"Calibrated methods: dtype of the calibration forward ({' | '.join(CALIB_DTYPES)}); "
                              "auto = bfloat16 where the device has it natively, else float32. Hessians and weights "
                              "stay float32.", choices=CALIB_DTYPES, recipe="dtype")  # fmt: skip


@_options
class RoundingOptions(Options):
    """The calibrated methods' own options (GPTQ's and AWQ's), shared by `quantize` and `convert --method`."""

    damp: float = option(0.01, "GPTQ: dampening, a fraction of the mean Hessian diagonal (raised automatically if needed).",
                         ge=0, lt=1, hint="choose a fraction in [0, 1)")  # fmt: skip
    damp_step: float = option(0.01, "GPTQ: added to --damp each time the Hessian's Cholesky factorization fails "
                              "(GPTQModel's damp_auto_increment).", gt=0, lt=1)  # fmt: skip
    act_order: bool = option(False, "GPTQ: quantize columns by decreasing activation energy (desc_act).")
    static_groups: bool = option(False, "GPTQ: choose group scales before quantizing (keeps groups contiguous under --act-order).")
    group_aware: bool | None = option(None, "GPTQ: act-order inside contiguous groups (GPTQModel's act_group_aware; no "
                                      "g_idx). On by default with groups, unless --act-order or --static-groups.",
                                      flags=("--group-aware-order/--no-group-aware-order",), show_default=False)  # fmt: skip
    gptaq: float = option(0.0, "GPTQ: pull each layer toward the full-precision model's output (GPTAQ / GPTQ v2), "
                          "strength in (0, 1]; 0 = off.", ge=0, le=1, hint="choose a strength in [0, 1] (0 = off)")  # fmt: skip
    clip: bool = option(True, "AWQ: search a clipping range per group (AutoAWQ's); --no-clip skips it.", flags=("--clip/--no-clip",))
    batch_size: int = option(8, "Calibration samples per forward pass (and per learned-rounding step).", ge=1, le=4096, hint="must be positive")
    iters: int = option(0, "Learned rounding: after the method, tune each block's codes and group scales for this many "
                        "signed-gradient steps against the float block's output (SignRound); 0 = off. Linears on "
                        "evenly spaced grids (integer, GGUF legacy and K types) and the levels of FP4 (--scheme nvfp4a16, nvfp4, "
                        "mxfp4a16) and FP8 (--scheme fp8, fp8-dynamic).", ge=0, le=100_000, hint="choose 0 (off) or a number of steps")  # fmt: skip
    lr: float | None = option(None, "Learned rounding's step size for the rounding offsets (default 1/--iters, at most "
                              "0.01), falling linearly to 0.", gt=0, le=1, hint="choose a step size in (0, 1]",
                              show_default=False)  # fmt: skip
    scale_lr: float | None = option(None, "Learned rounding's step size for the group scales' gains (default --lr from "
                                    "--method rtn, as AutoRound's minmax_lr; --lr / 5 from gptq, awq, awq+gptq).",
                                    ge=0, le=1, hint="choose a step size in [0, 1] (0: scales stay the method's)",
                                    show_default=False)  # fmt: skip


@_options
class AutomixOptions(Options):
    """The automatic mixed precision: each tensor's type (or bits) for the least predicted KL at a size."""

    target_bpw: float | None = option(None, "Automatic mix: choose each tensor's type (GGUF) or each layer's bits and "
                                      "group size (GPTQ, written as GPTQModel's `dynamic`) for the least predicted KL "
                                      "divergence at this many bits per weight.", gt=0, le=32,
                                      hint="expected bits per weight in (0, 32]", show_default=False)  # fmt: skip
    sensitivity_samples: int = option(32, "Automatic mix: calibration samples its sensitivities are measured on "
                                      "(cached beside -o).", ge=1, le=100_000, hint="must be at least 1")  # fmt: skip


@_options
class ShardOptions(Options):
    max_shard_size: str = option("5GB", "Largest safetensors shard, e.g. 5GB, 500MB.")


@_options
class ResumeOptions(Options):
    """Going on after a killed calibrated run (formats/resume.py)."""

    resume: bool = option(False, "Calibrated methods: continue a killed run of the same command from its last finished "
                                 "block (each block's result is kept beside the output until it is written).")


# ----------------------------------------------------------------------------------------- commands
@_options
class QuantizeOptions(CalibrationOptions, RoundingOptions, AutomixOptions, ShardOptions, ResumeOptions):
    """`llmopt quantize`: a GPTQ/AWQ (or dense) checkpoint made layer by layer (a recipe's gptq/awq/dense output)."""

    command: ClassVar[str] = "quantize"
    method: str | None = option(None, "gptq, awq, awq+gptq (AWQ's scales and clipping, then GPTQ's rounding): "
                                "calibrated; rtn: round to nearest, no data. Default: the format's own (awq for "
                                "--format awq, else gptq).", choices=METHODS, show_default=False)  # fmt: skip
    bits: int = option(4, "Bits per weight: 2-8 (GPTQ checkpoints: 2, 3, 4, 8).", ge=2, le=8, hint="choose 2 to 8")
    group_size: int = option(128, "Columns per scale: >0 per group, -1 per output channel, 0 per tensor (rtn).",
                             ge=-1, le=1 << 20, hint="use a positive size, -1 (per channel) or 0 (per tensor)")  # fmt: skip
    sym: bool | None = option(None, "Symmetric grid (no zero point) or asymmetric (zero point per group). Default: "
                              "--asym for awq methods, --sym otherwise.", flags=("--sym/--asym",), show_default=False)  # fmt: skip
    sym_scale: str | None = option(None, "Symmetric grid's scale: gptq (2·max|w|/(2^bits-1), GPTQ's convention) or "
                                   "tight (the smallest scale whose codes reach both the group's max and min, the "
                                   "extra negative code used). Default: tight for awq methods, gptq otherwise.", choices=SYM_SCALES, show_default=False)  # fmt: skip
    mse: bool = option(False, "Search a clipping range per group instead of min/max.")
    refit_scales: bool = option(False, "GPTQ: re-solve each group's scale for the final codes (least squares on the "
                                "layer's output error).")  # fmt: skip
    fmt: str | None = option(None, "gptq, awq or compressed-tensors (vLLM's pack-quantized, 4 or 8 bits): a packed "
                             "checkpoint (default: awq for awq methods, else gptq); dense: dequantized float16 "
                             "weights.", choices=CHECKPOINT_FORMATS, flags=("--format",),
                             recipe="format", show_default=False)  # fmt: skip
    quantize_head: bool = option(False, "Quantize the LM head too (embeddings and norms never are).")
    scheme: str | None = option(None, "fp8-dynamic: float8 e4m3 weights with a float32 scale per output channel, "
                                "activations quantized per token at run time (vLLM's FP8 W8A8); fp8: the same weights, "
                                "activations with one static scale per linear from --calib; nvfp4a16: FP4 (e2m1) "
                                "weights in groups of 16 with float8 scales under a per-tensor scale, activations "
                                "unquantized; nvfp4: the same weights, activations NVFP4 under a global scale from "
                                "--calib (W4A4); mxfp4a16: FP4 weights in groups of 32 under a power-of-two scale. "
                                "Rounds to nearest (fp8-dynamic, nvfp4a16, mxfp4a16: or --method gptq), written as "
                                "compressed-tensors (instead of --bits/--group-size/--sym).",
                                choices=SCHEMES, show_default=False)  # fmt: skip

    @property
    def method_name(self) -> str:
        """The method: as given, else the format's own (awq for an AWQ checkpoint; rtn for a scheme), else gptq."""
        return self.method or ("awq" if self.fmt == "awq" else "rtn" if self.scheme else "gptq")

    @property
    def calibrated(self) -> bool:
        """Whether quantize reads calibration data: a calibrated method, or a scheme whose activation scales are
        static (measured on the calibration tokens)."""
        return self.method_name != "rtn" or self.scheme in CALIBRATED_SCHEMES or self.iters > 0

    @property
    def format_name(self) -> str:
        """The checkpoint format: as given, else the scheme's or the method's own."""
        return self.fmt or ("compressed-tensors" if self.scheme else "awq" if self.method_name.startswith("awq") else "gptq")


@_options
class GgufOptions(CalibrationOptions, RoundingOptions, AutomixOptions, ResumeOptions):
    """`llmopt convert --to gguf`: a llama.cpp type or mix, by llama.cpp's searches or a calibrated method."""

    command: ClassVar[str] = "convert --to gguf"
    mix: str | None = option(None, "GGUF type/mix: {mixes} (default F16; with a target, the label of the file).",
                             flags=("--type",), recipe="type", show_default=False)  # fmt: skip
    imatrix: Path | None = option(None, "Importance matrix (llama.cpp GGUF or .dat).", show_default=False)
    tensor_types: tuple[str, ...] = option((), "REGEX=TYPE override (repeatable).", flags=("--tensor-type",),
                                           recipe="tensor_type", show_default=False)  # fmt: skip
    output_tensor_type: str | None = option(None, "Type of output.weight.", show_default=False)
    method: str | None = option(None, "Round the block linears with gptq, awq or awq+gptq (calibrated) onto the mix's "
                                "types instead of llama.cpp's searches.", choices=GGUF_METHODS, show_default=False)  # fmt: skip
    target_size: str | int | None = option(None, "Automatic mix: the least predicted KL divergence in at most this file "
                                           "size (95MB, 2GiB, bytes).", show_default=False)  # fmt: skip


@_options
class HfOptions(ShardOptions):
    """`llmopt convert --to hf`: a dense safetensors directory."""

    command: ClassVar[str] = "convert --to hf"
    dtype: str = option("float16", "Float type of the written weights.", choices=FLOAT_DTYPES)


@_options
class ImatrixOptions(CalibFieldOptions):
    """`llmopt imatrix`: llama-imatrix's settings."""

    command: ClassVar[str] = "imatrix"
    chunks: int | None = option(None, "Use at most this many chunks.", ge=1, le=1_000_000, show_default=False)
    ctx_size: int = option(512, "Tokens per chunk (llama-imatrix's -c).", ge=16, le=1 << 20, flags=("--ctx-size", "-c"),
                           hint="must be at least 16 (llama.cpp ignores smaller batches)")  # fmt: skip
    output_format: str = option("gguf", "gguf (default) or dat (legacy).", choices=("gguf", "dat"))


# ------------------------------------------------------------------------------ the runtime's commands
@_options
class DtypeOptions(Options):
    dtype: str = option("auto", "auto | float32 | float16 | bfloat16 (auto: float32 on CPU, bfloat16 on CUDA; on CPU "
                                "generate and bench hold the linears of a file not stored in float32 in float16, "
                                "float32 keeps them float32).",
                        choices=("auto", *FLOAT_DTYPES))  # fmt: skip


@_options
class KeepQuantizedOptions(Options):
    keep_quantized: bool | None = option(None, "GPTQ/AWQ/compressed-tensors and GGUF: keep the weights quantized in "
                                         "memory (--keep-quantized: bit planes, a GGUF type's fields, with --dtype "
                                         "bfloat16 the int4 kernel) or dequantize them into --dtype (--dequantize). "
                                         "Default: dequantized where that takes at most half the available memory "
                                         "(the faster path there), else quantized.",
                                         flags=("--keep-quantized/--dequantize",), show_default=False)  # fmt: skip


@_options
class CompileOptions(Options):
    compile: bool = option(False, "torch.compile the decode step (CUDA graphs on GPU; bench: batch 1), before prefill "
                           "(up to a minute; reported apart). On CPU it pays on quantized weights, which it keeps "
                           "quantized unless --dequantize, not on float ones.")  # fmt: skip


def quantized_in_memory(keep_quantized: bool | None, compile: bool) -> bool | None:
    """The runtime's `quantized` (runtime/weights.build_decoder) for a command's flags: as asked, else True for
    a compiled decode step (it pays on quantized products, not on float ones), else None: the memory rule."""
    return True if keep_quantized is None and compile else keep_quantized


@_options
class ThreadsOptions(Options):
    threads: int = option(0, "CPU threads for torch (0 = torch's default).", ge=0)


@_options
class LoadOptions(DtypeOptions, KeepQuantizedOptions, CompileOptions):
    """How `generate` loads a model into the runtime (`eval` and `bench` take some of these)."""


@_options
class SamplingOptions(Options):
    """How the next token is chosen and when a sequence stops (per request too, in `--prompts`)."""

    max_tokens: int = option(256, "Most new tokens to generate.", flags=("--max-tokens", "-n"), ge=1,
                             hint="must be at least 1")  # fmt: skip
    temperature: float = option(0.0, "0 = greedy (deterministic).", flags=("--temperature", "-t"))
    top_k: int = option(0, "Keep the k most likely tokens (0 = off).")
    top_p: float = option(1.0, "Keep the smallest set with this much probability (1 = off).")
    min_p: float = option(0.0, "Drop tokens below min_p x the top probability (0 = off).")
    repetition_penalty: float = option(1.0, "Penalize tokens already seen (1 = off).")
    seed: int | None = option(None, "Random seed: the same seed gives the same text.", ge=0, lt=2**64,
                              hint="expected 0 to 2**64 - 1 (torch's generator seed)", show_default=False)  # fmt: skip
    stop: tuple[str, ...] = option((), "Stop when this text appears (repeatable).", show_default=False)
    ignore_eos: bool = option(False, "Keep going past the end-of-sequence token.")


@_options
class GenerateOptions(SamplingOptions, LoadOptions):
    """`llmopt generate`: one prompt (speculative decoding optional) or many (`--prompts`, continuous batching)."""

    command: ClassVar[str] = "generate"
    chat: bool = option(False, "Wrap the prompt in the model's chat template.")
    system: str | None = option(None, "System message (with --chat).", show_default=False)
    draft: str | None = option(None, "Draft model for speculative decoding (same tokenizer).", show_default=False)
    num_draft: int = option(4, "Tokens drafted per verification step.", flags=("--num-draft", "-k"), ge=1)
    prompt_lookup: int = option(0, "Speculate by matching the last N-gram in the text so far (0 = off).", ge=0)
    self_speculative: bool = option(False, "Speculate with the model itself, some layers skipped (chosen by a short "
                                    "search on the prompt).")  # fmt: skip
    prefill_chunk: int = option(512, "Prompt tokens per prefill forward pass.", ge=1)
    max_batch: int = option(16, "With --prompts: most sequences decoded at once.", ge=1, hint="must be at least 1")
    kv_blocks: int = option(0, "With --prompts: KV-cache blocks in the pool (0 = enough for --max-batch requests at once).", ge=0)
    block_size: int = option(16, "With --prompts: tokens per KV-cache block.", ge=1)


@_options
class EvalOptions(DtypeOptions, KeepQuantizedOptions):
    """`llmopt eval`: perplexity, KL and top-1 over windows of a text; quality gates (a recipe's `eval:` too)."""

    command: ClassVar[str] = "eval"
    ctx: int = option(512, "Tokens per window.", ge=2, le=1 << 20)
    windows: int = option(40, "Number of windows from the start of the text (0 = all).", ge=0, le=1_000_000)
    max_ppl_increase: float | None = option(None, "Gate: fail if perplexity rises more than PCT % over --ref.", ge=0,
                                            show_default=False)  # fmt: skip
    min_top1: float | None = option(None, "Gate: fail if top-1 agreement with --ref is below PCT %.", ge=0, le=100,
                                    show_default=False)  # fmt: skip
    max_kld: float | None = option(None, "Gate: fail if the mean KL divergence from --ref exceeds NATS per token.", ge=0,
                                   show_default=False)  # fmt: skip
    batch: int = option(1, "Windows per forward pass (same numbers; faster where one window leaves the device idle).",
                        ge=1, le=1024, hint="windows per forward must be between 1 and 1024")  # fmt: skip
    stream: bool | None = option(None, "Run each model one block at a time over all windows, for models that do not fit "
                                 "in memory (the same numbers; weights dequantized as read). Default: when the model and "
                                 "--ref at --dtype would not fit in 3/4 of the memory available.",
                                 flags=("--stream/--no-stream",), show_default=False)  # fmt: skip


@_options
class BenchOptions(DtypeOptions, KeepQuantizedOptions, CompileOptions, ThreadsOptions):
    """`llmopt bench`: a sweep of prompt lengths x batch sizes (or a server's concurrency)."""

    command: ClassVar[str] = "bench"
    engine: str | None = option(None, "llmopt (the built-in runtime) | llama.cpp (llama-cpp-python, a .gguf) (default llmopt)",
                                show_default=False)  # fmt: skip
    endpoint: str | None = option(None, "An OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8080/v1 "
                                  "(streaming /completions).", show_default=False)  # fmt: skip
    served_model: str | None = option(None, "With --endpoint: the model name to ask for (default: the first the "
                                      "server lists).", flags=("--model",), show_default=False)  # fmt: skip
    prompt_len: str | tuple[int, ...] = option("128", "Prompt lengths in tokens, comma-separated.")
    gen: int = option(128, "Tokens to generate per sequence (EOS ignored in-process).", ge=1, le=1 << 20,
                      hint="must be between 1 and 1048576")  # fmt: skip
    batch: str | tuple[int, ...] | None = option(None, "Batch sizes (sequences decoded in lockstep), comma-separated "
                                                 "(default 1)", show_default=False)  # fmt: skip
    concurrency: str | tuple[int, ...] | None = option(None, "With --endpoint: requests in flight, comma-separated "
                                                       "(default 1)", show_default=False)  # fmt: skip
    requests: int = option(64, "With --endpoint: requests per prompt length and concurrency.", ge=1, le=100_000,
                           hint="must be between 1 and 100000")  # fmt: skip
    time_limit: float = option(600.0, "With --endpoint: stop sending after this many seconds per sweep point.", gt=0,
                               hint="must be > 0 seconds")  # fmt: skip
    seed: int = option(0, "Seed of the synthetic prompts (the same ids for every engine).", ge=0, hint="must be >= 0")
    bandwidth: str | float | None = option(None, "Memory bandwidth for the roofline: GB/s or a GPU name (recommend's "
                                           "catalog); default: measured here", show_default=False)  # fmt: skip


COMMAND_OPTIONS: tuple[type[Options], ...] = (QuantizeOptions, GgufOptions, HfOptions, ImatrixOptions, GenerateOptions,
                                              EvalOptions, BenchOptions)  # fmt: skip
