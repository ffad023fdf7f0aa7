# pip_step WHAT ARGS...: `pip install ARGS...` as one line of the install's log: what it
# installed, how many packages, how long. pip's own output (thousands of lines, its whole
# argument list in a CI log) is kept back unless it fails; then its last lines are shown and
# the install stops. The count is pip's own install report (--report), so a step that found
# everything installed says 0.
#
# Sourced by scripts/install.sh, which defines pip_ (pip of the venv), say, die and VPY.
# tests/scripts/test_pip_step.py runs it against a stand-in pip.

PIP_STEP_TAIL=30

pip_step() {
    local what="$1" log report t0 n
    shift
    log="$(mktemp)"
    report="$(mktemp)"
    t0=$(date +%s)
    if ! pip_ install --report "$report" "$@" >"$log" 2>&1; then
        tail -n "$PIP_STEP_TAIL" "$log" >&2
        rm -f "$log" "$report"
        die "$what: pip install failed (its last lines above)"
    fi
    n=$("$VPY" -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["install"]))' "$report")
    rm -f "$log" "$report"
    say "$what: $n package(s) installed or updated in $(( $(date +%s) - t0 )) s"
}
