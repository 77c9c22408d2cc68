#!/usr/bin/env bash
# The tensor-parallel GPU checks on nvidia-h200-x2, in three device calls (10 minutes each):
#   benchmarks/tp_h200x2.sh tests   # the 2-GPU tests (the single-GPU suite: h100_checks.sh)
#   benchmarks/tp_h200x2.sh bench-llama-8b   # (and bench-llama-1.5b) decode step, TP=1 vs TP=2, NCCL vs measured symmetric
# Writes logs and JSON under $OUT (or ./out). NVLink multicast stays off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
case "${1:-}" in
tests)
    # -v/-rfE with a per-test timeout (pytest-timeout is on the device): a hung test fails
    # alone and the summary with every failure's cause is printed before the call's limit.
    # The dead-worker tests run last: a process killed with NCCL kernels in flight can
    # leave its GPU busy for the tests after it.
    args=(-v -rfE --tb=short -m gpu -p no:cacheprovider --timeout=200 --durations=15)
    timeout 400 python3 -m pytest "${args[@]}" tests/test_gpu_distributed.py \
        -k "not dead_worker" 2>&1 | tee "$OUT/gpu_tests.log"
    timeout 150 python3 -m pytest "${args[@]}" tests/test_gpu_distributed.py \
        -k dead_worker 2>&1 | tee -a "$OUT/gpu_tests.log"
    ;;
bench-*)
    variants="eager,ostinato FULL,ostinato FULL_AND_PIECEWISE"
    for shape in "${1#bench-}"; do
        for tp in 1 2; do
            ar=nccl
            [ "$tp" = 2 ] && ar=nccl,auto
            timeout 280 python3 -m ostinato.bench --tp "$tp" --shape "$shape" --no-profile \
                --variants "$variants" --all-reduce "$ar" --repeats 30 \
                --out "$OUT/decode_tp_${shape}_tp${tp}_h200.json" 2>&1 | tee -a "$OUT/bench.log"
        done
    done
    ;;
*)
    echo "usage: $0 tests|bench-llama-8b|bench-llama-1.5b" >&2
    exit 2
    ;;
esac
