#!/usr/bin/env bash
# Runs the end-to-end scenarios 1, 2, 3 and 8 of issue 6 on the kind cluster of up.sh, with the
# GPU TrainingJobs of manifests/, through kubectl as a user would. Each check prints one line,
# PASS, FAIL or SKIP, on stdout (diagnostics go to stderr); the exit status is 1 when any
# check failed.
#
#   e2e/kind/run-scenarios.sh            # all four: 1 2 3 8
#   e2e/kind/run-scenarios.sh 1 8        # some of them, in that order
#
#   1  gpu-quickstart.yaml: 2 worker pods × 1 GPU, mpirun over ssh, trains to Succeeded with
#      progress shown while it runs; the claim holds checkpoints, TensorBoard events, the model
#      and every step's metrics.
#   2  3d-parallel.yaml: data 2 × tensor 2 × pipeline 2 on 2 pods × 4 GPUs trains to the losses
#      of 3d-single.yaml (the same training in one process). Needs 8 GPUs; skipped with fewer.
#   3  restart.yaml: a worker pod deleted mid-training; the job shows Restarting, restarts the
#      gang once, resumes from the newest checkpoint and succeeds with every step logged.
#   8  delete.yaml: deleting a running job removes every child object and keeps its claim
#      (reclaimPolicy Retain, the default).
#
# Everything happens in one namespace (tensorfleet-kind-e2e), made afresh with the data the jobs
# read (manifests/data.yaml); it is deleted when every check passed and kept otherwise.
# Env: TENSORFLEET_KIND_TIMEOUT (seconds a job may take, default 900), TENSORFLEET_KIND_RTOL
# (relative tolerance between losses in scenario 2, default 1e-4), TENSORFLEET_KIND_NAMESPACE,
# TENSORFLEET_KIND_KEEP=1 (keep the namespace).

# The scenarios run by name (scenario_$s) and the waits call their checks by name, which
# the linter takes for unreachable code.
# shellcheck disable=SC2317
set -Eeuo pipefail
# shellcheck source=e2e/kind/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MANIFESTS=$KIND_DIR/manifests
NS=${TENSORFLEET_KIND_NAMESPACE:-tensorfleet-kind-e2e}
TIMEOUT=${TENSORFLEET_KIND_TIMEOUT:-900}
RTOL=${TENSORFLEET_KIND_RTOL:-1e-4}

SCENARIOS=("$@")
((${#SCENARIOS[@]} > 0)) || SCENARIOS=(1 2 3 8)
for s in "${SCENARIOS[@]}"; do
    [[ $s =~ ^(1|2|3|8)$ ]] || die "no scenario '$s' here: the kind scenarios are 1, 2, 3 and 8"
done

need kubectl "install kubectl (https://kubernetes.io/docs/tasks/tools/)"
need kind "install kind $KIND_VERSION (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
need jq "install jq (apt-get install jq): it reads the jobs' metrics.jsonl"
cluster_exists || die "there is no kind cluster '$CLUSTER_NAME': run e2e/kind/up.sh first"
k -n "$OPERATOR_NAMESPACE" rollout status "deployment/$RELEASE" --timeout=10s >/dev/null 2>&1 ||
    die "the operator (deployment/$RELEASE in $OPERATOR_NAMESPACE) is not available on $CONTEXT: run e2e/kind/up.sh"
# The manifests name the worker image by tag; up.sh built and loaded the workspace version's.
stale=$(grep -h '^[[:space:]]*image: tensorfleet/' "$MANIFESTS"/*.yaml | awk '{ print $2 }' | sort -u | grep -vx "$WORKER_IMAGE" || true)
[[ -z $stale ]] || die "manifests/ name $(echo "$stale" | tr '\n' ' ')but up.sh loaded $WORKER_IMAGE: update the image tags in $MANIFESTS"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# A command that fails where no check expects it stops the run; say which.
trap 'log "stopped: \"$BASH_COMMAND\" failed (line $LINENO); namespace $NS kept"' ERR

# ---- reporting --------------------------------------------------------------------------------
PASSED=0 FAILED=0 SKIPPED=0
pass() { echo "PASS  $*"; PASSED=$((PASSED + 1)); }
fail() { echo "FAIL  $*"; FAILED=$((FAILED + 1)); }
skip() { echo "SKIP  $*"; SKIPPED=$((SKIPPED + 1)); }
# check WHAT CMD...: PASS when CMD succeeds.
check() {
    local what=$1
    shift
    if "$@" >/dev/null; then pass "$what"; else fail "$what"; fi
}

# What a person needs to see when a job did not do what was expected.
diagnose() { # JOB
    {
        echo "---- $1 in namespace $NS:"
        k -n "$NS" get trainingjob "$1" -o yaml | sed -n '/^status:/,$p'
        k -n "$NS" get pods,pvc -l "tensorfleet.dev/job-name=$1" -o wide
        echo "---- launcher log (tail):"
        k -n "$NS" logs "$1-launcher" --tail=40
        echo "---- events (tail):"
        k -n "$NS" get events --sort-by=.lastTimestamp | tail -n 15
    } >&2 2>&1 || true
}

# ---- jobs -------------------------------------------------------------------------------------
job_get() { k -n "$NS" get trainingjob "$1" -o jsonpath="$2" 2>/dev/null || true; }
phase_of() { job_get "$1" '{.status.phase}'; }
# A manifest as JSON, for reading the numbers the checks expect (steps, checkpoint period...).
manifest_json() { k create --dry-run=client -o json -f "$MANIFESTS/$1"; }

# apply_job FILE SCENARIO: FAIL (naming the API server's answer) when it is refused.
apply_job() {
    local out
    if ! out=$(k -n "$NS" apply -f "$MANIFESTS/$1" 2>&1); then
        fail "$2: the API server accepted manifests/$1 ($out)"
        return 1
    fi
}

# wait_job NAME [HOOK]: polls until the job Succeeded or Failed (or TIMEOUT), calling HOOK NAME
# on every reading; JOB_PHASE holds the last phase. Succeeds when the job did.
JOB_PHASE=
wait_job() {
    local name=$1 hook=${2:-} deadline=$((SECONDS + TIMEOUT))
    while :; do
        JOB_PHASE=$(phase_of "$name")
        if [[ -n $hook ]]; then "$hook" "$name" || true; fi
        [[ $JOB_PHASE == Succeeded || $JOB_PHASE == Failed ]] && break
        ((SECONDS < deadline)) || break
        sleep 2
    done
    [[ $JOB_PHASE == Succeeded ]]
}

# wait_job_until NAME CMD...: polls until CMD succeeds; fails when the job ended first or after
# TIMEOUT.
wait_job_until() {
    local name=$1 deadline=$((SECONDS + TIMEOUT))
    shift
    until "$@"; do
        JOB_PHASE=$(phase_of "$name")
        [[ $JOB_PHASE == Succeeded || $JOB_PHASE == Failed ]] && return 1
        ((SECONDS < deadline)) || return 1
        sleep 1
    done
}

# A failed wait: FAIL with the job's own account of why (status.failure), and diagnostics.
# The job is suspended, not deleted: its pods give their GPUs back to the next scenario and the
# job stays in the namespace to be looked at.
job_failed() { # JOB WHAT
    local why
    why=$(job_get "$1" '{.status.failure.message}')
    fail "$2 (phase '${JOB_PHASE:-none}'${why:+: $why})"
    diagnose "$1"
    k -n "$NS" patch trainingjob "$1" --type merge -p '{"spec":{"runPolicy":{"suspend":true}}}' >/dev/null 2>&1 || true
}

delete_job() { k -n "$NS" delete trainingjob "$1" --ignore-not-found --wait=true --timeout=120s >/dev/null || true; }

launcher_log() { k -n "$NS" logs "$1-launcher" 2>/dev/null || true; }

# ---- claims -----------------------------------------------------------------------------------
# A pod mounting CLAIM at /claim (manifests/claim-reader.yaml), on the claim's node.
open_claim() { # CLAIM
    local pod="read-$1"
    k -n "$NS" delete pod "$pod" --ignore-not-found --wait=true >/dev/null
    manifest_json claim-reader.yaml |
        jq --arg pod "$pod" --arg claim "$1" \
            '.metadata.name = $pod | .spec.volumes[0].persistentVolumeClaim.claimName = $claim' |
        k -n "$NS" apply -f - >/dev/null
    k -n "$NS" wait --for=condition=Ready "pod/$pod" --timeout=180s >/dev/null
}
in_claim() { # CLAIM SHELL-COMMAND: runs in the claim's root
    k -n "$NS" exec "read-$1" -- sh -c "cd /claim && $2"
}
close_claim() { k -n "$NS" delete pod "read-$1" --wait=false >/dev/null 2>&1 || true; }

# The per-step training losses of a metrics.jsonl, {"<step>": loss}; a step logged twice (a
# resumed run logs again the steps after its checkpoint) keeps its last value.
# shellcheck disable=SC2016 # jq's variables, not the shell's
LOSSES='reduce (.[] | select(.loss != null and .step != null)) as $m ({}; .[$m.step | tostring] = $m.loss)'

# The steps of a metrics.jsonl are exactly 1..N.
all_steps_logged() { # FILE N
    [[ $(jq -s --argjson n "$2" "$LOSSES | keys | map(tonumber) | sort == [range(1; \$n + 1)]" "$1") == true ]]
}

# ---- the namespace and the data ---------------------------------------------------------------
if k get namespace "$NS" >/dev/null 2>&1; then
    log "deleting the namespace $NS of an earlier run"
    k delete namespace "$NS" --wait=true --timeout=300s >/dev/null
fi
k create namespace "$NS" >/dev/null
log "namespace $NS: preparing the data (manifests/data.yaml)"
k -n "$NS" create configmap corpus --from-file=corpus.txt="$ROOT/examples/local/data/corpus.txt" >/dev/null
k -n "$NS" apply -f "$MANIFESTS/data.yaml" >/dev/null
deadline=$((SECONDS + 300))
phase=
until [[ $phase == Succeeded || $phase == Failed ]] || ((SECONDS >= deadline)); do
    sleep 2
    phase=$(k -n "$NS" get pod prepare-data -o jsonpath='{.status.phase}' 2>/dev/null || true)
done
if [[ $phase != Succeeded ]]; then
    fail "data: prepare-data filled the claim tensorfleet-data (phase '${phase:-none}')"
    { k -n "$NS" describe pod prepare-data; k -n "$NS" logs prepare-data; } >&2 2>&1 || true
    echo "kind scenarios: $PASSED passed, $FAILED failed, $SKIPPED skipped (nothing runs without the data; namespace $NS kept)"
    exit 1
fi
pass "data: prepare-data filled the claim tensorfleet-data with token shards"

# ---- scenario 1 -------------------------------------------------------------------------------
S1_PROGRESS='' S1_GPUS=''
s1_watch() { # JOB: progress mid-run, and the GPUs a worker pod sees while it exists
    local step total
    if [[ $JOB_PHASE == Running && -z $S1_PROGRESS ]]; then
        read -r step total < <(job_get "$1" '{.status.progress.step} {.status.progress.totalSteps}{"\n"}')
        if ((${step:-0} > 0 && ${step:-0} < ${total:-0})); then
            S1_PROGRESS=$(job_get "$1" '{.status.progress.summary}')
        fi
    fi
    if [[ -z $S1_GPUS ]]; then
        local out
        if out=$(k -n "$NS" exec "$1-worker-0" -c worker -- nvidia-smi -L 2>/dev/null); then
            S1_GPUS=$(grep -c '^GPU ' <<<"$out" || true)
        fi
    fi
}

scenario_1() {
    local job=gpu-quickstart spec steps every keep
    spec=$(manifest_json gpu-quickstart.yaml)
    read -r steps every keep < <(jq -r '.spec.training | "\(.steps) \(.checkpoint.every) \(.checkpoint.keep)"' <<<"$spec")
    apply_job gpu-quickstart.yaml s1 || return 0
    if ! wait_job "$job" s1_watch; then
        job_failed "$job" "s1: $job trained to Succeeded"
        return
    fi
    pass "s1: $job trained to Succeeded"
    check "s1: the status showed progress while the job ran (${S1_PROGRESS:-never seen})" test -n "$S1_PROGRESS"
    check "s1: worker pod $job-worker-0 saw the 1 GPU it asked for (nvidia-smi -L listed ${S1_GPUS:-nothing})" test "$S1_GPUS" = 1
    local progress restarts
    progress=$(job_get "$job" '{.status.progress.step}/{.status.progress.totalSteps}')
    check "s1: the final progress is $steps/$steps (status: $progress)" test "$progress" = "$steps/$steps"
    restarts=$(job_get "$job" '{.status.restartCount}')
    check "s1: no restarts (restartCount ${restarts:-0})" test "${restarts:-0}" = 0
    check "s1: the launcher started 2 ranks with mpirun over ssh" grep -q 'starting 2 ranks' <<<"$(launcher_log "$job")"

    local claim=$job-ckpt want got
    if ! open_claim "$claim"; then
        fail "s1: the claim $claim can be read (pod read-$claim did not start)"
        return
    fi
    # The newest `keep` of the checkpoints written every `every` steps.
    want=$(for ((s = steps / every * every; s > 0 && keep > 0; s -= every, keep--)); do echo "checkpoint_$s"; done | sort | xargs)
    got=$(in_claim "$claim" 'ls out/checkpoints' | grep -E '^checkpoint_[0-9]+$' | sort | xargs || true)
    check "s1: the claim holds the newest checkpoints ($want; found: ${got:-none})" test "$got" = "$want"
    check "s1: the claim holds TensorBoard events" in_claim "$claim" 'ls out/tensorboard | grep -q "^events.out.tfevents."'
    local size
    size=$(in_claim "$claim" 'stat -c %s out/model.onnx' 2>/dev/null || echo 0)
    check "s1: the claim holds the exported model.onnx ($size bytes)" test "$size" -gt 1000000
    in_claim "$claim" 'cat out/metrics.jsonl' >"$TMP/s1.jsonl" 2>/dev/null || true
    check "s1: metrics.jsonl logs every step 1..$steps" all_steps_logged "$TMP/s1.jsonl" "$steps"
    local first last
    first=$(jq -s "$LOSSES | .[\"1\"]" "$TMP/s1.jsonl" 2>/dev/null || echo null)
    last=$(jq -s --arg n "$steps" "$LOSSES | .[\$n]" "$TMP/s1.jsonl" 2>/dev/null || echo null)
    # shellcheck disable=SC2016 # jq's variables
    check "s1: the loss fell (step 1: $first, step $steps: $last)" \
        jq -ne --argjson a "${first:-null}" --argjson b "${last:-null}" '$a != null and $b != null and $b < $a'
    check "s1: metrics.jsonl has evaluation losses" jq -se 'any(.[]; .evalLoss != null)' "$TMP/s1.jsonl"
    close_claim "$claim"
    delete_job "$job"
}

# ---- scenario 2 -------------------------------------------------------------------------------
scenario_2() {
    local need have
    need=$(manifest_json 3d-parallel.yaml | jq -r '.spec.workers * (.spec.resources.limits["nvidia.com/gpu"] | tonumber)')
    have=$(max_node_gpus)
    if ((have < need)); then
        skip "s2: the 3D-parallel job needs $need GPUs on one node; the nodes have at most $have"
        return
    fi
    local job file
    for file in 3d-single.yaml 3d-parallel.yaml; do
        job=$(manifest_json "$file" | jq -r .metadata.name)
        apply_job "$file" s2 || return 0
        if ! wait_job "$job"; then
            job_failed "$job" "s2: $job ($file) trained to Succeeded"
            return
        fi
        pass "s2: $job ($file) trained to Succeeded"
        if ! open_claim "$job-ckpt"; then
            fail "s2: the claim $job-ckpt can be read (pod read-$job-ckpt did not start)"
            return
        fi
        in_claim "$job-ckpt" 'cat out/metrics.jsonl' >"$TMP/s2-$job.jsonl" 2>/dev/null || true
        close_claim "$job-ckpt"
        [[ $job != three-d ]] ||
            check "s2: the launcher of three-d started 8 ranks" grep -q 'starting 8 ranks' <<<"$(launcher_log three-d)"
        delete_job "$job"
    done
    local steps
    steps=$(manifest_json 3d-single.yaml | jq -r .spec.training.steps)
    check "s2: the single-process run logged every step 1..$steps" all_steps_logged "$TMP/s2-single.jsonl" "$steps"
    check "s2: the 3D run logged every step 1..$steps" all_steps_logged "$TMP/s2-three-d.jsonl" "$steps"
    # Per step, |3D - single| <= RTOL × |single|; the same for the evaluation losses.
    local differ
    differ=$(jq -rn --slurpfile a "$TMP/s2-single.jsonl" --slurpfile b "$TMP/s2-three-d.jsonl" --argjson rtol "$RTOL" '
        def mag: if . < 0 then -. else . end;
        def evals: [.[] | select(.evalLoss != null) | .evalLoss];
        ($a | '"$LOSSES"') as $la | ($b | '"$LOSSES"') as $lb
        | [$la | to_entries[] | select($lb[.key] == null or (($lb[.key] - .value) | mag) > $rtol * (.value | mag))
           | "step \(.key): single \(.value), 3D \($lb[.key])"]
          + (if ($a | evals | length) == 0 or ($a | evals | length) != ($b | evals | length) then
               ["evaluations: single \($a | evals), 3D \($b | evals)"]
             else
               [range($a | evals | length) as $i | ($a | evals)[$i] as $x | ($b | evals)[$i] as $y
                | select((($y - $x) | mag) > $rtol * ($x | mag)) | "evaluation \($i): single \($x), 3D \($y)"]
             end)
        | join("; ")' 2>&1 || echo "the metrics could not be compared")
    check "s2: the 3D run's losses equal the single process's within $RTOL${differ:+ ($differ)}" test -z "$differ"
}

# ---- scenario 3 -------------------------------------------------------------------------------
S3_RESTARTING=
s3_watch() { [[ $JOB_PHASE == Restarting ]] && S3_RESTARTING=1; }

scenario_3() {
    local job=gpu-restart victim=gpu-restart-worker-1 spec steps mount
    spec=$(manifest_json restart.yaml)
    steps=$(jq -r .spec.training.steps <<<"$spec")
    mount=$(jq -r '.spec.storage.mountPath // "/var/lib/tensorfleet"' <<<"$spec")
    apply_job restart.yaml s3 || return 0
    # Mid-training: once the first checkpoint is on the claim (seen from the worker's mount),
    # while the job still runs.
    local newest=
    has_checkpoint() {
        [[ $(phase_of "$job") == Running ]] || return 1
        newest=$(k -n "$NS" exec "$victim" -c worker -- ls "$mount/out/checkpoints" 2>/dev/null |
            grep -E '^checkpoint_[0-9]+$' | sort -t_ -k2 -n | tail -n 1 || true)
        [[ -n $newest ]]
    }
    if ! wait_job_until "$job" has_checkpoint; then
        job_failed "$job" "s3: $job wrote a checkpoint while still running (if it finished first, raise steps in restart.yaml)"
        return
    fi
    k -n "$NS" delete pod "$victim" --wait=false >/dev/null
    pass "s3: deleted $victim mid-training (after $newest of $steps steps)"
    if ! wait_job "$job" s3_watch; then
        job_failed "$job" "s3: $job trained to Succeeded after the deletion"
        return
    fi
    pass "s3: $job trained to Succeeded after the deletion"
    # The phase may last less than a poll; the Restarting condition stays, naming the cause
    # (the deleted pod, or the launcher when mpirun noticed first).
    local cond restarts shown=''
    cond=$(job_get "$job" '{.status.conditions[?(@.type=="Restarting")].message}')
    if [[ -n $S3_RESTARTING || -n $cond ]]; then shown=1; fi
    check "s3: the job showed Restarting (condition: ${cond:-none})" test -n "$shown"
    restarts=$(job_get "$job" '{.status.restartCount}')
    check "s3: the gang restarted once (restartCount ${restarts:-0})" test "${restarts:-0}" = 1
    check "s3: the new gang resumed from a checkpoint (launcher log says resuming)" grep -q 'resuming' <<<"$(launcher_log "$job")"
    if open_claim "$job-ckpt"; then
        in_claim "$job-ckpt" 'cat out/metrics.jsonl' >"$TMP/s3.jsonl" 2>/dev/null || true
        close_claim "$job-ckpt"
        check "s3: metrics.jsonl logs every step 1..$steps across the restart" all_steps_logged "$TMP/s3.jsonl" "$steps"
    else
        fail "s3: the claim $job-ckpt can be read (pod read-$job-ckpt did not start)"
    fi
    delete_job "$job"
}

# ---- scenario 8 -------------------------------------------------------------------------------
scenario_8() {
    local job=gpu-delete claim=gpu-delete-ckpt selector=tensorfleet.dev/job-name=gpu-delete
    apply_job delete.yaml s8 || return 0
    training() {
        local step
        [[ $(phase_of "$job") == Running ]] || return 1
        step=$(job_get "$job" '{.status.progress.step}')
        ((${step:-0} > 0))
    }
    if ! wait_job_until "$job" training; then
        job_failed "$job" "s8: $job is running with progress reported"
        return
    fi
    pass "s8: $job is running with progress reported"
    local children left
    children=$(k -n "$NS" get pods,services,configmaps,secrets -l "$selector" -o name | xargs)
    check "s8: the running job has child objects (${children:-none})" test -n "$children"
    check "s8: its claim $claim exists" k -n "$NS" get pvc "$claim" -o name
    if ! k -n "$NS" delete trainingjob "$job" --wait=true --timeout=120s >/dev/null; then
        fail "s8: kubectl delete trainingjob $job returned within 120 s"
        diagnose "$job"
        return 0
    fi
    local deadline=$((SECONDS + 120))
    while left=$(k -n "$NS" get pods,services,configmaps,secrets -l "$selector" -o name | xargs) && [[ -n $left ]]; do
        ((SECONDS < deadline)) || break
        sleep 2
    done
    check "s8: every child object is gone${left:+ (left: $left)}" test -z "$left"
    # Retain: the claim must still be there after the garbage collector had its turn.
    sleep 5
    local phase
    phase=$(k -n "$NS" get pvc "$claim" -o jsonpath='{.status.phase}' 2>/dev/null || true)
    check "s8: the claim $claim is kept (reclaimPolicy Retain by default; phase ${phase:-gone})" test "$phase" = Bound
}

for s in "${SCENARIOS[@]}"; do
    log "scenario $s"
    started=$SECONDS
    "scenario_$s"
    log "scenario $s took $((SECONDS - started)) s"
done

echo "kind scenarios: $PASSED passed, $FAILED failed, $SKIPPED skipped"
if ((FAILED > 0)) || [[ ${TENSORFLEET_KIND_KEEP:-0} == 1 ]]; then
    log "namespace $NS kept: kubectl --context $CONTEXT -n $NS get trainingjobs,pods,pvc"
else
    k delete namespace "$NS" --wait=false >/dev/null
fi
exit $((FAILED > 0 ? 1 : 0))
