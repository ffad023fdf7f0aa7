#!/usr/bin/env bash
# The decode-path switch on a CUDA vLLM (0.26.0, CUDA graphs on) and the sparse-MLA (DSA)
# hand-off, on one H200: tests/fusedq/test_vllm_worker_ext.py's gpu-marked run per model kind.
#
#   OUT=/some/dir scripts/gpu/switch_check.sh dense     (tiny-glm5: FLASH_ATTN_MLA)
#   OUT=/some/dir scripts/gpu/switch_check.sh dsa       (tiny-glm5 with index_topk: FLASH_ATTN_MLA_SPARSE)
#
# Each kind serves its model once with fusedq.vllm.worker_ext.FusedqWorkerExtension and
# VLLM_SERVER_DEV_MODE=1, starts fused (the plugin as always), then flips it staged -> fused
# -> staged over POST /collective_rpc, re-capturing the CUDA graphs each time; after every flip
# it takes the greedy tokens and a torch-profiler trace of two decode steps. About 2-3 minutes
# a kind (one server start, three captures); run the kinds as separate calls.
#
# Needs the GPU stack (scripts/wheelhouse.py install ... --project, README "On GPUs"): vLLM
# 0.26.0 and fusedq installed, so that vLLM's plugin loader sees the `fusedq` entry point. This
# tree's fusedq and orchestrator go first on PYTHONPATH, so the code run is this commit's even
# when the installed project wheel is older. Outputs in $OUT/switch-<kind>/ (server.log,
# profile/*.pt.trace.json.gz, summary.json) and $OUT/<step>.log; exit status non-zero when any
# step failed. STEP_LIMIT (300) caps each step in seconds.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${OUT:?set OUT to the folder that receives the results}"
PY="${PYTHON:-python3}"
STEP_LIMIT="${STEP_LIMIT:-300}"
KINDS=("$@")
((${#KINDS[@]})) || KINDS=(dense dsa)

cd "$REPO"
mkdir -p "$OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export FUSEDQ_SWITCH_OUT="$OUT" VLLM_USE_FLASHINFER_SAMPLER=0
# shellcheck source=scripts/gpu/steps.sh
source "$REPO/scripts/gpu/steps.sh"

step environment "$PY" -c "
import importlib.metadata as md, torch, vllm, fusedq.vllm.worker_ext
plugins = {e.name: e.value for e in md.entry_points(group='vllm.general_plugins')}
assert plugins.get('fusedq') == 'fusedq.vllm.plugin:register', f'fusedq is not an installed vLLM plugin: {plugins}'
print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())
print('fusedq from', fusedq.vllm.worker_ext.__file__)"
for kind in "${KINDS[@]}"; do
    case "$kind" in
        dense | dsa) ;;
        *) echo "switch_check.sh: unknown kind '$kind' (dense, dsa)" >&2; exit 2 ;;
    esac
    step "switch_$kind" "$PY" -m pytest -q -s -p no:cacheprovider -m gpu \
        "tests/fusedq/test_vllm_worker_ext.py::test_e2e_switch_recaptures_cuda_graphs[$kind]" \
        --junitxml "$OUT/switch_$kind.xml"
done

finish
