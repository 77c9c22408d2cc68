#!/usr/bin/env bash
# One device call: GPU tests, the whole suite, the demo, and the benchmarks; logs to $OUT.
# Usage (on the GPU host, from the repo root): OSTINATO_COMMIT=<sha> bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/ostinato-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
status=0
python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.log" || status=1
python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -3 | tee "$OUT/pytest_all.log" || status=1
python3 -m ostinato.engine demo 2>&1 | tee "$OUT/demo.log" || status=1
python3 -m benchmarks.host_overhead --out "$OUT/host_overhead_h100.json" 2>&1 | tee "$OUT/host_overhead.log" || status=1
exit $status
