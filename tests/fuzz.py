"""A seeded mutation fuzzer for the readers: GGUF files, HF folders (config, weights, tokenizer),
GPTQ and AWQ checkpoints and imatrix files.

Each case mutates one file of a small valid model (bytes flipped, numbers overwritten, the file cut,
JSON values replaced by other types), then reads everything a command would (architecture, every
tensor, the tokenizer). A case passes when reading succeeds or raises llmopt's own input error;
any other exception, a case slower than the time limit, or an allocation beyond the memory limit
(RLIMIT_DATA, 1 GiB above what the process holds when fuzzing starts) is a failure, printed with
the reader, seed and case number that replay it.

    python -m tests.fuzz WORKDIR --gguf M.gguf --hf DIR --gptq DIR --awq DIR --imatrix I.gguf --cases 3000 --seed 0
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import resource
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

INTERESTING = [0, 1, 2, 3, 7, 31, 32, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**64 - 1]
JSON_VALUES: list[Any] = [None, -1, 0, 1, 3, 2**31, 2**63, 1e308, -1e308, 0.5, True, False, "", "x", "four", [], [1], {}, {"a": 1}]


class Hang(Exception):
    pass


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        head = min(len(buf), 8192)  # most structure lives in the header
        if not buf:
            break
        if kind < 0.35:
            i = rng.randrange(head if rng.random() < 0.8 else len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif kind < 0.7:
            width = rng.choice((1, 2, 4, 8))
            i = rng.randrange(max(1, min(len(buf), head) - width))
            value = rng.choice(INTERESTING) % (1 << (8 * width))
            buf[i:i + width] = value.to_bytes(width, "little")
        elif kind < 0.85:
            del buf[rng.randrange(len(buf)):]
        else:
            i, j = sorted(rng.randrange(head) for _ in range(2))
            buf[i:i] = buf[i:j][:256]
    return bytes(buf)


def mutate_json(text: str, rng: random.Random) -> str:
    if rng.random() < 0.15:
        return mutate_bytes(text.encode(), rng).decode("utf-8", errors="surrogateescape")
    try:
        data = json.loads(text)
    except ValueError:
        return text
    for _ in range(rng.randint(1, 3)):
        node, path = data, []
        while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
            key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
            if not isinstance(node[key], (dict, list)) or rng.random() < 0.3:
                path.append(key)
                break
            path.append(key)
            node = node[key]
        if not path:
            data = copy.deepcopy(rng.choice(JSON_VALUES))
            continue
        parent = data
        for k in path[:-1]:
            parent = parent[k]
        if isinstance(parent, dict) and rng.random() < 0.2:
            parent.pop(path[-1], None)
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(JSON_VALUES))
    return json.dumps(data)


def read_model(path: Path) -> None:
    """Everything a command reads of a model: architecture, every tensor, the tokenizer."""
    from llmopt.model import open_model

    with open_model(path) as source:
        _ = source.arch.to_dict()
        for name in list(source.tensors):
            source.load(name)
        tok = source.tokenizer()
        if tok is not None:
            tok.encode("Hello, world 123")


def read_imatrix(path: Path) -> None:
    from llmopt.formats.imatrix import read_imatrix as read

    read(path).importance()


def cases(args: argparse.Namespace) -> list[tuple[str, Path, str]]:
    """(reader, the valid source, the file inside it to mutate)."""
    out = []
    if args.gguf:
        out.append(("gguf", Path(args.gguf), ""))
    if args.imatrix:
        out.append(("imatrix", Path(args.imatrix), ""))
    for kind, folder in (("hf", args.hf), ("gptq", args.gptq), ("awq", getattr(args, "awq", None))):
        if folder:
            for file in sorted(p.name for p in Path(folder).iterdir() if p.suffix in (".json", ".safetensors")):
                out.append((kind, Path(folder), file))
    return out


def run_case(reader: str, source: Path, file: str, seed: int, index: int, work: Path, timeout: float) -> str | None:
    """"read" or "refused" when the case passes, else what went wrong."""
    from llmopt.errors import LlmoptError

    rng = random.Random(f"{seed}:{index}")
    target = work / f"case-{reader}"
    if target.exists():
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    if source.is_dir():
        shutil.copytree(source, target)
        victim = target / file
        data = victim.read_bytes()
        victim.write_bytes(mutate_json(data.decode(), rng).encode("utf-8", errors="surrogateescape")
                           if file.endswith(".json") else mutate_bytes(data, rng))  # fmt: skip
    else:
        target = target.with_suffix(source.suffix)
        target.write_bytes(mutate_bytes(source.read_bytes(), rng))

    def hang(signum: int, frame: Any) -> None:
        raise Hang

    signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        (read_imatrix if reader == "imatrix" else read_model)(target)
    except LlmoptError as e:
        return f"a multi-line error: {str(e)[:200]!r}" if "\n" in str(e) else "refused"
    except Hang:
        return f"no answer within {timeout} s"
    except MemoryError:
        return "an allocation beyond the memory limit"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - this is what the fuzzer looks for (Rust panics included)
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return f"{type(e).__name__} at {Path(frame.filename).name}:{frame.lineno}: {str(e)[:160]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return "read"


def limit_memory(extra: int = 1 << 30) -> None:
    """Cap private memory at what the process holds now plus `extra` bytes (RLIMIT_DATA)."""
    held = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            held = int(line.split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (held + extra, resource.RLIM_INFINITY))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work", type=Path)
    parser.add_argument("--gguf")
    parser.add_argument("--hf")
    parser.add_argument("--gptq")
    parser.add_argument("--imatrix")
    parser.add_argument("--awq")
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--replay", default="[]", help="JSON list of [reader, file, seed, index] to run first")
    args = parser.parse_args()
    import llmopt.model.gguf_file  # noqa: F401 - import what the readers need before the memory cap
    import llmopt.formats.imatrix  # noqa: F401
    import llmopt.model.quantized_dir  # noqa: F401

    args.work.mkdir(parents=True, exist_ok=True)
    sources = cases(args)
    by_key = {(r, f): s for r, s, f in sources}
    limit_memory()
    start = time.perf_counter()
    failures, sites, ran, outcomes = [], set(), 0, {"read": 0, "refused": 0}
    plan = [(r, f, s, i) for r, f, s, i in json.loads(args.replay)]
    plan += [(*[(r, f) for r, _, f in sources][i % len(sources)], args.seed, i) for i in range(args.cases)]
    for reader, file, seed, index in plan:
        problem = run_case(reader, by_key[(reader, file)], file, seed, index, args.work, args.timeout)
        ran += 1
        if problem in outcomes:
            outcomes[problem] += 1
        else:
            failures.append({"reader": reader, "file": file, "seed": seed, "index": index, "problem": problem})
            sites.add(problem.split(":")[0] + ":" + problem.split(":")[1] if " at " in problem else problem[:40])
    print(json.dumps({"cases": ran, **outcomes, "seconds": round(time.perf_counter() - start, 2), "failures": failures,
                      "distinct_sites": sorted(sites)}))  # fmt: skip
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
