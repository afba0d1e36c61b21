"""`llmopt generate MODEL --prompt TEXT`: stream a completion from the built-in runtime, then metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmopt.cli.common import DeviceOpt, JsonOpt, VerboseOpt, emit_json, err, out, settings
from llmopt.cli.signature import option_values, with_options
from llmopt.errors import InputError, OptionError
from llmopt.options import GenerateOptions, ThreadsOptions


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


@with_options(GenerateOptions, ThreadsOptions)
def generate_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="A .gguf file, an HF directory (float or GPTQ) or a hub id.")],
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="Read the prompt from a file ('-' = stdin).")] = None,
    skip_layers: Annotated[Optional[str], typer.Option("--skip-layers", help="With --self-speculative: the layers to "
                                                       "skip, e.g. 3,5,7 (instead of the search; implies it).")] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Many prompts at once: a JSON-lines file, one "
                                                    "{\"prompt\": ...} a line (plus optional max_tokens, seed, temperature, "
                                                    "stop, ...), answered with continuous batching.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="With --prompts: write the answers here "
                                                   "(JSON lines, in input order) instead of stdout.")] = None,
    json_out: JsonOpt = False,
    device: DeviceOpt = None,
    verbose: VerboseOpt = 0,
    **options: Any,
) -> None:
    """Generate text with the built-in runtime (KV cache; optional speculative decoding; --prompts for a batch)."""
    from llmopt.api.generate import check_options, generate, load  # here, not at the top: `llmopt --help` starts without torch
    from llmopt.runtime.weights import set_threads

    opts = settings(ctx, json_out, device, verbose)
    set_threads(ThreadsOptions.of(**option_values(options, ThreadsOptions)).threads)
    o = GenerateOptions.of(**option_values(options, GenerateOptions))
    if prompts is not None:
        if prompt is not None or prompt_file is not None:
            raise OptionError("give <prompts> FILE, or one of <prompt> TEXT and <prompt_file> FILE, not both")
        if o.draft or o.compile or o.self_speculative or skip_layers is not None:
            raise OptionError("<prompts> runs a batch; <draft>, <self_speculative> and <compile> run one sequence "
                              "(use <prompt_lookup>)")
        return generate_many(model, prompts, output, opts, o)
    if output is not None:
        raise OptionError("<output> writes the answers of <prompts>; with one prompt the text goes to stdout")
    text = read_prompt(prompt, prompt_file)
    layers = parse_layers(skip_layers) if skip_layers is not None else None
    check_options(o, layers)
    target = load(model, o, device=opts.device)
    on_text = None if opts.json else (lambda piece: out.print(piece, end="", markup=False, highlight=False, soft_wrap=True))
    result = generate(target, text, o, skip_layers=layers, device=opts.device, on_text=on_text)
    if opts.json:
        emit_json({"text": result.text, "tokens": result.token_ids, "metrics": result.metrics.to_dict(),
                   "model": target.path, "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch.")})
    else:
        out.print()
        err.print(f"[dim]{result.metrics.line()}[/]")


def generate_many(model: str, prompts: Path, output: Path | None, opts, options: GenerateOptions) -> None:
    """`--prompts`: every request answered (JSON lines in input order, to `output` written whole, or
    to stdout), then a summary line on stderr (or a JSON object on stdout with --json and -o)."""
    from llmopt.api.generate import generate_batch, read_prompts
    from llmopt.formats.atomic import atomic_output_file

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
            batch = generate_batch(model, entries, options, labels=labels, device=opts.device)
            tmp.write_text(answers(batch), encoding="utf-8")
    else:
        batch = generate_batch(model, entries, options, labels=labels, device=opts.device)
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
