#!/usr/bin/env bash
# The scale benchmark on a lent NVIDIA GPU, one call of under 10 minutes: each command with one block
# on the GPU at a time (--device cuda), the Llama-3.1-8B shape written there (16 GB of its disk),
# a small calibration (8 x 256 tokens), imatrix over all 32 layers, the other commands over 4 layers
# at full width (their per-block times and RSS are flat in depth: the CPU table shows it).
# Run here from the repository root after `make install`: it fetches the wheels and prints the call.
set -euo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_wheels.sh  # .whl/ and $install
du -sh .whl
cat <<EOF
One call (carry .whl; timeout_s 590):
  $install && nvidia-smi --query-gpu=name,memory.total --format=csv && python3 benchmarks/scale.py --device cuda --work /tmp/scale --keep --layers 4 imatrix=32 --commands imatrix convert automix awq gptq eval --timeout 150 --json \$OUT/scale_cuda.json 2>&1 | tee \$OUT/scale_cuda.log
EOF
