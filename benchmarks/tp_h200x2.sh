#!/usr/bin/env bash
# The tensor-parallel GPU checks on nvidia-h200-x2, in three device calls (10 minutes each):
#   benchmarks/tp_h200x2.sh tests   # the 2-GPU tests (the single-GPU suite: h100_checks.sh)
#   benchmarks/tp_h200x2.sh tests-one-session   # the same in one pytest (less start-up), the
#                                   # dead-worker tests after it in a second
#   benchmarks/tp_h200x2.sh census-llama-8b  # TP=1 vs TP=2 at B=1,8 with kernel census and top kernels
#   benchmarks/tp_h200x2.sh bench-llama-8b   # (and bench-llama-1.5b) decode step, TP=1 vs TP=2, NCCL vs measured symmetric
#   benchmarks/tp_h200x2.sh bench-ubatch     # TP=2 steps with and without micro-batch overlap
#   benchmarks/tp_h200x2.sh rules-llama-8b   # TP=2 and TP=1: the default against the rule
#                                   # variants that put the TP step's kernels apart
#   benchmarks/tp_h200x2.sh bench-default-llama-8b  # TP=1 vs TP=2: the default (FULL graphs),
#                                   # the unfused PDL option, the default started again (its own
#                                   # noise), measured all-reduce
#   benchmarks/tp_h200x2.sh verify  # one call: the serving and symmetric all-reduce GPU tests,
#                                   # the census, the micro-batch benchmark, then
#                                   # the default mode's step in the time left (needs .gpu/whl),
#                                   # every file under $OUT then packed into one archive
# Writes logs and JSON under $OUT (or ./out). NVLink multicast stays off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
# The results' provenance: this checkout's commit (scripts/gpu_prepare.sh commit), not the
# device copy's git metadata, which is not this checkout's.
if [ -f .gpu/whl/COMMIT ]; then
    read -r OSTINATO_COMMIT OSTINATO_DIRTY < .gpu/whl/COMMIT
    export OSTINATO_COMMIT OSTINATO_DIRTY
fi
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt" 2>&1
case "${1:-}" in
tests)
    # One pytest per test, each under its own limit: a hung test is killed alone and
    # every other test's result (and failure details, -rfE) still comes back. The
    # dead-worker tests run last: a process killed with NCCL kernels in flight can
    # leave its GPU busy for the tests after it. ``tests K`` runs those matching K.
    args=(-v -rfE --tb=short -m gpu -p no:cacheprovider --timeout=180)
    ids=$(python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider \
        tests/engine/test_gpu_distributed.py -k "${2:-not dead_worker}" | grep ::)
    [ -z "${2:-}" ] && ids="$ids $(python3 -m pytest -q --collect-only -m gpu \
        -p no:cacheprovider tests/engine/test_gpu_distributed.py -k dead_worker | grep ::)"
    for id in $ids; do
        timeout 200 python3 -m pytest "${args[@]}" "$id" 2>&1 | tee -a "$OUT/gpu_tests.log" \
            | grep -E "PASSED|FAILED|ERROR|^E |Timeout|rank [0-9]"
    done
    ;;
tests-one-session)
    args=(-v -rfE --tb=short -m gpu -p no:cacheprovider --timeout=150)
    timeout 420 python3 -m pytest "${args[@]}" tests/engine/test_gpu_distributed.py \
        -k "not dead_worker" 2>&1 | tee -a "$OUT/gpu_tests.log" \
        | grep -E "PASSED|FAILED|ERROR|^E |Timeout|rank [0-9]|passed|failed"
    timeout 150 python3 -m pytest "${args[@]}" tests/engine/test_gpu_distributed.py \
        -k dead_worker 2>&1 | tee -a "$OUT/gpu_tests.log" \
        | grep -E "PASSED|FAILED|ERROR|^E |Timeout|rank [0-9]|passed|failed"
    ;;
census-*)
    shape=${1#census-}
    for tp in 1 2; do
        ar=()  # (one rank has no all-reduce to choose)
        [ "$tp" = 2 ] && ar=(--all-reduce nccl,auto)
        timeout 120 python3 -m benchmarks --tp "$tp" --shape "$shape" --batch-sizes 1,8 \
            --variants "ostinato FULL" "${ar[@]}" --repeats 30 \
            --out "$OUT/census_tp_${shape}_tp${tp}_h200.json" 2>&1 | tee -a "$OUT/census.log"
    done
    ;;
rules-*)
    # The default step against the launch-rule variants that put the tensor-parallel
    # step's kernels apart (the K/V write after the QKV projection; the embedding lookups
    # in torch ops) or launch the QKV kernel by rule, TP=2 then TP=1, one process pair
    # each, every variant timed in turn.
    shape=${1#rules-}
    for tp in 2 1; do
        variants="ostinato FULL rope-kv-apart,ostinato FULL"
        ar=()
        [ "$tp" = 2 ] && variants="ostinato FULL tp-kernels-apart,ostinato FULL qkv-by-rule,$variants"
        [ "$tp" = 2 ] && ar=(--all-reduce auto)
        timeout "${LIMIT_S:-280}" python3 -m benchmarks --tp "$tp" --shape "$shape" \
            --batch-sizes 1,8 --no-profile "${ar[@]}" --repeats 30 --rounds 3 \
            --variants "$variants" --out "$OUT/rules_tp_${shape}_tp${tp}_h200.json" 2>&1 \
            | tee -a "$OUT/bench.log" | grep -E "^\[tp|^ostinato|measured"
    done
    ;;
bench-ubatch)
    # Micro-batch overlap: TP=2 steps of the 8 B shape with and without it, graphs on;
    # over NVLink, then with the all-reduces moved off it (NCCL_P2P_DISABLE=1: through
    # host shared memory, as between GPUs without NVLink), where communication weighs more.
    timeout 250 python3 -m benchmarks ubatch --tp 2 --shape llama-8b \
        --out "$OUT/ubatch_llama-8b_tp2_h200.json" --plot "$OUT/ubatch_llama-8b_tp2_h200.png" \
        2>&1 | tee -a "$OUT/bench.log"
    NCCL_P2P_DISABLE=1 timeout 320 python3 -m benchmarks ubatch --tp 2 --shape llama-8b \
        --out "$OUT/ubatch_llama-8b_tp2_nop2p_h200.json" \
        --plot "$OUT/ubatch_llama-8b_tp2_nop2p_h200.png" 2>&1 | tee -a "$OUT/bench.log"
    ;;
bench-default-*)
    shape=${1#bench-default-}
    for tp in 1 2; do
        ar=()
        [ "$tp" = 2 ] && ar=(--all-reduce auto)
        timeout "${LIMIT_S:-200}" python3 -m benchmarks --tp "$tp" --shape "$shape" \
            --batch-sizes 1,8 --no-profile "${ar[@]}" --repeats 30 \
            --variants "ostinato FULL layers-unfused pdl+small-gemm,ostinato FULL,ostinato FULL again" \
            --out "$OUT/default_tp_${shape}_tp${tp}_h200.json" 2>&1 | tee -a "$OUT/bench.log" \
            | grep -E "^\[tp|^ostinato"
    done
    ;;
verify)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
    export PYTHONPATH=$PYTHONPATH:.:/tmp/site
    SECONDS=0
    bash "$0" tests "serve or symmetric or full-dtype6-one-shot"
    echo "tests: $SECONDS s"
    bash "$0" census-llama-8b | grep -E "^ostinato|^\[tp"
    echo "census: $SECONDS s"
    timeout 200 python3 -m benchmarks ubatch --tp 2 --shape llama-8b --repeats 10 \
        --out "$OUT/ubatch_llama-8b_tp2_h200.json" --plot "$OUT/ubatch_llama-8b_tp2_h200.png" \
        > "$OUT/ubatch.log" 2>&1
    tail -7 "$OUT/ubatch.log"
    echo "ubatch: $SECONDS s"
    left=$(( (${VERIFY_S:-560} - SECONDS) / 2 ))
    [ "$left" -ge 40 ] && LIMIT_S=$left bash "$0" bench-default-llama-8b
    echo "all: $SECONDS s"
    # The device tool brings back 8 files at most: everything in one archive.
    tar -czf /tmp/verify_h200x2.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* \
        && mv /tmp/verify_h200x2.tar.gz "$OUT/"
    ;;
bench-*)
    variants="eager,ostinato FULL,ostinato FULL_AND_PIECEWISE"
    for shape in "${1#bench-}"; do
        for tp in 1 2; do
            ar=()
            [ "$tp" = 2 ] && ar=(--all-reduce nccl,auto)
            timeout 280 python3 -m benchmarks --tp "$tp" --shape "$shape" --no-profile \
                --variants "$variants" "${ar[@]}" --repeats 30 \
                --out "$OUT/decode_tp_${shape}_tp${tp}_h200.json" 2>&1 | tee -a "$OUT/bench.log"
        done
    done
    ;;
*)
    echo "usage: $0 tests [K]|bench-llama-8b|bench-llama-1.5b|bench-ubatch" >&2
    exit 2
    ;;
esac
