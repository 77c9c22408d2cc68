#!/usr/bin/env bash
# The single-GPU checks of the engine on nvidia-h100-x1, one stage per device call:
#   benchmarks/h100_checks.sh tests    # the GPU suite without the 2-GPU and SmolLM2 files
#   benchmarks/h100_checks.sh kernels  # FULL_AND_PIECEWISE with PDL / small GEMMs, two shapes
#   benchmarks/h100_checks.sh smollm2  # the SmolLM2 parity file (needs the GGUF on PYTHONPATH)
#   benchmarks/h100_checks.sh bench    # decode step (engine-step rows, kernel counts) and bench e2e
#   benchmarks/h100_checks.sh spec     # bench spec (k=4) and bench e2e on SmolLM2 (needs the GGUF)
# Writes logs and JSON under $OUT (or ./out).
set -uo pipefail
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}
mkdir -p "$OUT"
case "${1:-}" in
tests)
    # One pytest per file, each under its own limit and in its own process: a failed
    # capture that leaves the device unusable takes down only its own file, and every
    # failure's cause is printed (-rfE). ``tests K`` runs the files matching K.
    files=$(ls tests/*/test_gpu_*.py tests/test_readme.py | grep -v -e smollm2 -e distributed \
        | grep -e "${2:-.}")
    for f in $files; do
        timeout 300 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
            --timeout=150 "$f" 2>&1 | tee -a "$OUT/gpu_tests.log" \
            | grep -E "PASSED|FAILED|ERROR|^E |Timeout|passed|failed"
    done
    ;;
kernels)
    # FULL_AND_PIECEWISE with each KernelOptions switch, on the 1.5 B and SmolLM2 shapes.
    # The two most compared variants first and side by side (the machine drifts).
    v="ostinato FULL_AND_PIECEWISE,ostinato FULL_AND_PIECEWISE layers-unfused pdl+small-gemm"
    v="$v,ostinato FULL_AND_PIECEWISE small-gemm,ostinato FULL_AND_PIECEWISE no-pdl"
    timeout 280 python3 -m benchmarks --batch-sizes 1,8,32,128 --repeats 30 --variants "$v" \
        --out "$OUT/kernels_h100.json" --plot "$OUT/kernels_h100.png" 2>&1 \
        | tee "$OUT/kernels.log"
    timeout 250 python3 -m benchmarks --batch-sizes 1,8,32,128 --repeats 30 --variants "$v" \
        --config benchmarks/configs/smollm2_135m.json --out "$OUT/kernels_smollm2_h100.json" \
        --plot "$OUT/kernels_smollm2_h100.png" 2>&1 | tee -a "$OUT/kernels.log"
    ;;
pieces)
    # generate with Inductor-compiled vs eager pieces (FULL_AND_PIECEWISE, 1.5 B shape):
    # decode-heavy (prompt 128, 128 new) and prefill-heavy (prompt 1024, 8 new).
    for c in inductor eager; do
        timeout 150 python3 -m benchmarks e2e --modes full_and_piecewise --no-transformers \
            --piece-compiler "$c" --out "$OUT/e2e_pieces_${c}_decode.json" 2>&1 | grep -v -i warn
        timeout 150 python3 -m benchmarks e2e --modes full_and_piecewise --no-transformers \
            --piece-compiler "$c" --batch-sizes 1,8,32 --prompt-len 1024 --new-tokens 8 \
            --out "$OUT/e2e_pieces_${c}_prefill.json" 2>&1 | grep -v -i warn
    done
    ;;
smollm2)
    timeout 560 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
        --timeout=150 tests/engine/test_gpu_smollm2.py \
        2>&1 | tee "$OUT/gpu_smollm2.log"
    ;;
bench)
    timeout 300 python3 -m benchmarks --repeats 30 \
        --out "$OUT/decode_h100.json" --plot "$OUT/decode_h100.png" 2>&1 | tee "$OUT/bench.log"
    timeout 250 python3 -m benchmarks e2e --out "$OUT/e2e_h100.json" \
        --plot "$OUT/e2e_h100.png" 2>&1 | tee -a "$OUT/bench.log"
    ;;
spec)
    timeout 330 python3 -m benchmarks spec --k 4 --out "$OUT/spec_h100.json" 2>&1 \
        | tee "$OUT/spec.log"
    timeout 220 python3 -m benchmarks e2e --model smollm2 --batch-sizes 1,8,32 \
        --out "$OUT/e2e_smollm2_h100.json" --plot "$OUT/e2e_smollm2_h100.png" 2>&1 \
        | tee -a "$OUT/spec.log"
    ;;
spec-all)
    timeout 560 python3 -m benchmarks spec --k 4,2 --dtype "${SPEC_DTYPE:-bfloat16}" \
        --out "$OUT/spec_smollm2_h100.json" 2>&1 | grep -v -i warn | tee "$OUT/spec_all.log"
    ;;
*)
    echo "usage: $0 tests|kernels|smollm2|bench|spec|spec-all|pieces" >&2
    exit 2
    ;;
esac
