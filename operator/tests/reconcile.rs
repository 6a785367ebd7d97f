//! The operator against a real API server, etcd, controller-manager and scheduler: children,
//! launcher gating, status, gang restarts, run policy, deletion, operator restarts, leader
//! election. Each test runs its own operator process on its own namespace.

mod common;

use common::*;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret, Service};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;
use std::time::Duration;

async fn names_of<K>(client: &kube::Client, ns: &str) -> Vec<String>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    let mut names: Vec<String> =
        api.list(&ListParams::default()).await.unwrap().items.iter().map(|o| o.name_any()).collect();
    names.sort();
    names
}

async fn make_workers_ready(client: &kube::Client, ns: &str, count: usize) {
    let workers = wait_for(Duration::from_secs(30), "the worker pods", || async {
        let p = pods(client, ns, "worker").await;
        (p.len() == count).then_some(p)
    })
    .await;
    for w in &workers {
        set_pod_state(client, ns, &w.name_any(), PodState::Running).await;
    }
}

async fn launcher(client: &kube::Client, ns: &str) -> Pod {
    wait_for(Duration::from_secs(30), "the launcher pod", || async { pods(client, ns, "launcher").await.pop() }).await
}

#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn job_becomes_children_then_runs_reports_progress_and_succeeds() {
    let client = client().await;
    let ns = namespace(&client, "lifecycle").await;
    let _operator = Operator::start(&ns);
    // rank 0's progress endpoint, played by a socket on this machine (worker pods get 127.0.0.1).
    let progress = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let progress_port = progress.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut s in progress.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            let body = r#"{"step": 7, "totalSteps": 20, "loss": 4.5, "tokensPerSecond": 1234.0, "etaSeconds": 30, "latestCheckpoint": "checkpoint_5"}"#;
            let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        }
    });
    let mut manifest = job_manifest("llm", 2);
    manifest["spec"]["progressPort"] = json!(progress_port);
    apply_job(&client, &ns, &manifest).await.unwrap();

    let job = wait_job(&client, &ns, "llm", "phase Created", |j| phase(j) == "Created").await;
    let workers = wait_for(Duration::from_secs(30), "2 worker pods", || async {
        let p = pods(&client, &ns, "worker").await;
        (p.len() == 2).then_some(p)
    })
    .await;
    assert_eq!(names_of::<ConfigMap>(&client, &ns).await, ["kube-root-ca.crt", "llm-config"]);
    assert_eq!(names_of::<Secret>(&client, &ns).await, ["llm-ssh"]);
    assert_eq!(names_of::<Service>(&client, &ns).await, ["llm"]);
    assert_eq!(names_of::<PersistentVolumeClaim>(&client, &ns).await, ["llm-ckpt"]);
    for w in &workers {
        let owner = &w.owner_references()[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str()), ("TrainingJob", job.uid().unwrap().as_str()));
        assert_eq!(owner.controller, Some(true));
    }
    let cm: ConfigMap = Api::namespaced(client.clone(), &ns).get("llm-config").await.unwrap();
    let data = cm.data.unwrap();
    assert_eq!(data["hostfile"], format!("llm-worker-0.llm.{ns}.svc slots=1\nllm-worker-1.llm.{ns}.svc slots=1\n"));
    assert!(data["train.yaml"].contains("/data/train"), "{}", data["train.yaml"]);
    let svc: Service = Api::namespaced(client.clone(), &ns).get("llm").await.unwrap();
    assert_eq!(svc.spec.unwrap().cluster_ip.as_deref(), Some("None"));
    // The claim is retained by default: no owner reference.
    let pvc: PersistentVolumeClaim = Api::namespaced(client.clone(), &ns).get("llm-ckpt").await.unwrap();
    assert!(pvc.owner_references().is_empty());

    // No launcher until every worker is ready; one ready worker is not enough.
    set_pod_state(&client, &ns, "llm-worker-0", PodState::Running).await;
    set_pod_state(&client, &ns, "llm-worker-1", PodState::RunningNotReady).await;
    wait_job(&client, &ns, "llm", "workers 1/2", |j| {
        j.status.as_ref().and_then(|s| s.workers_summary.as_deref()) == Some("1/2")
    })
    .await;
    assert!(pods(&client, &ns, "launcher").await.is_empty(), "launcher created before all workers were ready");
    set_pod_state(&client, &ns, "llm-worker-1", PodState::Running).await;
    let l = launcher(&client, &ns).await;
    assert_eq!(l.name_any(), "llm-launcher");

    set_pod_state(&client, &ns, "llm-launcher", PodState::Running).await;
    let job = wait_job(&client, &ns, "llm", "progress in status", |j| {
        phase(j) == "Running" && j.status.as_ref().is_some_and(|s| s.progress.is_some())
    })
    .await;
    let st = job.status.unwrap();
    let p = st.progress.unwrap();
    assert_eq!((p.step, p.total_steps), (7, 20));
    assert_eq!(p.summary, "7/20 (35%) loss 4.5000 eta 30s");
    assert_eq!(st.latest_checkpoint.as_deref(), Some("checkpoint_5"));
    assert!(st.start_time.is_some());

    set_pod_state(&client, &ns, "llm-launcher", PodState::Exited { code: 0, reason: "Completed", message: "" }).await;
    let job = wait_job(&client, &ns, "llm", "phase Succeeded", |j| phase(j) == "Succeeded").await;
    assert!(job.status.unwrap().completion_time.is_some());
    // cleanPodPolicy Running (the default): running workers go, the finished launcher stays.
    wait_for(Duration::from_secs(30), "running workers deleted", || async {
        pods(&client, &ns, "worker").await.is_empty().then_some(())
    })
    .await;
    assert_eq!(pods(&client, &ns, "launcher").await.len(), 1);
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn failed_rank_restarts_the_gang_until_the_backoff_limit() {
    let client = client().await;
    let ns = namespace(&client, "restart").await;
    let _operator = Operator::start(&ns);
    let mut manifest = job_manifest("gang", 2);
    manifest["spec"]["runPolicy"] = json!({"backoffLimit": 1});
    apply_job(&client, &ns, &manifest).await.unwrap();
    make_workers_ready(&client, &ns, 2).await;
    launcher(&client, &ns).await;
    set_pod_state(&client, &ns, "gang-launcher", PodState::Running).await;
    wait_job(&client, &ns, "gang", "Running", |j| phase(j) == "Running").await;

    set_pod_state(&client, &ns, "gang-worker-1", PodState::Exited { code: 137, reason: "OOMKilled", message: "" })
        .await;
    let job =
        wait_job(&client, &ns, "gang", "Restarting", |j| j.status.as_ref().is_some_and(|s| s.restart_count == 1)).await;
    let st = job.status.unwrap();
    let failure = st.failure.unwrap();
    assert_eq!(
        (failure.pod.as_str(), failure.reason.as_str(), failure.exit_code),
        ("gang-worker-1", "OOMKilled", Some(137))
    );
    let restarting = st.conditions.iter().find(|c| c.type_ == "Restarting").expect("Restarting condition");
    assert_eq!(restarting.reason, "OOMKilled");
    // The whole gang comes back as attempt 1, with the same names.
    let fresh = wait_for(Duration::from_secs(30), "2 workers of attempt 1", || async {
        let p = pods(&client, &ns, "worker").await;
        (p.len() == 2 && p.iter().all(|p| p.labels()["tensorfleet.dev/attempt"] == "1")).then_some(p)
    })
    .await;
    assert_eq!(fresh.iter().map(|p| p.name_any()).collect::<Vec<_>>(), ["gang-worker-0", "gang-worker-1"]);
    assert!(pods(&client, &ns, "launcher").await.is_empty(), "the old launcher must be gone");

    // Again, now with the restarts used up: Failed, naming the evicted pod.
    make_workers_ready(&client, &ns, 2).await;
    launcher(&client, &ns).await;
    set_pod_state(&client, &ns, "gang-worker-0", PodState::Evicted).await;
    let job = wait_job(&client, &ns, "gang", "Failed", |j| phase(j) == "Failed").await;
    let st = job.status.unwrap();
    assert_eq!(st.restart_count, 1);
    let failed = st.conditions.iter().find(|c| c.type_ == "Failed").unwrap();
    assert_eq!(failed.reason, "BackoffLimitExceeded");
    assert!(failed.message.contains("gang-worker-0") && failed.message.contains("Evicted"), "{}", failed.message);
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn worker_exit_code_3_fails_at_once_with_the_workers_message() {
    let client = client().await;
    let ns = namespace(&client, "corrupt").await;
    let _operator = Operator::start(&ns);
    apply_job(&client, &ns, &job_manifest("bad", 1)).await.unwrap();
    make_workers_ready(&client, &ns, 1).await;
    launcher(&client, &ns).await;
    let message = "rank 0: starting\nerror: /data/model.onnx: not an ONNX model (protobuf decode failed at byte 12)\n";
    set_pod_state(&client, &ns, "bad-launcher", PodState::Exited { code: 3, reason: "Error", message }).await;
    let job = wait_job(&client, &ns, "bad", "Failed", |j| phase(j) == "Failed").await;
    let st = job.status.unwrap();
    assert_eq!(st.restart_count, 0, "exit code 3 must not restart");
    let failed = st.conditions.iter().find(|c| c.type_ == "Failed").unwrap();
    assert_eq!(failed.reason, "CorruptInput");
    assert!(failed.message.contains("not an ONNX model"), "{}", failed.message);
    assert_eq!(st.failure.unwrap().exit_code, Some(3));
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn suspend_deletes_pods_and_resume_brings_them_back_with_a_fresh_deadline() {
    let client = client().await;
    let ns = namespace(&client, "suspend").await;
    let _operator = Operator::start(&ns);
    let mut manifest = job_manifest("pause", 2);
    manifest["spec"]["runPolicy"] = json!({"activeDeadlineSeconds": 6});
    apply_job(&client, &ns, &manifest).await.unwrap();
    make_workers_ready(&client, &ns, 2).await;
    launcher(&client, &ns).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    manifest["spec"]["runPolicy"]["suspend"] = json!(true);
    apply_job(&client, &ns, &manifest).await.unwrap();
    let job = wait_job(&client, &ns, "pause", "Suspended", |j| phase(j) == "Suspended").await;
    assert!(job.status.unwrap().active_since.is_none());
    wait_for(Duration::from_secs(30), "pods deleted", || async {
        let (w, l) = (pods(&client, &ns, "worker").await, pods(&client, &ns, "launcher").await);
        (w.is_empty() && l.is_empty()).then_some(())
    })
    .await;
    // Suspended time does not count against the deadline.
    tokio::time::sleep(Duration::from_secs(4)).await;
    manifest["spec"]["runPolicy"]["suspend"] = json!(false);
    apply_job(&client, &ns, &manifest).await.unwrap();
    wait_for(Duration::from_secs(30), "workers back", || async {
        (pods(&client, &ns, "worker").await.len() == 2).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let job = get_job(&client, &ns, "pause").await;
    assert_ne!(phase(&job), "Failed", "4 s active before + 2 s after resume must not exceed the 6 s deadline");
    let job = wait_job(&client, &ns, "pause", "DeadlineExceeded", |j| phase(j) == "Failed").await;
    let failed = job.status.unwrap().conditions.into_iter().find(|c| c.type_ == "Failed").unwrap();
    assert_eq!(failed.reason, "DeadlineExceeded");
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn ttl_deletes_the_finished_job_and_the_garbage_collector_its_children() {
    let client = client().await;
    let ns = namespace(&client, "ttl").await;
    let _operator = Operator::start(&ns);
    let mut keep = job_manifest("keep", 1);
    keep["spec"]["runPolicy"] = json!({"ttlSecondsAfterFinished": 1});
    let mut drop = job_manifest("drop", 1);
    drop["spec"]["runPolicy"] = json!({"ttlSecondsAfterFinished": 1});
    drop["spec"]["storage"] = json!({"reclaimPolicy": "Delete"});
    for (name, manifest) in [("keep", &keep), ("drop", &drop)] {
        apply_job(&client, &ns, manifest).await.unwrap();
        let worker = format!("{name}-worker-0");
        wait_for(Duration::from_secs(30), "worker", || async {
            Api::<Pod>::namespaced(client.clone(), &ns).get_opt(&worker).await.ok()?
        })
        .await;
        set_pod_state(&client, &ns, &worker, PodState::Running).await;
        let launcher = format!("{name}-launcher");
        wait_for(Duration::from_secs(30), "launcher", || async {
            Api::<Pod>::namespaced(client.clone(), &ns).get_opt(&launcher).await.ok()?
        })
        .await;
        set_pod_state(&client, &ns, &launcher, PodState::Exited { code: 0, reason: "Completed", message: "" }).await;
    }
    let jobs: Api<tensorfleet_operator::crd::TrainingJob> = Api::namespaced(client.clone(), &ns);
    wait_for(Duration::from_secs(60), "both jobs deleted by their TTL", || async {
        jobs.list(&ListParams::default()).await.ok()?.items.is_empty().then_some(())
    })
    .await;
    // The controller-manager's garbage collector follows the owner references.
    wait_for(Duration::from_secs(60), "children collected", || async {
        let cms = names_of::<ConfigMap>(&client, &ns).await;
        let all_gone = cms == ["kube-root-ca.crt"]
            && names_of::<Secret>(&client, &ns).await.is_empty()
            && names_of::<Service>(&client, &ns).await.is_empty()
            && names_of::<Pod>(&client, &ns).await.is_empty();
        all_gone.then_some(())
    })
    .await;
    wait_for(Duration::from_secs(60), "only the retained claim left", || async {
        (names_of::<PersistentVolumeClaim>(&client, &ns).await == ["keep-ckpt"]).then_some(())
    })
    .await;
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn operator_killed_mid_reconcile_leaves_no_duplicates_or_orphans() {
    let client = client().await;
    let ns = namespace(&client, "crash").await;
    let operator = Operator::start(&ns);
    apply_job(&client, &ns, &job_manifest("big", 8)).await.unwrap();
    wait_for(Duration::from_secs(30), "the first worker pod", || async {
        (!pods(&client, &ns, "worker").await.is_empty()).then_some(())
    })
    .await;
    operator.kill();
    let created_before = pods(&client, &ns, "worker").await.len();
    let operator = Operator::start(&ns);
    let workers = wait_for(Duration::from_secs(30), "8 workers", || async {
        let p = pods(&client, &ns, "worker").await;
        (p.len() == 8).then_some(p)
    })
    .await;
    let names: Vec<String> = workers.iter().map(|p| p.name_any()).collect();
    let expected: Vec<String> = (0..8).map(|i| format!("big-worker-{i}")).collect();
    let mut sorted = expected.clone();
    sorted.sort();
    assert_eq!(names, sorted, "{created_before} existed when the operator died");
    assert_eq!(names_of::<Secret>(&client, &ns).await, ["big-ssh"]);
    // The keys survived the restart: the Secret was not regenerated.
    let secret_before: Secret = Api::namespaced(client.clone(), &ns).get("big-ssh").await.unwrap();
    for w in &workers {
        set_pod_state(&client, &ns, &w.name_any(), PodState::Running).await;
    }
    launcher(&client, &ns).await;
    // A graceful stop in the middle, then a third operator: still one launcher, same keys.
    assert!(operator.terminate(), "the operator exits on SIGTERM");
    let _operator = Operator::start(&ns);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(pods(&client, &ns, "launcher").await.len(), 1);
    assert_eq!(pods(&client, &ns, "worker").await.len(), 8);
    let secret_after: Secret = Api::namespaced(client.clone(), &ns).get("big-ssh").await.unwrap();
    assert_eq!(secret_before.data, secret_after.data);
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn invalid_manifests_are_rejected_naming_the_field() {
    let client = client().await;
    let ns = namespace(&client, "invalid").await;
    let reject = |patch: serde_json::Value| {
        let client = client.clone();
        let ns = ns.clone();
        async move {
            let mut m = job_manifest("bad", 2);
            json_merge(&mut m, &patch);
            match apply_job(&client, &ns, &m).await {
                Ok(_) => panic!("accepted: {patch}"),
                Err(e) => e.to_string(),
            }
        }
    };
    let e = reject(json!({"spec": {"training": {"parallelism": {"data": 3}}}})).await;
    assert!(e.contains("spec.training.parallelism") && e.contains("world size"), "{e}");
    let e = reject(json!({"spec": {"workers": 0, "training": {"parallelism": {"data": 0}}}})).await;
    assert!(e.contains("spec.workers"), "{e}");
    let e = reject(json!({"spec": {"training": {"batchSize": "eight"}}})).await;
    assert!(e.contains("spec.training.batchSize"), "{e}");
    let e = reject(json!({"spec": {"training": {"optimizer": {"lrr": 0.1}}}})).await;
    assert!(e.contains("lrr"), "{e}");
    let e = reject(json!({"spec": {"mpi": {"implementation": "LAM"}}})).await;
    assert!(e.contains("spec.mpi.implementation"), "{e}");
    let e = reject(json!({"spec": {"image": null}})).await;
    assert!(e.contains("spec.image"), "{e}");

    // While the job runs, its training configuration is fixed.
    let _operator = Operator::start(&ns);
    apply_job(&client, &ns, &job_manifest("fixed", 1)).await.unwrap();
    wait_job(&client, &ns, "fixed", "Created", |j| phase(j) == "Created").await;
    let mut changed = job_manifest("fixed", 1);
    changed["spec"]["training"]["steps"] = json!(40);
    let e = apply_job(&client, &ns, &changed).await.unwrap_err().to_string();
    assert!(e.contains("cannot change while the job runs"), "{e}");
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn one_leader_reconciles_and_a_standby_takes_over() {
    let client = client().await;
    let ns = namespace(&client, "leader").await;
    let first = Operator::start_with(&ns, &["--leader-elect", "--lease-duration", "4"]);
    wait_for(Duration::from_secs(20), "the first replica to lead", || async {
        let lease: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(client.clone(), &ns);
        lease.get_opt("tensorfleet-operator").await.ok()?.and_then(|l| l.spec?.holder_identity)
    })
    .await;
    let second = Operator::start_with(&ns, &["--leader-elect", "--lease-duration", "4"]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(second.http_get("/readyz").0, 200, "a standby is ready");
    let metrics = |op: &Operator| {
        let (_, body) = op.http_get("/metrics");
        body.lines()
            .find(|l| l.starts_with("tensorfleet_operator_reconciles_total"))
            .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    apply_job(&client, &ns, &job_manifest("led", 1)).await.unwrap();
    wait_job(&client, &ns, "led", "Created", |j| phase(j) == "Created").await;
    assert!(metrics(&first) > 0.0, "the leader reconciled");
    assert_eq!(metrics(&second), 0.0, "the standby must not reconcile");
    assert_eq!(first.http_get("/healthz").0, 200);

    // The leader dies without releasing; the standby takes over after the Lease expires.
    first.kill();
    set_pod_state(&client, &ns, "led-worker-0", PodState::Running).await;
    launcher(&client, &ns).await;
    // The counter moves when the pass that created the launcher returns.
    wait_for(Duration::from_secs(10), "the new leader's reconcile count", || async {
        (metrics(&second) > 0.0).then_some(())
    })
    .await;
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn deleting_a_job_cascades_to_every_child() {
    let client = client().await;
    let ns = namespace(&client, "cascade").await;
    let _operator = Operator::start(&ns);
    let mut manifest = job_manifest("gone", 2);
    manifest["spec"]["storage"] = json!({"reclaimPolicy": "Delete"});
    apply_job(&client, &ns, &manifest).await.unwrap();
    make_workers_ready(&client, &ns, 2).await;
    launcher(&client, &ns).await;
    let jobs: Api<tensorfleet_operator::crd::TrainingJob> = Api::namespaced(client.clone(), &ns);
    jobs.delete("gone", &DeleteParams::foreground()).await.unwrap();
    wait_for(Duration::from_secs(60), "everything gone", || async {
        let empty = names_of::<Pod>(&client, &ns).await.is_empty()
            && names_of::<Secret>(&client, &ns).await.is_empty()
            && names_of::<Service>(&client, &ns).await.is_empty()
            && names_of::<PersistentVolumeClaim>(&client, &ns).await.is_empty()
            && names_of::<ConfigMap>(&client, &ns).await == ["kube-root-ca.crt"]
            && jobs.list(&ListParams::default()).await.ok()?.items.is_empty();
        empty.then_some(())
    })
    .await;
    delete_namespace(&client, &ns).await;
}

#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn gang_scheduling_keeps_a_pod_group_sized_to_the_pods() {
    let client = client().await;
    let ns = namespace(&client, "gang").await;
    install_pod_group_crd(&client).await;
    let _operator = Operator::start(&ns);
    let mut manifest = job_manifest("grp", 2);
    // PriorityClasses are cluster-wide: one per test namespace keeps reruns independent.
    let priority = format!("high-{ns}");
    manifest["spec"]["scheduling"] = json!({"gang": "Volcano", "queue": "research", "priorityClassName": priority});
    apply_job(&client, &ns, &manifest).await.unwrap();
    // Without its PriorityClass the API server refuses the pods; the status says why.
    let job = wait_job(&client, &ns, "grp", "the refusal in status", |j| {
        j.status.as_ref().is_some_and(|s| s.conditions.iter().any(|c| c.reason == "PodCreationRefused"))
    })
    .await;
    let created = job.status.unwrap().conditions.into_iter().find(|c| c.type_ == "Created").unwrap();
    assert!(created.message.contains(&format!("no PriorityClass with name {priority}")), "{}", created.message);
    let class: k8s_openapi::api::scheduling::v1::PriorityClass =
        serde_json::from_value(json!({"metadata": {"name": priority}, "value": 1000})).unwrap();
    let classes: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(client.clone());
    classes.create(&Default::default(), &class).await.unwrap();
    let ar = tensorfleet_operator::resources::podgroup::api_resource(tensorfleet_operator::crd::GangScheduler::Volcano)
        .unwrap();
    let groups: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
    let group = wait_for(Duration::from_secs(30), "the PodGroup", || async { groups.get_opt("grp").await.ok()? }).await;
    assert_eq!(group.data["spec"]["minMember"], json!(2));
    assert_eq!(group.data["spec"]["queue"], json!("research"));
    let workers = wait_for(Duration::from_secs(40), "the worker pods", || async {
        let p = pods(&client, &ns, "worker").await;
        (p.len() == 2).then_some(p)
    })
    .await;
    let w = &workers[0];
    assert_eq!(w.annotations()["scheduling.k8s.io/group-name"], "grp");
    assert_eq!(w.spec.as_ref().unwrap().scheduler_name.as_deref(), Some("volcano"));
    make_workers_ready(&client, &ns, 2).await;
    launcher(&client, &ns).await;
    wait_for(Duration::from_secs(30), "minMember 3 with the launcher", || async {
        let g = groups.get("grp").await.ok()?;
        (g.data["spec"]["minMember"] == json!(3)).then_some(())
    })
    .await;
    let _ = classes.delete(&priority, &DeleteParams::default()).await;
    delete_namespace(&client, &ns).await;
}

/// Volcano's PodGroup CRD, reduced to what the operator writes (the API server only needs the
/// group, version and names to serve it).
async fn install_pod_group_crd(client: &kube::Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "podgroups.scheduling.volcano.sh"},
        "spec": {
            "group": "scheduling.volcano.sh",
            "scope": "Namespaced",
            "names": {"kind": "PodGroup", "plural": "podgroups", "singular": "podgroup"},
            "versions": [{"name": "v1beta1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]
        }
    }))
    .unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    api.patch(&crd.name_any(), &PatchParams::apply("tensorfleet-tests").force(), &Patch::Apply(&crd)).await.unwrap();
    wait_for(Duration::from_secs(30), "the PodGroup CRD", || async {
        let c = api.get(&crd.name_any()).await.ok()?;
        c.status?.conditions?.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
    })
    .await;
}

fn json_merge(target: &mut serde_json::Value, patch: &serde_json::Value) {
    match (target, patch) {
        (serde_json::Value::Object(t), serde_json::Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    json_merge(t.entry(k.clone()).or_insert(serde_json::Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// Every TrainingJob under examples/ is accepted as written and becomes exactly its children.
#[tokio::test]
#[ignore = "needs an API server: make test starts one"]
async fn examples_become_exactly_their_children() {
    let client = client().await;
    let ns = namespace(&client, "examples").await;
    install_pod_group_crd(&client).await;
    let _operator = Operator::start(&ns);
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut expected_pods = Vec::new();
    let mut expected_claims = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    files.sort();
    for path in files.iter().filter(|p| p.extension().is_some_and(|e| e == "yaml")) {
        let text = std::fs::read_to_string(path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
            if value["kind"] != "TrainingJob" {
                continue;
            }
            let job =
                apply_job(&client, &ns, &value).await.unwrap_or_else(|e| panic!("{}: rejected: {e}", path.display()));
            let name = job.name_any();
            expected_pods.extend((0..job.spec.workers).map(|i| format!("{name}-worker-{i}")));
            if job.spec.storage.existing_claim.is_none() {
                expected_claims.push(format!("{name}-ckpt"));
            }
        }
    }
    assert!(expected_pods.len() >= 4, "the examples hold TrainingJobs");
    expected_pods.sort();
    expected_claims.sort();
    wait_for(Duration::from_secs(60), "every example's workers", || async {
        (names_of::<Pod>(&client, &ns).await == expected_pods).then_some(())
    })
    .await;
    assert_eq!(names_of::<PersistentVolumeClaim>(&client, &ns).await, expected_claims);
    let jobs: Vec<String> = expected_claims.iter().map(|c| c.trim_end_matches("-ckpt").to_string()).collect();
    let mut services = jobs.clone();
    services.sort();
    assert_eq!(names_of::<Service>(&client, &ns).await, services);
    let secrets: Vec<String> = services.iter().map(|j| format!("{j}-ssh")).collect();
    assert_eq!(names_of::<Secret>(&client, &ns).await, secrets);
    // No launcher: no worker is ready.
    assert!(pods(&client, &ns, "launcher").await.is_empty());
    delete_namespace(&client, &ns).await;
}
