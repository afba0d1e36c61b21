#!/usr/bin/env bash
# Prepares benchmarks/runtime_cuda.py for a lent GPU machine that can reach nothing and is sent at most
# 64 MiB a call: the Python packages llmopt needs that its image lacks (as wheels for its Python 3.12,
# the versions installed here), and SmolLM2's GGUF (94 MiB) in two halves, one for each of two calls.
# Run here from the repository root after `make install`; it prints the two commands to run there.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_wheels.sh  # .whl/ and $install
rm -rf .dev && mkdir -p .dev/a .dev/b
smol=$($PY -c "from llmopt.model.embedded import smollm2_gguf; print(smollm2_gguf())")
half=$(( ($(stat -c %s "$smol") + 1) / 2 ))
head -c "$half" "$smol" > .dev/a/smollm2.part
tail -c +"$((half + 1))" "$smol" > .dev/b/smollm2.part
sum=$(sha256sum "$smol" | cut -c1-64)
du -sh .whl .dev/a .dev/b
cat <<EOF
Call 1 (carry .whl .dev/a; the 8B-shaped numbers, ~5 min): keeps the first half on the machine
  mkdir -p /tmp/llmopt && cp .dev/a/smollm2.part /tmp/llmopt/a && $install && python3 benchmarks/runtime_cuda.py roofline q4km gptq8b 2>&1 | tee \$OUT/roofline.jsonl
Call 2, within the machine's warm time after call 1 (carry .whl .dev/b; correctness, ~4 min):
  test -f /tmp/llmopt/a || { echo "machine went cold: first half gone"; exit 3; }; cat /tmp/llmopt/a .dev/b/smollm2.part > /tmp/llmopt/smollm2.gguf && echo "$sum  /tmp/llmopt/smollm2.gguf" | sha256sum -c && $install && python3 benchmarks/runtime_cuda.py grids gptq smollm2 decode --smollm2 /tmp/llmopt/smollm2.gguf 2>&1 | tee \$OUT/checks.jsonl
EOF
