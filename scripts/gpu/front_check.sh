#!/usr/bin/env bash
# The decode front on one H100/H200, in three parts that each end inside a 10-minute command
# (docs/gpu-validation.md):
#
#   OUT=/some/dir scripts/gpu/front_check.sh record   # the GPU record: every gpu test + bench
#   OUT=/some/dir scripts/gpu/front_check.sh vllm     # the front's tests against vLLM's CUDA ops
#   OUT=/some/dir scripts/gpu/front_check.sh bench    # fusedq-bench --front, both geometries
#                                                      # (and --eager --front: host time)
#
# `record` runs without vLLM on the path, as every record so far: the server tests then skip
# rather than start two vLLM servers inside the record's time, and the front's comparison with
# vLLM's own ops runs in `vllm` instead. Before `record`: the CUTLASS DSL wheels installed into
# $CUTE_SITE (default /tmp/cute: `python scripts/wheelhouse.py install <chunks of
# requirements/gpu-cute.txt's wheelhouse> --target /tmp/cute`); before `vllm` and `bench`: the
# vLLM 0.26 wheelhouse in $SITE (default /tmp/site). The record is written to $RECORDS (default
# /tmp/gpu_records: each command gets a fresh copy of the tree) and copied to $OUT.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${OUT:?set OUT to the folder that receives the results}"
PY="${PYTHON:-python3}"
SITE="${SITE:-/tmp/site}"
CUTE_SITE="${CUTE_SITE:-/tmp/cute}"
RECORDS="${RECORDS:-/tmp/gpu_records}"
STEP_LIMIT="${STEP_LIMIT:-560}"
part="${1:-}"

cd "$REPO"
mkdir -p "$OUT"
# pip --target skips the DSL's .pth, which puts its packages on sys.path.
CUTE_PATH="$CUTE_SITE:$CUTE_SITE/nvidia_cutlass_dsl/python_packages"
# shellcheck source=scripts/gpu/steps.sh
source "$REPO/scripts/gpu/steps.sh"

with_vllm() {
    if [[ ! -d "$SITE/vllm" ]]; then
        echo "no vLLM in $SITE: install the vLLM 0.26 wheelhouse there first"
        exit 1
    fi
    # The project from this tree, not a wheel in $SITE; vLLM's command on PATH for the tests
    # that start a server.
    export PYTHONPATH="$REPO:$CUTE_PATH:$SITE" PATH="$SITE/bin:$PATH"
    export VLLM_USE_FLASHINFER_SAMPLER=0
}

case "$part" in
    record)
        export PYTHONPATH="$REPO:$CUTE_PATH"
        step record "$PY" scripts/gpu_record.py --records "$RECORDS" --out "$OUT"
        ;;
    vllm)
        with_vllm
        step pytest_front_vllm "$PY" -m pytest -m gpu tests/fusedq/test_front.py \
            tests/fusedq/test_bench_front.py -q -p no:cacheprovider -rs \
            --junitxml "$OUT/pytest_front_vllm.xml"
        ;;
    bench)
        with_vllm
        # Host time of the front's eager call (vLLM's piecewise steps: a request's first step
        # under MTP) against vLLM's eager front, first: it takes seconds.
        step eager_front "$PY" -m fusedq_bench --eager --front --heads 16 --m 1 2 \
            --json "$OUT/eager-front.json"
        # Every recipe at GLM-5's qualified heads and M; DeepSeek-V3's BF16 and MXFP8 weights at
        # its TP8 / TP4 / TP2 ranks to M 64, where the front's cost over the query kernel grew.
        step front_glm5 "$PY" -m fusedq_bench --front --geometry glm5 --heads 8 16 \
            --m 1 2 4 8 16 32 --samples 300 --json "$OUT/front-glm5.json"
        step front_dsv3 "$PY" -m fusedq_bench --front --geometry deepseek-v3 --heads 16 32 64 \
            --m 1 4 16 32 64 --formats bf16 mxfp8 --samples 300 --json "$OUT/front-dsv3.json"
        ;;
    *)
        echo "usage: OUT=DIR $0 record|vllm|bench" >&2
        exit 2
        ;;
esac
finish
