//! The end-to-end scenarios (issue 6) on the local cluster: the real operator (installed with
//! helm, running as a pod), real sshd and mpirun between pods, the real worker. Each one keeps
//! to its own namespace and leaves the cluster as it found it, so they may run side by side
//! (e2e/scenarios/run.sh's SLOTS); those that disrupt the whole cluster are in disruptions.rs.

use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::json;
use std::time::Duration;
use tensorfleet_e2e::{long_quickstart, losses, metrics, phase, quickstart, wait_for_path, Cluster, TRAINING};

/// Scenario 1: the CPU quickstart (2 worker pods × 2 slots, mpirun over ssh between pods) trains
/// to Succeeded; its status shows progress while it runs; the claim holds the checkpoints, the
/// TensorBoard events and the exported model.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn cpu_quickstart_trains_to_succeeded_with_progress_and_outputs_on_the_claim() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("quickstart").await;
    cluster.prepare_data(&ns).await;
    // The example as shipped, with fewer steps (and periods to match) to fit CI's time.
    let mut manifest = quickstart(
        "cpu-quickstart",
        json!({"steps": 60, "checkpoint": {"every": 10, "keep": 2}, "evaluation": {"every": 20, "batches": 2}, "logging": {"every": 1}}),
    );
    // The worker pods stay after the job succeeds, so that their logs (sshd's) can be read: with
    // the default (Running) they are deleted then, and their logs with them.
    manifest["spec"]["runPolicy"]["cleanPodPolicy"] = json!("None");
    let out = cluster.kubectl(&["apply", "-n", &ns, "-f", "-"], Some(&manifest.to_string()));
    assert!(out.status.success(), "kubectl apply: {}", String::from_utf8_lossy(&out.stderr));

    let mut progress_while_running = None;
    let job = cluster
        .wait_job(&ns, "cpu-quickstart", TRAINING, "the quickstart to succeed", |job| {
            let st = job.status.as_ref();
            if phase(job) == "Running" {
                if let Some(p) = st.and_then(|s| s.progress.as_ref()).filter(|p| p.step > 0 && p.step < p.total_steps) {
                    progress_while_running.get_or_insert_with(|| p.summary.clone());
                }
            }
            assert_ne!(phase(job), "Failed", "the quickstart failed: {:?}", st.and_then(|s| s.failure.clone()));
            phase(job) == "Succeeded"
        })
        .await;
    let status = job.status.clone().unwrap();
    assert!(progress_while_running.is_some(), "no progress was shown while the job ran: {status:?}");
    let progress = status.progress.clone().expect("a final progress");
    assert_eq!((progress.step, progress.total_steps), (60, 60), "{progress:?}");
    assert_eq!(status.restart_count, 0, "{status:?}");
    assert!(status.latest_checkpoint.is_some(), "no checkpoint was reported: {status:?}");

    // mpirun reached both worker pods over ssh with the job's key, as the image's user (the
    // pods run as mpiuser, not root), and started 4 ranks, whose training log `kubectl logs`
    // of the launcher shows (mpirun forwards the ranks' output).
    for worker in ["cpu-quickstart-worker-0", "cpu-quickstart-worker-1"] {
        let log = cluster.pod_logs(&ns, worker);
        assert!(log.contains("Accepted publickey for mpiuser"), "{worker} saw no ssh login as mpiuser:\n{log}");
    }
    let launcher = cluster.pod_logs(&ns, "cpu-quickstart-launcher");
    assert!(launcher.contains("starting 4 ranks"), "{launcher}");
    assert!(launcher.contains("step=60 total=60 loss="), "the launcher's log has no training log:\n{launcher}");

    // The claim: checkpoints (the newest 2 kept), metrics, TensorBoard events, the model.
    let out_dir = cluster.claim_dir(&ns, "cpu-quickstart-ckpt").await.join("out");
    let mut checkpoints: Vec<String> = std::fs::read_dir(out_dir.join("checkpoints"))
        .expect("checkpoints on the claim")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    checkpoints.sort();
    assert_eq!(checkpoints, ["checkpoint_50", "checkpoint_60"]);
    let events = std::fs::read_dir(out_dir.join("tensorboard")).expect("TensorBoard events on the claim");
    assert!(events.flatten().any(|e| e.file_name().to_string_lossy().starts_with("events.out.tfevents.")));
    let model = std::fs::metadata(out_dir.join("model.onnx")).expect("the exported model on the claim");
    assert!(model.len() > 1_000_000, "model.onnx is {} bytes", model.len());
    let lines = metrics(&out_dir.join("metrics.jsonl"));
    let per_step = losses(&lines);
    assert_eq!(per_step.keys().copied().collect::<Vec<_>>(), (1..=60).collect::<Vec<u64>>());
    assert!(per_step.values().all(|l| l.is_finite()));
    assert!(per_step[&60] < per_step[&1], "the loss did not fall: {per_step:?}");
    assert!(lines.iter().any(|m| m.get("evalLoss").is_some()), "no evaluation was logged");
    cluster.delete_namespace(&ns).await;
}

/// Scenario 7: bad input. A manifest the schema rejects is refused by the API server with the
/// field named; a job whose model file is corrupt fails at once (exit code 3, no restart) with
/// the worker's own message in its status.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn bad_input_is_refused_or_fails_fast_with_the_workers_message() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("bad-input").await;

    let mut invalid = quickstart("invalid", json!({}));
    invalid["spec"]["workers"] = json!(0);
    let out = cluster.kubectl(&["apply", "-n", &ns, "-f", "-"], Some(&invalid.to_string()));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "workers: 0 was accepted");
    assert!(stderr.contains("spec.workers"), "the error does not name the field: {stderr}");

    // A model file that is not ONNX, mounted into the worker pods from a ConfigMap.
    let configs: Api<ConfigMap> = Api::namespaced(cluster.client.clone(), &ns);
    let bad_model: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "bad-model"}, "data": {"model.onnx": "this is not a protobuf ModelProto"}
    }))
    .unwrap();
    configs.create(&Default::default(), &bad_model).await.expect("creating the ConfigMap");
    cluster.prepare_data(&ns).await;
    let mut manifest = quickstart(
        "corrupt-model",
        json!({"model": {"gpt2": null, "onnx": {"path": "/models/model.onnx", "loss": {"output": "loss"}}}, "steps": 20}),
    );
    manifest["spec"]["worker"] = json!({
        "volumes": [{"name": "models", "configMap": {"name": "bad-model"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
    });
    cluster.apply_job(&ns, &manifest).await.expect("the corrupt-model job is a valid manifest");
    let job = cluster
        .wait_job(&ns, "corrupt-model", TRAINING, "the corrupt-model job to fail", |job| {
            assert_ne!(phase(job), "Succeeded", "a corrupt model trained");
            phase(job) == "Failed"
        })
        .await;
    let status = job.status.unwrap();
    assert_eq!(status.restart_count, 0, "a corrupt model must not be retried: {status:?}");
    let failure = status.failure.expect("the failure's cause");
    assert_eq!(failure.exit_code, Some(3), "{failure:?}");
    let message = failure.message;
    assert!(
        message.contains("/models/model.onnx"),
        "the worker's message naming the file is not in the status: {message}"
    );
    cluster.delete_namespace(&ns).await;
}

/// Scenario 8: deleting a running job removes every child object; the claim stays with
/// reclaimPolicy Retain (the default) and goes, with its directory, with Delete.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn deleting_a_running_job_removes_its_children_and_keeps_the_claim_as_asked() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("delete").await;
    cluster.prepare_data(&ns).await;
    let jobs: Api<tensorfleet_operator::crd::TrainingJob> = Api::namespaced(cluster.client.clone(), &ns);
    for (name, policy) in [("keep", "Retain"), ("drop", "Delete")] {
        let mut manifest = quickstart(name, json!({"steps": 100000, "checkpoint": {"every": 0}}));
        manifest["spec"]["storage"]["reclaimPolicy"] = json!(policy);
        // With its NetworkPolicy, which the API server admits and the cluster (whose bridge
        // enforces none) ignores; its content is network_isolation_admits_only_the_jobs_own_pods'.
        manifest["spec"]["networkPolicy"]["enabled"] = json!(true);
        cluster.apply_job(&ns, &manifest).await.expect("applying the job");
        cluster
            .wait_job(&ns, name, TRAINING, "the job to be running with its launcher", |job| {
                phase(job) == "Running"
                    && job.status.as_ref().is_some_and(|s| s.progress.as_ref().is_some_and(|p| p.step > 0))
            })
            .await;
        let policies: Api<NetworkPolicy> = Api::namespaced(cluster.client.clone(), &ns);
        let isolation = policies.get(&format!("{name}-isolation")).await.expect("the job's NetworkPolicy");
        // The operator's pods are admitted to the progress port: the chart told it their labels.
        let rules = isolation.spec.and_then(|s| s.ingress).unwrap_or_default();
        assert_eq!(rules.len(), 2, "{rules:?}");
        let claim_dir = cluster.claim_dir(&ns, &format!("{name}-ckpt")).await;
        jobs.delete(name, &DeleteParams::default()).await.expect("deleting the job");

        let selector =
            ListParams::default().labels(&format!("{}={name}", tensorfleet_operator::resources::labels::JOB));
        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), &ns);
        let services: Api<Service> = Api::namespaced(cluster.client.clone(), &ns);
        let configs: Api<ConfigMap> = Api::namespaced(cluster.client.clone(), &ns);
        let secrets: Api<Secret> = Api::namespaced(cluster.client.clone(), &ns);
        tensorfleet_e2e::wait_for(Duration::from_secs(120), "the job's children to be gone", || async {
            let left = pods.list(&selector).await.ok()?.items.len()
                + services.list(&selector).await.ok()?.items.len()
                + configs.list(&selector).await.ok()?.items.len()
                + secrets.list(&selector).await.ok()?.items.len()
                + policies.list(&selector).await.ok()?.items.len();
            (left == 0).then_some(())
        })
        .await;
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.client.clone(), &ns);
        let claim = format!("{name}-ckpt");
        if policy == "Retain" {
            tokio::time::sleep(Duration::from_secs(3)).await;
            assert!(claims.get_opt(&claim).await.unwrap().is_some(), "the Retain claim was deleted");
            assert!(claim_dir.is_dir(), "the Retain claim's data is gone");
        } else {
            tensorfleet_e2e::wait_for(Duration::from_secs(60), "the Delete claim and its volume to go", || async {
                let gone = claims.get_opt(&claim).await.ok()?.is_none() && !claim_dir.exists();
                gone.then_some(())
            })
            .await;
        }
    }
    cluster.delete_namespace(&ns).await;
}

/// With spec.networkPolicy.enabled, a pod outside the job cannot reach a worker's sshd, while
/// the job's launcher can (and the job trains). The local cluster enforces NetworkPolicy with
/// kube-router's network policy controller (e2e/nodes/up.sh).
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn network_isolation_admits_only_the_jobs_own_pods() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("isolated").await;
    cluster.prepare_data(&ns).await;
    let mut manifest = quickstart("walled", json!({"steps": 100000, "checkpoint": {"every": 0}}));
    manifest["spec"]["networkPolicy"]["enabled"] = json!(true);
    let image = manifest["spec"]["image"].as_str().expect("the quickstart's image").to_string();
    cluster.apply_job(&ns, &manifest).await.expect("applying the job");
    cluster
        .wait_job(&ns, "walled", TRAINING, "the job to train", |job| {
            // Its own pods must reach each other through the policy (the launcher's ssh first).
            assert_ne!(phase(job), "Failed", "the isolated job failed: {:?}", job.status);
            job.status.as_ref().is_some_and(|s| s.progress.as_ref().is_some_and(|p| p.step > 0))
        })
        .await;
    let sshd = format!("walled-worker-0.walled.{ns}.svc/2222");
    let probe = format!("timeout 5 bash -c 'exec 3<>/dev/tcp/{sshd}' && echo reached");
    let inside = cluster.kubectl(&["exec", "-n", &ns, "walled-launcher", "--", "bash", "-c", &probe], None);
    assert!(String::from_utf8_lossy(&inside.stdout).contains("reached"), "the launcher cannot reach {sshd}");
    // The same probe from a pod of the same namespace that is not the job's.
    let outsider = json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "outsider", "namespace": ns},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "probe", "image": image, "imagePullPolicy": "IfNotPresent", "command": ["bash", "-c", probe],
            "securityContext": {"runAsNonRoot": true, "runAsUser": 1000, "allowPrivilegeEscalation": false,
                "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}}]}
    });
    let made = cluster.kubectl(&["apply", "-f", "-"], Some(&outsider.to_string()));
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), &ns);
    let done = tensorfleet_e2e::wait_for(TRAINING, "the outsider's probe to finish", || async {
        let pod = pods.get("outsider").await.ok()?;
        let phase = pod.status.as_ref()?.phase.clone()?;
        matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase)
    })
    .await;
    let log = cluster.pod_logs(&ns, "outsider");
    assert!(done == "Failed" && !log.contains("reached"), "a pod outside the job reached {sshd}: {log}");
    cluster.delete_namespace(&ns).await;
}

/// Runs `name` to Succeeded without interference; its per-step losses are the reference.
async fn uninterrupted_losses(cluster: &Cluster, ns: &str, name: &str) -> std::collections::BTreeMap<u64, f64> {
    cluster.apply_job(ns, &long_quickstart(name)).await.expect("applying the reference job");
    cluster.wait_job(ns, name, TRAINING, "the reference run to succeed", |j| phase(j) == "Succeeded").await;
    let dir = cluster.claim_dir(ns, &format!("{name}-ckpt")).await;
    losses(&metrics(&dir.join("out/metrics.jsonl")))
}

/// Scenario 3: killing a worker pod's processes mid-training restarts the gang (the job shows
/// Restarting), training resumes from the newest checkpoint, and the final per-step losses are
/// the uninterrupted run's.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn a_killed_worker_restarts_the_gang_which_resumes_to_the_uninterrupted_losses() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("kill-worker").await;
    cluster.prepare_data(&ns).await;
    let reference = uninterrupted_losses(&cluster, &ns, "steady").await;

    cluster.apply_job(&ns, &long_quickstart("crash")).await.expect("applying the job");
    cluster.wait_job(&ns, "crash", TRAINING, "the job to run", |j| phase(j) == "Running").await;
    let claim = cluster.claim_dir(&ns, "crash-ckpt").await;
    wait_for_path(&claim.join("out/checkpoints/checkpoint_10"), TRAINING).await;
    // `kubectl exec` reaches a worker while it trains, as the pods' user.
    let out = cluster.kubectl(&["exec", "-n", &ns, "crash-worker-0", "--", "id", "-un"], None);
    let user = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && user.trim() == "mpiuser",
        "kubectl exec: {user}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // What a crashed node or an OOM kill does: every process of the pod dies at once (the
    // container's first process is sshd; the kernel takes its PID namespace, ranks included).
    let pid = cluster.container(&ns, "crash-worker-1").await.pid.to_string();
    let killed = std::process::Command::new("kill").args(["-KILL", &pid]).status().expect("kill");
    assert!(killed.success(), "kill -KILL {pid} failed");

    let mut saw_restarting = false;
    let job = cluster
        .wait_job(&ns, "crash", TRAINING, "the restarted job to succeed", |j| {
            saw_restarting |= phase(j) == "Restarting";
            assert_ne!(phase(j), "Failed", "the job failed instead of restarting: {:?}", j.status);
            phase(j) == "Succeeded"
        })
        .await;
    let status = job.status.unwrap();
    // The phase may be Restarting for less than a poll; its condition stays, with the cause.
    let restarting = status.conditions.iter().find(|c| c.type_ == "Restarting");
    assert!(
        saw_restarting || restarting.is_some_and(|c| c.message.contains("crash-worker-1") && c.message.contains("137")),
        "the job never showed Restarting for the killed worker: {status:?}"
    );
    assert_eq!(status.restart_count, 1, "{status:?}");
    let worker_log = cluster.pod_logs(&ns, "crash-worker-0");
    let dir = cluster.claim_dir(&ns, "crash-ckpt").await;
    let resumed = losses(&metrics(&dir.join("out/metrics.jsonl")));
    assert_eq!(resumed.len(), 60, "steps logged: {:?}\n{worker_log}", resumed.keys());
    for (step, loss) in &reference {
        let got = resumed[step];
        assert!(
            (got - loss).abs() <= 1e-6 * loss.abs().max(1.0),
            "step {step}: {got} after the restart, {loss} uninterrupted"
        );
    }
    cluster.delete_namespace(&ns).await;
}

/// A worker whose container goes over its memory limit is OOM-killed by the kernel: the whole
/// container stops (as memory.oom.group makes it on cgroup v2; the worker's program does it on
/// v1), the job restarts with the reason OOMKilled naming the pod, and resumes from its newest
/// checkpoint to the end.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn a_worker_over_its_memory_limit_is_oom_killed_and_the_job_resumes() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("oom").await;
    cluster.prepare_data(&ns).await;
    let mut manifest = long_quickstart("oom");
    manifest["spec"]["resources"]["limits"]["memory"] = json!(OOM_LIMIT);
    cluster.apply_job(&ns, &manifest).await.expect("applying the job");
    cluster.wait_job(&ns, "oom", TRAINING, "the job to run", |j| phase(j) == "Running").await;
    let claim = cluster.claim_dir(&ns, "oom-ckpt").await;
    wait_for_path(&claim.join("out/checkpoints/checkpoint_10"), TRAINING).await;
    // Something in the container takes more than the limit (a data loader's buffers, say): a
    // process that keeps all it reads, started in the worker as its user. The kernel kills it
    // (the largest), and with it goes the container.
    let hog = cluster.kubectl(&["exec", "-n", &ns, "oom-worker-1", "--", "sh", "-c", HOG], None);
    assert!(!hog.status.success(), "{HOG} outlived a {OOM_LIMIT} limit");

    let job = cluster
        .wait_job(&ns, "oom", TRAINING, "the job to succeed after the OOM kill", |j| {
            assert_ne!(phase(j), "Failed", "{:?}", j.status);
            phase(j) == "Succeeded"
        })
        .await;
    let status = job.status.unwrap();
    assert_eq!(status.restart_count, 1, "{status:?}");
    let failure = status.failure.clone().expect("the cause of the restart");
    assert_eq!((failure.pod.as_str(), failure.reason.as_str()), ("oom-worker-1", "OOMKilled"), "{failure:?}");
    assert_eq!(failure.exit_code, Some(137), "{failure:?}");
    let restarting = status.condition(tensorfleet_operator::crd::JobPhase::Restarting).expect("a Restarting condition");
    assert_eq!(restarting.reason, "OOMKilled", "{restarting:?}");
    let steps = losses(&metrics(&claim.join("out/metrics.jsonl")));
    assert_eq!(steps.keys().copied().collect::<Vec<u64>>(), (1..=60).collect::<Vec<u64>>(), "{status:?}");
    let log = cluster.pod_logs(&ns, "oom-launcher");
    assert!(log.contains("resum"), "the restarted ranks did not resume from a checkpoint:\n{log}");
    cluster.delete_namespace(&ns).await;
}

/// The OOM scenario's memory limit, and what goes over it: `tail` keeps a line until its end,
/// and this one has none.
const OOM_LIMIT: &str = "2Gi";
const HOG: &str = "head -c 3G /dev/zero | tail -n 1 >/dev/null";

/// Scenario 6: suspending a running job deletes its pods; resuming brings them back, the
/// active-deadline clock starts again, and the job completes.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn suspend_then_resume_brings_the_pods_back_and_resets_the_deadline_clock() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("suspend").await;
    cluster.prepare_data(&ns).await;
    let mut manifest = long_quickstart("pausable");
    manifest["spec"]["runPolicy"] = json!({"activeDeadlineSeconds": 600});
    cluster.apply_job(&ns, &manifest).await.expect("applying the job");
    cluster.wait_job(&ns, "pausable", TRAINING, "the job to run", |j| phase(j) == "Running").await;
    let claim = cluster.claim_dir(&ns, "pausable-ckpt").await;
    wait_for_path(&claim.join("out/checkpoints/checkpoint_10"), TRAINING).await;
    let running = cluster.job(&ns, "pausable").await;
    assert_eq!(phase(&running), "Running", "the job finished before it could be suspended");
    let first_active = running.status.unwrap().active_since.expect("activeSince while running");

    manifest["spec"]["runPolicy"]["suspend"] = json!(true);
    cluster.apply_job(&ns, &manifest).await.expect("suspending");
    cluster.wait_job(&ns, "pausable", Duration::from_secs(120), "Suspended", |j| phase(j) == "Suspended").await;
    tensorfleet_e2e::wait_for(Duration::from_secs(120), "the suspended job's pods to go", || async {
        let left = cluster.pods(&ns, "worker").await.len() + cluster.pods(&ns, "launcher").await.len();
        (left == 0).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    manifest["spec"]["runPolicy"]["suspend"] = json!(false);
    cluster.apply_job(&ns, &manifest).await.expect("resuming");
    let resumed = cluster
        .wait_job(&ns, "pausable", TRAINING, "the resumed job to run", |j| {
            phase(j) == "Running" && j.status.as_ref().is_some_and(|s| s.active_since.is_some())
        })
        .await;
    let second_active = resumed.status.unwrap().active_since.unwrap();
    assert!(second_active.0 > first_active.0, "activeSince did not reset: {first_active:?} then {second_active:?}");
    assert_eq!(cluster.pods(&ns, "worker").await.len(), 2);
    let done = cluster
        .wait_job(&ns, "pausable", TRAINING, "the resumed job to succeed", |j| {
            assert_ne!(phase(j), "Failed", "{:?}", j.status);
            phase(j) == "Succeeded"
        })
        .await;
    // It resumed from its checkpoint (metrics.jsonl is appended to): step 1 was trained once.
    let dir = cluster.claim_dir(&ns, "pausable-ckpt").await;
    let lines = metrics(&dir.join("out/metrics.jsonl"));
    assert_eq!(losses(&lines).len(), 60, "{:?}", done.status);
    let first_steps = lines.iter().filter(|m| m.get("step") == Some(&json!(1)) && m.get("loss").is_some()).count();
    assert_eq!(first_steps, 1, "the resumed job started over instead of from its checkpoint");
    cluster.delete_namespace(&ns).await;
}

/// Scenario 4: killing the worker that holds rank 0 while it writes a checkpoint leaves a
/// partial checkpoint behind (its temporary directory); the restarted gang never loads it,
/// resumes from the checkpoint before, and ends with the uninterrupted run's losses.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn a_worker_killed_while_writing_a_checkpoint_never_has_that_checkpoint_loaded() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("kill-in-checkpoint").await;
    cluster.prepare_data(&ns).await;
    let reference = uninterrupted_losses(&cluster, &ns, "steady").await;

    cluster.apply_job(&ns, &long_quickstart("torn")).await.expect("applying the job");
    cluster.wait_job(&ns, "torn", TRAINING, "the job to run", |j| phase(j) == "Running").await;
    let checkpoints = cluster.claim_dir(&ns, "torn-ckpt").await.join("out/checkpoints");
    // Its first process's host pid from the runtime, so that the kill below takes no longer
    // than a signal.
    let pid = cluster.container(&ns, "torn-worker-0").await.pid.to_string();
    // Watch for a checkpoint being written (its temporary directory, holding rank 0's tensors but
    // no manifest yet) after the first complete one, and kill rank 0's pod right then.
    let deadline = std::time::Instant::now() + TRAINING;
    let torn_step = loop {
        assert!(std::time::Instant::now() < deadline, "never caught a checkpoint being written");
        let entries: Vec<String> = std::fs::read_dir(&checkpoints)
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let complete = entries.iter().any(|e| e.starts_with("checkpoint_"));
        let writing =
            entries.iter().find_map(|e| e.strip_prefix(".checkpoint_")?.strip_suffix(".tmp").map(String::from));
        if let (true, Some(step)) = (complete, writing) {
            let tmp = checkpoints.join(format!(".checkpoint_{step}.tmp"));
            if tmp.join("rank_0.safetensors").exists() && !tmp.join("manifest.json").exists() {
                let killed = std::process::Command::new("kill").args(["-KILL", &pid]).status().expect("kill");
                assert!(killed.success());
                break step;
            }
        }
        std::thread::sleep(Duration::from_micros(500));
    };
    assert!(
        !checkpoints.join(format!("checkpoint_{torn_step}")).exists(),
        "checkpoint_{torn_step} was completed before the kill took effect"
    );

    let job = cluster
        .wait_job(&ns, "torn", TRAINING, "the restarted job to succeed", |j| {
            assert_ne!(phase(j), "Failed", "{:?}", j.status);
            phase(j) == "Succeeded"
        })
        .await;
    assert_eq!(job.status.as_ref().unwrap().restart_count, 1, "{:?}", job.status);
    // The second attempt resumed from the checkpoint before the torn one.
    let launcher = cluster.pod_logs(&ns, "torn-launcher");
    let resumed: Vec<&str> = launcher.lines().filter(|l| l.contains("resuming")).collect();
    assert!(!resumed.is_empty(), "the restarted run did not resume:\n{launcher}");
    assert!(
        resumed.iter().all(|l| !l.contains(&format!("checkpoint_{torn_step}"))),
        "the torn checkpoint_{torn_step} was loaded: {resumed:?}"
    );
    let dir = cluster.claim_dir(&ns, "torn-ckpt").await;
    let after = losses(&metrics(&dir.join("out/metrics.jsonl")));
    assert_eq!(after.len(), 60);
    for (step, loss) in &reference {
        let got = after[step];
        assert!(
            (got - loss).abs() <= 1e-6 * loss.abs().max(1.0),
            "step {step}: {got} after the restart, {loss} uninterrupted"
        );
    }
    cluster.delete_namespace(&ns).await;
}

/// Scenario 2: a 3D-parallel job (data 2 × tensor 2 × pipeline 2: 2 worker pods × 4 slots)
/// trains to Succeeded with the losses of the same training in a single process.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn a_3d_parallel_job_trains_to_the_losses_of_its_single_process_run() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("three-d").await;
    cluster.prepare_data(&ns).await;
    // A small GPT-2 (2 heads split over 2 tensor ranks, 2 layers over 2 stages); the same
    // global batch both ways: 2 data ranks × 2 sequences, or 4 sequences in one process.
    let training = |batch: u32, data: u32, tensor: u32, pipeline: u32| {
        json!({
            "model": {"gpt2": {"layers": 2, "heads": 2, "embed": 32, "seqLen": 16, "vocab": 50257}},
            "batchSize": batch, "gradientAccumulationSteps": 2, "steps": 6,
            "lrSchedule": {"warmupSteps": 2}, "evaluation": {"every": 3, "batches": 2},
            "checkpoint": {"every": 3, "keep": 2}, "logging": {"every": 1},
            "parallelism": {"data": data, "tensor": tensor, "pipeline": pipeline},
        })
    };
    let mut single = quickstart("single", training(4, 1, 1, 1));
    single["spec"]["workers"] = json!(1);
    single["spec"]["slotsPerWorker"] = json!(1);
    let mut three_d = quickstart("three-d", training(2, 2, 2, 2));
    three_d["spec"]["slotsPerWorker"] = json!(4);
    let mut runs = Vec::new();
    for manifest in [single, three_d] {
        let name = manifest["metadata"]["name"].as_str().unwrap().to_string();
        cluster.apply_job(&ns, &manifest).await.expect("applying the job");
        cluster
            .wait_job(&ns, &name, TRAINING, &format!("{name} to succeed"), |j| {
                assert_ne!(phase(j), "Failed", "{name} failed: {:?}", j.status);
                phase(j) == "Succeeded"
            })
            .await;
        let lines = metrics(&cluster.claim_dir(&ns, &format!("{name}-ckpt")).await.join("out/metrics.jsonl"));
        let eval: Vec<(u64, f64)> =
            lines.iter().filter_map(|m| Some((m.get("step")?.as_u64()?, m.get("evalLoss")?.as_f64()?))).collect();
        runs.push((losses(&lines), eval));
    }
    let launcher = cluster.pod_logs(&ns, "three-d-launcher");
    assert!(launcher.contains("starting 8 ranks"), "{launcher}");
    let ((want, want_eval), (got, got_eval)) = (&runs[0], &runs[1]);
    assert_eq!(want.len(), 6, "{want:?}");
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    for (step, loss) in want {
        assert!((got[step] - loss).abs() <= 1e-5 * loss.abs(), "step {step}: 3D {} vs single {loss}", got[step]);
    }
    assert_eq!(want_eval.len(), 2, "{want_eval:?}");
    for ((s1, l1), (s2, l2)) in got_eval.iter().zip(want_eval) {
        assert_eq!(s1, s2);
        assert!((l1 - l2).abs() <= 1e-5 * l2.abs(), "evalLoss at step {s1}: 3D {l1} vs single {l2}");
    }
    cluster.delete_namespace(&ns).await;
}

/// A job whose image is not on the nodes (pull policy Never, as in this cluster) waits, as the
/// kubelet keeps trying; its status names the image and the kubelet's reason.
#[tokio::test]
#[ignore = "needs the local cluster of `make e2e` (TENSORFLEET_E2E_CLUSTER)"]
async fn a_missing_image_is_named_in_the_jobs_status() {
    let cluster = Cluster::connect().await;
    let ns = cluster.namespace("missing-image").await;
    let mut manifest = quickstart("no-image", json!({}));
    manifest["spec"]["image"] = json!("tensorfleet/worker:not-built");
    manifest["spec"]["imagePullPolicy"] = json!("Never");
    // No data claim in this namespace: without the volume the pods get as far as the image.
    manifest["spec"].as_object_mut().unwrap().remove("data");
    cluster.apply_job(&ns, &manifest).await.expect("applying the job");
    let job = cluster
        .wait_job(&ns, "no-image", Duration::from_secs(120), "the status to name the missing image", |j| {
            let st = j.status.as_ref();
            let condition = st.and_then(|s| s.condition(s.phase?)).map(|c| (c.reason.clone(), c.message.clone()));
            condition.is_some_and(|(reason, message)| {
                reason == "ImageUnavailable" && message.contains("tensorfleet/worker:not-built")
            })
        })
        .await;
    let status = job.status.as_ref().unwrap();
    let message = &status.condition(status.phase.unwrap()).unwrap().message;
    assert!(message.contains("ErrImageNeverPull"), "{message}");
    assert_eq!(phase(&job), "Created", "{message}");
    cluster.delete_namespace(&ns).await;
}
