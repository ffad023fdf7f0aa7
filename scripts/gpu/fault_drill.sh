#!/usr/bin/env bash
# The GPU fault drill (docs/gpu-validation.md): under the orchestrator a GPU vLLM server hits a
# real device fault in its decode path, from the test-only plugin tests/fault_drill, and the
# gpu-marked checks of tests/orchestrator/test_fault_drill.py run on the result.
#
#   OUT=/some/dir scripts/gpu/fault_drill.sh [oob|tp2]
#
# oob (default, one H200): matrices/h200-fault-drill.yaml, an out-of-bounds write after 200
# fused decode query calls (an illegal memory access), then a clean case.
# tp2 (two H200s): matrices/h200x2-fault-drill.yaml, the rank-1 worker SIGKILLed at its 50th
# decode step, then a clean case.
# Run from a copy of the repository with the GPU stack importable (scripts/wheelhouse.py
# install ... --target /tmp/site, then PYTHONPATH=/tmp/site); the plugin is installed with pip
# --target into a temporary directory by the test and nowhere else. $OUT receives the run
# directory (reports, junit, audits, server logs), the orchestrator's output and the pytest
# log. A few minutes: two server start-ups with CUDA graphs.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${OUT:?set OUT to the folder that receives the results}"
PY="${PYTHON:-python3}"
STEP_LIMIT="${STEP_LIMIT:-540}"
case "${1:-oob}" in
    oob) select="illegal_memory_access" ;;
    tp2) select="tp2_worker_killed" ;;
    *) echo "usage: $0 [oob|tp2]" >&2; exit 2 ;;
esac

cd "$REPO"
mkdir -p "$OUT"
export OUT PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck source=scripts/gpu/steps.sh
source "$REPO/scripts/gpu/steps.sh"

step environment "$PY" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', \
vllm.__version__, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
step nvidia_smi_before nvidia-smi
step drill "$PY" -m pytest -q -p no:cacheprovider -rA -m gpu -k "$select" \
    tests/orchestrator/test_fault_drill.py --junitxml "$OUT/pytest_drill.xml"
step nvidia_smi_after nvidia-smi
finish
