#!/usr/bin/env bash
# The flake hunt (`make test-repeat N=5`): `make test` N times, one after the other, on a fresh
# clone of this checkout's HEAD (what is committed: a clean clone, as CI has). Prints each run's
# exit status, time and pytest summary, and every failing test by name; exits 1 unless all N
# were green. The logs stay in the folder it names. BUSY=K (`make test-repeat N=3 BUSY=1`)
# keeps K cores busy with a spinning shell for the runs: a loaded CI machine's timing, where a
# test that leans on a short wait fails.
set -uo pipefail

stop_spinners() {
    [ ${#spinners[@]} -eq 0 ] && return
    kill "${spinners[@]}" 2>/dev/null
    wait "${spinners[@]}" 2>/dev/null # gone when the script is
}

# All in a function, called on the script's last line: bash has read the whole file before it
# runs any of it, so an edit to this checkout during a long hunt can't change what it runs next.
main() {
    n=${1:-5}
    busy=${BUSY:-0}
    case $n in '' | *[!0-9]* | 0) echo "N must be a whole number of runs, 1 or more (got '$n')" >&2; exit 2 ;; esac
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) # the cores it may run on
    # Up to 4 digits before the numeric test: a longer number is past what the shell holds.
    [[ $busy =~ ^[0-9]{1,4}$ ]] && [ "$busy" -le "$cores" ] || { echo "BUSY must be a whole number of cores, 0 to $cores (got '$busy')" >&2; exit 2; }
    root=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
    work=$(mktemp -d "${TMPDIR:-/tmp}/gpulayer-repeat.XXXXXX")
    git clone -q "$root" "$work/clone" || exit 2
    busy_note=""
    [ "$busy" -gt 0 ] && busy_note=", $busy core(s) kept busy"
    echo "test-repeat: $n runs of make test on a clone of $(git -C "$root" rev-parse --short HEAD) in $work$busy_note"
    spinners=()
    trap stop_spinners EXIT
    # Ctrl-C (or a TERM) ends the hunt, not only the run it hit: pytest takes the SIGINT and exits
    # 2, which the loop would take for a failed run and go on to the next.
    trap 'echo "test-repeat: stopped (logs: $work)" >&2; exit 130' INT TERM
    for _ in $(seq 1 "$busy"); do
        sh -c 'while :; do :; done' &
        spinners+=($!)
    done
    green=0
    for i in $(seq 1 "$n"); do
        start=$(date +%s)
        (cd "$work/clone" && make test) >"$work/run-$i.log" 2>&1
        rc=$?
        secs=$(($(date +%s) - start))
        summary=$(grep -E '(passed|failed|error).* in [0-9.]+s' "$work/run-$i.log" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//')
        printf 'run %d/%d: exit %d, %dm%02ds: %s\n' "$i" "$n" "$rc" $((secs / 60)) $((secs % 60)) "${summary:-no pytest summary (see $work/run-$i.log)}"
        grep -E '^(FAILED|ERROR) ' "$work/run-$i.log" | sed 's/^/    /'
        [ "$rc" -eq 0 ] && green=$((green + 1))
    done
    echo "test-repeat: $green of $n runs green (logs: $work)"
    [ "$green" -eq "$n" ]
}

main "$@"; exit # one line: read whole before main runs
