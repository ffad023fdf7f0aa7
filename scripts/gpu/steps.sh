# Sourced by the GPU-host runners (scripts/gpu/*.sh, benchmarks/scripts/gpu_*.sh): `step NAME COMMAND...` runs COMMAND with a time
# limit ($STEP_LIMIT s), the whole log to $OUT/NAME.log and its tail to stdout, and records a
# failure in the `failed` array; `finish` reports them and sets the exit status.
failed=()

step() {
    local name=$1 start rc
    shift
    echo "== $name: $*"
    start=$(date +%s)
    timeout "$STEP_LIMIT" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "== $name: exit $rc after $(($(date +%s) - start)) s"
    [[ $rc -eq 0 ]] || failed+=("$name (exit $rc)")
}

finish() {
    if ((${#failed[@]})); then
        echo "FAILED: ${failed[*]}"
        exit 1
    fi
    echo "all steps passed; results in $OUT"
}
