#!/usr/bin/env bash
# nvidia-cutlass-dsl 4.6.0 -- vLLM 0.26's own pin, with quack-kernels -- on one H200, in four
# parts of a few minutes each (docs/gpu-validation.md):
#
#   OUT=/some/dir scripts/gpu/cute46.sh install   # the 4.6.0 wheels on top of vLLM 0.26's
#   OUT=/some/dir scripts/gpu/cute46.sh tests     # the CuTe kernel's GPU tests under 4.6.0
#   OUT=/some/dir scripts/gpu/cute46.sh bench     # fusedq-bench --floors where CuTe is chosen
#   OUT=/some/dir scripts/gpu/cute46.sh vllm      # staged vs fused in vLLM 0.26, CuTe inside
#
# Before `install`: the vLLM 0.26 wheelhouse installed into $SITE (default /tmp/site) with
# `python scripts/wheelhouse.py install <its chunks> --target $SITE`, and the chunks of
# requirements/gpu-cute46.txt's wheelhouse (`.whl46.tar.part.NN`) copied to $CUTE46_CHUNKS
# (default /tmp/chunks46); they are installed into $CUTE46_SITE (default /tmp/cute46). 4.6.0 is
# a validated release since 2026-12-02 (the GPU record of caba774 ran under it). `vllm` passes
# only if the fused server's kernel line names cute: the line names what the vLLM hook's calls
# bind, so it fails while the hook calls backend="triton" (fusedq/vllm/query.py, BACKEND).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${OUT:?set OUT to the folder that receives the results}"
PY="${PYTHON:-python3}"
SITE="${SITE:-/tmp/site}"
# A folder of its own: a second `pip install --target --upgrade` into $SITE replaces the
# folders the two share (bin/ among them: vLLM's console script was lost that way).
CUTE46_SITE="${CUTE46_SITE:-/tmp/cute46}"
CUTE46_CHUNKS="${CUTE46_CHUNKS:-/tmp/chunks46}"
STEP_LIMIT="${STEP_LIMIT:-540}"
part="${1:-}"

cd "$REPO"
mkdir -p "$OUT"
# pip --target skips the DSL's .pth, which puts dsl_packages on sys.path.
export PYTHONPATH="$REPO:$CUTE46_SITE:$CUTE46_SITE/nvidia_cutlass_dsl/dsl_packages:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH" VLLM_USE_FLASHINFER_SAMPLER=0
# shellcheck source=scripts/gpu/steps.sh
source "$REPO/scripts/gpu/steps.sh"

environment() {
    step environment "$PY" -c "import importlib.metadata as md, torch, fusedq
from fusedq.kernels import cute_mla_query as c
print('torch', torch.__version__, 'nvidia-cutlass-dsl', md.version('nvidia-cutlass-dsl'),
      'quack-kernels', md.version('quack-kernels'), 'cuda-bindings', md.version('cuda-bindings'),
      torch.cuda.get_device_name(), 'CuTe unavailable:', c.unavailable_reason())
for fmt in ('bf16', 'mxfp8'):
    print(fmt, fusedq.kernel_summary(16, [1, 2, 4, 8, 16, 32], weight_format=fmt, device='cuda'))
assert c.unavailable_reason() is None"
}

case "$part" in
    install)
        if [[ ! -d "$SITE/vllm" ]]; then
            echo "no vLLM in $SITE: install the vLLM 0.26 wheelhouse there first"
            exit 1
        fi
        step install "$PY" scripts/wheelhouse.py install "$CUTE46_CHUNKS"/.whl46.tar.part.* \
            --target "$CUTE46_SITE"
        environment
        # vLLM 0.26's kernel warm-up imports quack whenever cutlass imports (docs/validation/
        # h200-2026-12-01): both must import in one process.
        step imports "$PY" -c "import cutlass, cutlass.cute, quack, vllm; print('ok', vllm.__version__)"
        ;;
    tests)
        environment
        step pytest_cute46 "$PY" -m pytest -m gpu tests/fusedq/test_cute_mla_query.py -q \
            -p no:cacheprovider -rs --junitxml "$OUT/pytest_cute46.xml"
        ;;
    bench)
        environment
        # The recipes and M where backend="auto" takes the CuTe kernel in graphs (MXFP8 M <= 4,
        # bf16 weights M <= 2), with the read-only floors beside them.
        step bench_cute46 "$PY" -m fusedq_bench --floors --formats bf16 mxfp8 mxfp8-e4m3 \
            --heads 8 11 16 --m 1 2 4 --samples 200 --json "$OUT/bench_cute46.json"
        ;;
    vllm)
        environment
        step orchestrator_run "$PY" -m orchestrator.cli run matrices/h200.yaml --only mtp0 \
            --logs-dir "$OUT/logs" --run-id h200-cute46-1
        # The fused server must have run the CuTe kernel: its kernel line names cute.
        step kernel_line grep -E "fusedq: kernels \(heads=16, format=bf16\): M=1(-2|,2)? cute" \
            "$OUT"/logs/h200-cute46-1/cases/*__fused/server.log
        ;;
    *)
        echo "usage: OUT=DIR $0 install|tests|bench|vllm" >&2
        exit 2
        ;;
esac
finish
