#!/usr/bin/env bash
# `make e2e`'s tests on the running local cluster that TENSORFLEET_E2E_CLUSTER names: every test
# of e2e/scenarios/tests/, one at a time (they share the machine), each one's result and time
# printed as it ends, all of them run even after a failure, and the failed ones named at the end
# (exit 1 if any failed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${TENSORFLEET_E2E_CLUSTER:?the directory of the cluster that e2e/cluster/up.sh started}"
cargo=${CARGO:-cargo}
# --workspace, not -p tensorfleet-e2e: with every member selected, the worker and the operator
# keep the features of .ci/test.sh's build, so only this crate compiles here (-p rebuilt them
# without the worker's default features: about 145 s on a fresh machine). So the e2e crate asks
# for no feature of a shared dependency that the others do not (tokio's, kube's).
test_cmd=("$cargo" test --quiet --release --locked --workspace)

targets=()
for file in e2e/scenarios/tests/*.rs; do
    targets+=("$(basename "$file" .rs)")
done
"${test_cmd[@]}" "${targets[@]/#/--test=}" --no-run
failed=()
for target in "${targets[@]}"; do
    mapfile -t tests < <("${test_cmd[@]}" --test "$target" -- --list --format terse | sed -n 's/: test$//p')
    for name in "${tests[@]}"; do
        start=$SECONDS
        if "${test_cmd[@]}" --test "$target" -- --exact "$name"; then
            result=ok
        else
            result=FAILED
            failed+=("$target::$name")
        fi
        echo "== e2e: $target::$name: $result in $((SECONDS - start)) s"
    done
done
if ((${#failed[@]})); then
    printf 'e2e: %d failed:\n' "${#failed[@]}" >&2
    printf '  %s\n' "${failed[@]}" >&2
    exit 1
fi
