"""`llmopt generate MODEL --prompt TEXT`: stream a completion from the built-in runtime, then metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmopt.cli.common import DeviceOpt, JsonOpt, VerboseOpt, emit_json, err, out, settings
from llmopt.errors import InputError, OptionError


# Options shared with `llmopt eval`.
DTypeOpt = Annotated[str, typer.Option("--dtype", help="auto | float32 | float16 | bfloat16 (auto: float32 on CPU, bfloat16 on CUDA).")]
ThreadsOpt = Annotated[int, typer.Option("--threads", help="CPU threads for torch (0 = torch's default).")]
KeepQuantizedOpt = Annotated[bool, typer.Option("--keep-quantized", help="GGUF on CPU: keep the weights quantized in "
                                                "memory even when dequantized they would fit (decode faster, prefill "
                                                "slower, the first step compiles the products). --compile implies it.")]
PackedOpt = Annotated[bool, typer.Option("--packed-int4/--dequantize", help="GPTQ/AWQ: keep weights packed "
                                         "(bit planes; with --dtype bfloat16 4-bit layers take the int4 kernel, "
                                         "faster, not exact) or dequantize them. "
                                         "GGUF on CPU stays quantized in memory when dequantized it would not fit "
                                         "(half the available memory); --dequantize always dequantizes.")]


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise OptionError("give exactly one of <prompt> TEXT or <prompt_file> FILE")
    if prompt_file is None:
        return prompt or ""
    if str(prompt_file) == "-":
        return sys.stdin.read()
    try:
        return prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{prompt_file}: cannot read prompt ({e.__class__.__name__}: {e})") from None


def parse_layers(text: str) -> list[int]:
    """`--skip-layers 3,5,7` as layer numbers."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise OptionError(f"<skip_layers> {text!r}: expected layer numbers separated by commas, e.g. 3,5,7") from None


def generate_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="A .gguf file, an HF directory (float or GPTQ) or a hub id.")],
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="Read the prompt from a file ('-' = stdin).")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most new tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t", help="0 = greedy (deterministic).")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Keep the smallest set with this much probability (1 = off).")] = 1.0,
    min_p: Annotated[float, typer.Option("--min-p", help="Drop tokens below min_p x the top probability (0 = off).")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty", help="Penalize tokens already seen (1 = off).")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed: the same seed gives the same text.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when this text appears (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep going past the end-of-sequence token.")] = False,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message (with --chat).")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", help="Draft model for speculative decoding (same tokenizer).")] = None,
    num_draft: Annotated[int, typer.Option("--num-draft", "-k", help="Tokens drafted per verification step.")] = 4,
    prompt_lookup: Annotated[int, typer.Option("--prompt-lookup", help="Speculate by matching the last N-gram in the text so far (0 = off).")] = 0,
    self_speculative: Annotated[bool, typer.Option("--self-speculative", help="Speculate with the model itself, some "
                                                   "layers skipped (chosen by a short search on the prompt).")] = False,
    skip_layers: Annotated[Optional[str], typer.Option("--skip-layers", help="With --self-speculative: the layers to "
                                                       "skip, e.g. 3,5,7 (instead of the search; implies it).")] = None,
    threads: ThreadsOpt = 0,
    packed: PackedOpt = True,
    keep_quantized: KeepQuantizedOpt = False,
    dtype: DTypeOpt = "auto",
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", help="Prompt tokens per prefill forward pass.")] = 512,
    compile_step: Annotated[bool, typer.Option("--compile", help="torch.compile the decode step (CUDA graphs on GPU), "
                                               "before prefill (up to a minute; reported apart). On CPU it pays on a "
                                               "GGUF, which it keeps quantized, not on float weights.")] = False,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Many prompts at once: a JSON-lines file, one "
                                                    "{\"prompt\": ...} a line (plus optional max_tokens, seed, temperature, "
                                                    "stop, ...), answered with continuous batching.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="With --prompts: write the answers here "
                                                   "(JSON lines, in input order) instead of stdout.")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="With --prompts: most sequences decoded at once.")] = 16,
    kv_blocks: Annotated[int, typer.Option("--kv-blocks", help="With --prompts: KV-cache blocks in the pool "
                                           "(0 = enough for --max-batch requests at once).")] = 0,
    block_size: Annotated[int, typer.Option("--block-size", help="With --prompts: tokens per KV-cache block.")] = 16,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
) -> None:
    """Generate text with the built-in runtime (KV cache; optional speculative decoding; --prompts for a batch)."""
    from llmopt.api.generate import check_options, generate, load  # here, not at the top: `llmopt --help` starts without torch
    from llmopt.runtime.weights import gguf_quantized_for, set_threads

    opts = settings(ctx, json_out, device, verbose)
    set_threads(threads)
    if keep_quantized and not packed:
        raise OptionError("give one of <keep_quantized> and <dequantize>")
    keep = gguf_quantized_for(keep_quantized, compile_step) if packed else None
    if prompts is not None:
        if prompt is not None or prompt_file is not None:
            raise OptionError("give <prompts> FILE, or one of <prompt> TEXT and <prompt_file> FILE, not both")
        if draft or compile_step or self_speculative or skip_layers is not None:
            raise OptionError("<prompts> runs a batch; <draft>, <self_speculative> and <compile> run one sequence "
                              "(use <prompt_lookup>)")
        return generate_many(model, prompts, output, opts, dict(
            max_batch=max_batch, kv_blocks=kv_blocks, block_size=block_size, max_tokens=max_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
            seed=seed, stop=stop or [], ignore_eos=ignore_eos, chat=chat, system=system, num_draft=num_draft,
            prompt_lookup=prompt_lookup, prefill_chunk=prefill_chunk, dtype=dtype, packed=packed, keep_quantized=keep))
    if output is not None:
        raise OptionError("<output> writes the answers of <prompts>; with one prompt the text goes to stdout")
    text = read_prompt(prompt, prompt_file)
    layers = parse_layers(skip_layers) if skip_layers is not None else None
    check_options(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                  chat=chat, system=system, draft=draft, num_draft=num_draft, prompt_lookup=prompt_lookup,
                  self_speculative=self_speculative, skip_layers=layers, prefill_chunk=prefill_chunk,
                  max_tokens=max_tokens, seed=seed)  # fmt: skip
    target = load(model, dtype=dtype, device=opts.device, packed=packed, keep_quantized=keep)
    on_text = None if opts.json else (lambda piece: out.print(piece, end="", markup=False, highlight=False, soft_wrap=True))
    result = generate(target, text, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop or [],
                      ignore_eos=ignore_eos, chat=chat, system=system, draft=draft, num_draft=num_draft,
                      prompt_lookup=prompt_lookup, self_speculative=self_speculative, skip_layers=layers,
                      prefill_chunk=prefill_chunk, compile=compile_step, dtype=dtype,
                      device=opts.device, packed=packed, keep_quantized=keep, on_text=on_text)  # fmt: skip
    if opts.json:
        emit_json({"text": result.text, "tokens": result.token_ids, "metrics": result.metrics.to_dict(),
                   "model": target.path, "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch.")})
    else:
        out.print()
        err.print(f"[dim]{result.metrics.line()}[/]")


def generate_many(model: str, prompts: Path, output: Path | None, opts, options: dict) -> None:
    """`--prompts`: every request answered (JSON lines in input order, to `output` written whole, or
    to stdout), then a summary line on stderr (or a JSON object on stdout with --json and -o)."""
    from llmopt.api.generate import generate_batch, read_prompts
    from llmopt.formats.atomic import atomic_output_file

    if options["max_batch"] < 1:  # before reading anything
        raise OptionError(f"<max_batch> must be at least 1, got {options['max_batch']}")
    entries, labels = read_prompts(prompts)

    def answers(batch) -> str:
        lines = []
        for i, (entry, result) in enumerate(zip(entries, batch.results)):
            record = {"id": entry["id"]} if "id" in entry else {}
            record.update(index=i, text=result.text, tokens=result.token_ids, metrics=result.metrics.to_dict())
            lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        return "".join(lines)

    if output is not None:
        with atomic_output_file(output) as tmp:  # the target is checked before any work; written only when complete
            batch = generate_batch(model, entries, labels=labels, device=opts.device, **options)
            tmp.write_text(answers(batch), encoding="utf-8")
    else:
        batch = generate_batch(model, entries, labels=labels, device=opts.device, **options)
        sys.stdout.write(answers(batch))
    prompt_tok = sum(r.metrics.prompt_tokens for r in batch.results)
    cached = sum(r.metrics.cached_tokens or 0 for r in batch.results)
    generated = sum(r.metrics.generated_tokens for r in batch.results)
    summary = {"requests": len(batch.results), "prompt_tokens": prompt_tok, "cached_tokens": cached,
               "generated_tokens": generated, "seconds": round(batch.seconds, 3),
               "tokens_per_s": round(generated / max(batch.seconds, 1e-9), 2), "forwards": batch.forwards,
               "preemptions": batch.preemptions, "kv_blocks": batch.kv_blocks, "block_size": batch.block_size}
    if opts.json and output is not None:
        emit_json({**summary, "output": str(output)})
    else:
        err.print(f"[dim]{summary['requests']} requests | prompt {prompt_tok} tok ({cached} from the prefix cache) | "
                  f"generated {generated} tok | {batch.seconds:.1f} s | {summary['tokens_per_s']:.1f} tok/s | "
                  f"{batch.forwards} forwards | {batch.preemptions} preemptions[/]", soft_wrap=True)
