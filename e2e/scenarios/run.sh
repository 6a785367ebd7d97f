#!/usr/bin/env bash
# `make e2e`'s tests on the running local cluster that TENSORFLEET_E2E_CLUSTER names: every test
# of e2e/scenarios/tests/, each one's result and time printed as it ends, all of them run even
# after a failure, and the failed ones named at the end with their output (exit 1 if any failed).
#
# The scenarios keep to their own namespaces, so they can run SLOTS at a time; each test's output
# goes to DIR/scenario-logs/. One at a time by default: on two cores, two at a time took as long
# (the ten scenarios in 467 s, against 466 s one after another an hour earlier on this machine,
# 2026-11-27): their training is CPU-bound, and Open MPI's ranks poll while they wait, which
# probably costs more when two jobs' ranks share the cores. The disruptions (tests/disruptions.rs: a node lost, the API server or the operator
# restarted) touch every job on the cluster: they run after, one at a time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${TENSORFLEET_E2E_CLUSTER:?the directory of the cluster that e2e/cluster/up.sh started}"
cargo=${CARGO:-cargo}
slots=${SLOTS:-1}
# --workspace, not -p tensorfleet-e2e: with every member selected, the worker and the operator
# keep the features of .ci/test.sh's build (which builds this crate too, so nothing compiles
# here then; -p rebuilt them without the worker's default features: about 145 s on a fresh
# machine). So the e2e crate asks for no feature of a shared dependency that the others do not
# (tokio's, kube's).
test_cmd=("$cargo" test --quiet --release --locked --workspace)

targets=()
for file in e2e/scenarios/tests/*.rs; do
    targets+=("$(basename "$file" .rs)")
done
"${test_cmd[@]}" "${targets[@]/#/--test=}" --no-run
logs=$TENSORFLEET_E2E_CLUSTER/scenario-logs
mkdir -p "$logs"

# run_one TARGET NAME: the test, its output in its log, its result line printed. The tests that
# need the cluster are ignored by a plain `cargo test`; here they run (--include-ignored).
run_one() {
    local start=$SECONDS result=ok
    "${test_cmd[@]}" --test "$1" -- --exact "$2" --include-ignored >"$logs/$1::$2.log" 2>&1 || result=FAILED
    echo "== e2e: $1::$2: $result in $((SECONDS - start)) s"
    [[ $result == ok ]]
}
failed=()
declare -A running=() # pid → target::name
reap_one() {
    local pid=""
    wait -n -p pid "${!running[@]}" || failed+=("${running[$pid]}")
    unset "running[$pid]"
}
# run_all SLOTS TARGET...: every test of the targets, SLOTS at a time.
run_all() {
    local n=$1 target name
    shift
    for target; do
        mapfile -t tests < <("${test_cmd[@]}" --test "$target" -- --list --format terse | sed -n 's/: test$//p')
        for name in "${tests[@]}"; do
            while ((${#running[@]} >= n)); do reap_one; done
            run_one "$target" "$name" &
            running[$!]="$target::$name"
        done
    done
    while ((${#running[@]})); do reap_one; done
}
independent=()
for target in "${targets[@]}"; do
    [[ $target == disruptions ]] || independent+=("$target")
done
run_all "$slots" "${independent[@]}"
run_all 1 disruptions

if ((${#failed[@]})); then
    for test in "${failed[@]}"; do
        echo "== e2e: the output of $test" >&2
        cat "$logs/$test.log" >&2
    done
    printf 'e2e: %d failed:\n' "${#failed[@]}" >&2
    printf '  %s\n' "${failed[@]}" >&2
    exit 1
fi
