//! Scenario 9, load: 50 jobs submitted at once on the local cluster (`make bench` brings it up),
//! next to Kubeflow's MPI Operator given 50 MPIJobs on the same cluster in the same run.
//!
//! Measured for both: the time from submission until every job's worker pods (2 per job, 100
//! in all) run and are Ready — the operator's reconciles, the scheduler and the kubelets' pod
//! starts together — and the operator's peak resident memory (VmHWM) at the end. tensorfleet's
//! workers run sshd with a readiness probe on its port; the MPIJobs' workers run `sleep`, which
//! is Ready as soon as it starts (the MPI Operator's example image is not available here), so
//! the comparison favours the peer by the probe's period. Then tensorfleet's jobs go on to train
//! (a tiny GPT-2, 2 steps, 2 ranks each) and the time until all 50 Succeeded is reported too;
//! the MPIJobs' launchers only sleep, so that figure has no peer and is not a comparison.
//!
//! Needs TENSORFLEET_E2E_CLUSTER (the cluster's directory) and TENSORFLEET_MPI_OPERATOR_DIR
//! (the output of e2e/mpi-operator/build.sh). Writes target/bench-e2e-load.json.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tensorfleet_e2e::{quickstart, repo, Cluster};

const JOBS: usize = 50;
const WORKERS: usize = 2;
const TIMEOUT: Duration = Duration::from_secs(1200);

/// Small enough for 100 ranks on two cores: what is measured is the system, not training.
fn tensorfleet_job(name: &str) -> Value {
    let mut job = quickstart(
        name,
        json!({
            "model": {"gpt2": {"layers": 1, "heads": 1, "embed": 16, "seqLen": 16, "vocab": 50257}},
            "batchSize": 2, "steps": 2, "lrSchedule": {"warmupSteps": 1},
            "evaluation": {"every": 0}, "checkpoint": {"every": 0}, "logging": {"every": 1, "tensorboard": false},
            "parallelism": {"data": 2},
        }),
    );
    job["spec"]["slotsPerWorker"] = json!(1);
    job["spec"]["resources"] = json!({"requests": {"cpu": "10m", "memory": "64Mi"}});
    job["spec"]["storage"]["size"] = json!("10Mi");
    job
}

fn mpi_job(name: &str) -> Value {
    let container = |role: &str| {
        // The namespace admits "restricted" pods only, as the TrainingJobs' pods are.
        let restricted = json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
                                "runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}});
        json!({"name": role, "image": "tensorfleet/worker:0.1.0", "command": ["sleep", "3600"],
               "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}}, "securityContext": restricted})
    };
    json!({
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": name},
        "spec": {
            "slotsPerWorker": 1,
            "runPolicy": {"cleanPodPolicy": "Running"},
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": {"containers": [container("mpi-launcher")]}}},
                "Worker": {"replicas": WORKERS, "template": {"spec": {"containers": [container("mpi-worker")]}}}
            }
        }
    })
}

#[tokio::main]
async fn main() {
    if std::env::var_os(tensorfleet_e2e::CLUSTER_VAR).is_none() {
        eprintln!(
            "bench load skipped: {} is not set (make bench brings up the local cluster)",
            tensorfleet_e2e::CLUSTER_VAR
        );
        return;
    }
    let mpi_dir = std::env::var_os("TENSORFLEET_MPI_OPERATOR_DIR").map(PathBuf::from).unwrap_or_else(|| {
        panic!("TENSORFLEET_MPI_OPERATOR_DIR is not set (DIR=$(e2e/mpi-operator/build.sh | tail -1))")
    });
    let cluster = Cluster::connect().await;

    // --- Kubeflow's MPI Operator, run as a process with the admin credentials ----------------
    let ns = cluster.namespace("load-mpi").await;
    install_crd(&cluster, &mpi_dir.join("kubeflow.org_mpijobs.yaml")).await;
    let log = cluster.dir.join("logs/mpi-operator.log");
    let mut mpi_operator = Command::new(mpi_dir.join("mpi-operator"))
        .args(["--namespace", &ns, "--lock-namespace", &ns, "--kube-api-qps", "1000", "--kube-api-burst", "2000"])
        .env("KUBECONFIG", cluster.dir.join("kubeconfig"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("the MPI Operator's log"))
        .spawn()
        .expect("starting the MPI Operator");
    tensorfleet_e2e::wait_for(Duration::from_secs(60), "the MPI Operator to start its workers", || async {
        std::fs::read_to_string(&log).ok().filter(|l| l.contains("Started workers")).map(|_| ())
    })
    .await;
    let mpi_jobs = Api::<DynamicObject>::namespaced_with(
        cluster.client.clone(),
        &ns,
        &ApiResource::from_gvk(&GroupVersionKind::gvk("kubeflow.org", "v2beta1", "MPIJob")),
    );
    let started = Instant::now();
    submit(&mpi_jobs, (0..JOBS).map(|i| mpi_job(&format!("pi-{i}"))).collect()).await;
    let mpi_ready = all_workers_ready(&cluster, &ns, "training.kubeflow.org/job-role=worker", started).await;
    let mpi_memory = peak_mib(mpi_operator.id());
    eprintln!(
        "bench load: MPI Operator: {JOBS} jobs' {} workers Ready in {mpi_ready:.1} s, peak {mpi_memory:.1} MiB",
        JOBS * WORKERS
    );
    let _ = mpi_operator.kill();
    let _ = mpi_operator.wait();
    cluster.delete_namespace(&ns).await;

    // --- tensorfleet, the operator installed by helm in the cluster ---------------------------
    let ns = cluster.namespace("load-tf").await;
    cluster.prepare_data(&ns).await;
    let jobs = Api::<DynamicObject>::namespaced_with(
        cluster.client.clone(),
        &ns,
        &ApiResource::from_gvk(&GroupVersionKind::gvk("tensorfleet.dev", "v1alpha1", "TrainingJob")),
    );
    let started = Instant::now();
    submit(&jobs, (0..JOBS).map(|i| tensorfleet_job(&format!("tiny-{i}"))).collect()).await;
    let tf_ready = all_workers_ready(&cluster, &ns, "tensorfleet.dev/role=worker", started).await;
    let tf_memory_at_ready = peak_mib(operator_pid(&cluster).await);
    let succeeded = loop {
        let list = jobs.list(&ListParams::default()).await.expect("listing the jobs");
        let phases: Vec<String> =
            list.items.iter().map(|j| j.data["status"]["phase"].as_str().unwrap_or("").to_string()).collect();
        assert!(!phases.iter().any(|p| p == "Failed"), "a job failed:\n{}", cluster.diagnostics(&ns).await);
        if phases.iter().filter(|p| *p == "Succeeded").count() == JOBS {
            break started.elapsed().as_secs_f64();
        }
        assert!(started.elapsed() < TIMEOUT, "not all jobs succeeded:\n{}", cluster.diagnostics(&ns).await);
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let tf_memory = peak_mib(operator_pid(&cluster).await);
    eprintln!(
        "bench load: tensorfleet: {} workers Ready in {tf_ready:.1} s (peak {tf_memory_at_ready:.1} MiB), all {JOBS} Succeeded in {succeeded:.1} s, peak {tf_memory:.1} MiB",
        JOBS * WORKERS
    );
    cluster.delete_namespace(&ns).await;

    println!("\nLoad on the local cluster: {JOBS} jobs × {WORKERS} workers submitted at once");
    println!("{:<44} {:>18} {:>16}", "", "workers Ready (s)", "peak RSS (MiB)");
    println!("{:<44} {:>18.1} {:>16.1}", "tensorfleet-operator (helm, in a pod)", tf_ready, tf_memory_at_ready);
    println!("{:<44} {:>18.1} {:>16.1}", "mpi-operator (qps 1000, burst 2000)", mpi_ready, mpi_memory);
    println!(
        "tensorfleet's {JOBS} jobs then all Succeeded {succeeded:.1} s after submission (peak {tf_memory:.1} MiB)"
    );
    let report = json!({
        "jobs": JOBS, "workersPerJob": WORKERS,
        "tensorfleet": {"workersReadySeconds": tf_ready, "peakMiBAtReady": tf_memory_at_ready,
                        "allSucceededSeconds": succeeded, "peakMiB": tf_memory},
        "mpiOperator": {"workersReadySeconds": mpi_ready, "peakMiB": mpi_memory, "qps": 1000, "burst": 2000},
        "machine": format!("{} cores", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)),
    });
    let path = repo().join("target/bench-e2e-load.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap() + "\n").expect("writing the report");
    eprintln!("bench load: wrote {}", path.display());
}

async fn install_crd(cluster: &Cluster, path: &Path) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let crd: CustomResourceDefinition = serde_yaml::from_str(&text).expect("the MPIJob CRD");
    let api = Api::<CustomResourceDefinition>::all(cluster.client.clone());
    api.patch(&crd.name_any(), &PatchParams::apply("tensorfleet-bench").force(), &Patch::Apply(&crd))
        .await
        .expect("installing the MPIJob CRD");
    tensorfleet_e2e::wait_for(Duration::from_secs(30), "the MPIJob CRD to be established", || async {
        let c = api.get(&crd.name_any()).await.ok()?;
        c.status?.conditions?.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
    })
    .await;
}

/// Creates all the jobs at once (concurrent requests).
async fn submit(api: &Api<DynamicObject>, manifests: Vec<Value>) {
    let pp = PatchParams::apply("tensorfleet-bench").force();
    let requests = manifests.iter().map(|m| {
        let name = m["metadata"]["name"].as_str().unwrap().to_string();
        let pp = pp.clone();
        async move { api.patch(&name, &pp, &Patch::Apply(m)).await }
    });
    for result in futures::future::join_all(requests).await {
        result.expect("submitting a job");
    }
}

/// Seconds from `started` until JOBS × WORKERS distinct pods with `selector` have each been
/// seen Running and Ready (from a watch: a finished job's workers are deleted, so they are never
/// all Ready at one moment).
async fn all_workers_ready(cluster: &Cluster, ns: &str, selector: &str, started: Instant) -> f64 {
    use futures::StreamExt;
    use kube::runtime::{watcher, WatchStreamExt};
    let pods = Api::<Pod>::namespaced(cluster.client.clone(), ns);
    let mut events =
        watcher(pods, watcher::Config::default().labels(selector)).default_backoff().applied_objects().boxed();
    let mut ready = std::collections::HashSet::new();
    while ready.len() < JOBS * WORKERS {
        let next = tokio::time::timeout(TIMEOUT.saturating_sub(started.elapsed()), events.next()).await;
        let Ok(Some(event)) = next else {
            panic!("{} of {} workers were Ready:\n{}", ready.len(), JOBS * WORKERS, cluster.diagnostics(ns).await);
        };
        let Ok(pod) = event else { continue };
        let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
        if conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")) {
            ready.insert(pod.name_any());
        }
    }
    started.elapsed().as_secs_f64()
}

/// The host pid of the operator pod's process (its node's runtime knows it).
async fn operator_pid(cluster: &Cluster) -> u32 {
    let pods = Api::<Pod>::namespaced(cluster.client.clone(), "tensorfleet-system");
    let list =
        pods.list(&ListParams::default().labels("app.kubernetes.io/name=tensorfleet")).await.expect("the operator pod");
    let pod = list.items.first().expect("an operator pod");
    cluster.container("tensorfleet-system", &pod.name_any()).await.pid
}

/// Peak resident memory (VmHWM) of a process, in MiB.
fn peak_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_else(|e| panic!("pid {pid}: {e}"));
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM for pid {pid}"));
    kib / 1024.0
}
