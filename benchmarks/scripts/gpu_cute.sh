#!/usr/bin/env bash
# The CuTe DSL kernel on one H200 without network: install nvidia-cutlass-dsl from the wheel
# chunks, then its GPU tests, then `fusedq-bench --sweep --sweep-cute` (MXFP8, every H, M 1..32:
# the kernel beside the Triton kernel's `auto` and `dot` choices, in one graph set), to $OUT.
#
#   OUT=/some/dir benchmarks/scripts/gpu_cute.sh    (from a copy of the repository; no network)
#
# The H200 image has no CUTLASS DSL and no network: the wheels come as
# .cutewheels.part.00, .01, ... at the repository root (a tar of wheels/*.whl split into
# <= 58 MiB pieces; carry them with the run). They are installed with pip --target into
# $CUTE_DIR (default /tmp/cute), once: a later run on the same machine finds them there.
# The DSL's file cache (on by default) lets the sweep reuse the tests' compiles; a sweep line
# is printed per shape, so a step cut by its limit still leaves figures in its log.
# Knobs: SWEEP_SAMPLES (300) graph replays per variant; STEP_LIMIT (280) s per step (so that
# the whole run fits a 10-minute job).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${OUT:?set OUT to the folder that receives the results}"
PY="${PYTHON:-python3}"
CUTE_DIR="${CUTE_DIR:-/tmp/cute}"
SWEEP_SAMPLES="${SWEEP_SAMPLES:-300}"
STEP_LIMIT="${STEP_LIMIT:-280}"

cd "$REPO"
mkdir -p "$OUT"
# shellcheck source=scripts/gpu/steps.sh
source "$REPO/scripts/gpu/steps.sh"

install_cute() {
    if [[ -d "$CUTE_DIR/site/nvidia_cutlass_dsl" ]]; then
        echo "already installed in $CUTE_DIR/site"
        return 0
    fi
    local parts=("$REPO"/.cutewheels.part.*)
    [[ -e ${parts[0]} ]] || { echo "no $REPO/.cutewheels.part.* (carry them with the run)"; return 1; }
    mkdir -p "$CUTE_DIR" || return 1
    cat "${parts[@]}" | tar -x -C "$CUTE_DIR" || return 1
    ls -l "$CUTE_DIR/wheels"
    # --no-deps: the set is complete; the image's numpy (and typing_extensions) serve.
    "$PY" -m pip install --no-index --no-deps --target "$CUTE_DIR/site" "$CUTE_DIR"/wheels/*.whl
}

install_cute || failed+=("install_cute")  # a shell function: not through step (timeout)
# pip --target does not run the wheel's .pth, which puts python_packages on the path.
export PYTHONPATH="$REPO:$CUTE_DIR/site:$CUTE_DIR/site/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}"
step environment "$PY" -c "import torch, triton, cutlass, cuda.bindings; \
from fusedq.kernels import cute_mla_query as c; print('torch', torch.__version__, 'triton', \
triton.__version__, 'cutlass-dsl', cutlass.__file__, 'cuda-bindings', cuda.bindings.__version__, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability(), 'unavailable:', \
c.unavailable_reason())"
step pytest_cute "$PY" -m pytest tests/fusedq/test_cute_mla_query.py -q -p no:cacheprovider -rs \
    --junitxml "$OUT/pytest_cute.xml"
# No tl.dot grid (--sweep-block-n with no values): the Triton kernel's heuristic choices
# `auto` and `dot`, and `cute`, each checked against the staged path after timing.
step sweep_cute "$PY" -m fusedq_bench --sweep --sweep-cute --sweep-block-n --formats mxfp8 \
    --heads 8 11 16 --m 1 2 4 8 16 32 --samples "$SWEEP_SAMPLES" --json "$OUT/sweep_cute.json"

finish
