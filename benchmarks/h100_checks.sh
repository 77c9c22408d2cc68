#!/usr/bin/env bash
# The single-GPU checks of the engine on nvidia-h100-x1, one stage per device call:
#   benchmarks/h100_checks.sh tests    # the GPU suite without the 2-GPU and SmolLM2 files
#   benchmarks/h100_checks.sh kernels  # FULL_AND_PIECEWISE with PDL / small GEMMs, two shapes
#   benchmarks/h100_checks.sh cold     # cold start-up of the 1.5 B shape (empty compiler caches)
#   benchmarks/h100_checks.sh cold-phases  # the same, split by phase and Triton compilation
#   benchmarks/h100_checks.sh attention    # the attention kernel over launch configurations
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
cold)
    # Byte-compile the libraries first (into a cache prefix: the venv may be read-only),
    # as any installed environment is; otherwise each fresh machine spends ~6 s of the
    # first start-up compiling torch's sources. Then two cold start-ups, each with empty
    # Inductor and Triton caches.
    export PYTHONPYCACHEPREFIX=/tmp/pyc
    site=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
    python3 -m compileall -q -j 16 "$site/torch" "$site/triton" "$site/sympy" >/dev/null 2>&1
    for i in 1 2; do
        timeout 90 python3 -m benchmarks.cold_start_profile --out "$OUT/cold_start_$i.json" \
            2>&1 | tail -25
    done
    ;;
cold-options)
    # Cold start-ups with the piece compiler and the capture ladder varied (interleaved,
    # same machine): Inductor pieces, eager pieces, eager pieces up to 256 tokens.
    export PYTHONPYCACHEPREFIX=/tmp/pyc
    site=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
    python3 -m compileall -q -j 16 "$site/torch" "$site/triton" "$site/sympy" >/dev/null 2>&1
    for run in "inductor 512 1" "eager 512 1" "eager 256 1" "inductor 512 2" "eager 512 2"; do
        set -- $run
        timeout 90 python3 -m benchmarks.cold_start_profile --compiler "$1" \
            --max-capture-size "$2" --out "$OUT/cold_${1}_${2}_$3.json" 2>&1 \
            | grep -E '"(compiler|max_capture_size|constructor_s|weights_s|compile_s|capture_s|backend_s|graphs)"'
    done
    ;;
cold-phases)
    # Where a cold start-up goes, by phase and by Triton compilation, then Inductor pieces
    # under cProfile (its shares, not its seconds).
    export PYTHONPYCACHEPREFIX=/tmp/pyc
    site=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
    python3 -m compileall -q -j 16 "$site/torch" "$site/triton" "$site/sympy" >/dev/null 2>&1
    # Each piece compiler without and with KernelOptions(compile_ahead=True), interleaved,
    # then eager pieces compiled ahead without the warm-up run before each capture.
    for run in "inductor:" "inductor_ahead:--compile-ahead" "eager:" \
        "eager_ahead:--compile-ahead" "inductor_ahead_nowarm:--compile-ahead --num-warmups 0" \
        "eager_ahead_nowarm:--compile-ahead --num-warmups 0"; do
        tag=${run%%:*}
        timeout 90 python3 -m benchmarks.cold_start_profile --compiler "${tag%%_*}" \
            ${run#*:} --phases --out "$OUT/cold_phases_$tag.json" 2>&1 | grep -v -i warn \
            | grep -E '"(compiler|compile_ahead|num_warmups|constructor_s|weights_s|compile_s|capture_s|backend_s|triton_in_process_s)"'
    done
    timeout 120 python3 -m benchmarks.cold_start_profile --profile "$OUT/cold_profile.txt" \
        --out "$OUT/cold_profiled.json" >/dev/null 2>&1
    ;;
attention)
    # The paged-attention kernel's decode time over launch configurations.
    timeout 400 python3 -m benchmarks.attention_sweep --out "$OUT/attention_sweep_h100.json" \
        2>&1 | grep -v -i warn
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
spec-ahead)
    # The GPU speculative tests, then plain vs the oracle with and without lookahead on
    # SmolLM2-135M in both dtypes (k = 4), then every proposer at k = 4 and 2 in ${SPEC_DTYPE}.
    timeout 240 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
        --timeout=150 tests/engine/test_gpu_speculative.py 2>&1 | tee "$OUT/gpu_spec.log" | tail -15
    for dt in bfloat16 float32; do
        timeout 150 python3 -m benchmarks spec --k 4 --dtype "$dt" \
            --proposers "oracle,oracle in turn" --out "$OUT/spec_oracle_${dt}_h100.json" \
            2>&1 | grep -v -i warn | tee -a "$OUT/spec.log"
    done
    timeout 120 python3 -m benchmarks.spec_step_profile --dtypes bfloat16 --batch-sizes 1 \
        --out "$OUT/spec_step_profile_h100.json" 2>&1 | grep -v -i warn | tee -a "$OUT/spec.log"
    ;;
spec-all)
    timeout 560 python3 -m benchmarks spec --k 4,2 --dtype "${SPEC_DTYPE:-bfloat16}" \
        --out "$OUT/spec_smollm2_h100.json" 2>&1 | grep -v -i warn | tee "$OUT/spec_all.log"
    ;;
*)
    echo "usage: $0 tests|kernels|cold|smollm2|bench|spec|spec-ahead|spec-all" >&2
    exit 2
    ;;
esac
