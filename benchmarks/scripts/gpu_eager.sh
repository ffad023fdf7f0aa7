#!/usr/bin/env bash
# fusedq on one H200, uninstalled: the GPU tests, then `fusedq-bench --eager`, then
# `fusedq-bench --floors` (the README's kernel table), each figure to $OUT. Add the JSON files
# to benchmarks/results/h200.jsonl with benchmarks/scripts/ingest.py.
#
#   OUT=/some/dir benchmarks/scripts/gpu_eager.sh   (from a copy of the repository; no network)
#
# Needs only what the H200 image has (torch 2.11, triton 3.6, pytest): the project runs from
# the copied tree through PYTHONPATH, not installed, so the entry point is `python -m
# fusedq_bench`. About 4 minutes in all: the GPU tests compile most kernel variants into
# Triton's cache, which the benchmarks then reuse. Every step runs even when one before it
# failed; the exit status is non-zero when any failed. Knobs (environment):
#   EAGER_CALLS (1000) and EAGER_REPEATS (5): back-to-back calls per run, runs per path;
#   FLOOR_SAMPLES (300): graph replays per path of --floors (the bench's default is 1000);
#   STEP_LIMIT (300): seconds each step may run.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${OUT:?set OUT to the folder that receives the results}"
PY="${PYTHON:-python3}"
EAGER_CALLS="${EAGER_CALLS:-1000}"
EAGER_REPEATS="${EAGER_REPEATS:-5}"
FLOOR_SAMPLES="${FLOOR_SAMPLES:-300}"
STEP_LIMIT="${STEP_LIMIT:-300}"

cd "$REPO"
mkdir -p "$OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck source=scripts/gpu/steps.sh
source "$REPO/scripts/gpu/steps.sh"

step environment "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', \
triton.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
step pytest_gpu "$PY" -m pytest -m gpu tests/fusedq -q -p no:cacheprovider \
    --junitxml "$OUT/pytest_gpu.xml"
# The eager host time per call, every path side by side (fusedq_bench/eager.py's docstring says which).
step eager "$PY" -m fusedq_bench --eager --heads 8 11 16 --m 1 4 32 \
    --calls "$EAGER_CALLS" --repeats "$EAGER_REPEATS" --json "$OUT/eager.json"
# The targets: every H and M, every format, fused against the read-only floor.
step floors "$PY" -m fusedq_bench --floors --samples "$FLOOR_SAMPLES" --json "$OUT/floors.json"

finish
