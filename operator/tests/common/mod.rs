//! The harness of the operator's integration tests: a real API server (started by `make test`
//! with `e2e/control-plane/up.sh`, reached through TENSORFLEET_TEST_KUBECONFIG), the real
//! operator binary watching one namespace per test, and the kubelet's part played by patching
//! pod status.

#![allow(dead_code)]

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{CustomResourceExt, ResourceExt};
use serde_json::json;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};
use tensorfleet_operator::crd::{JobPhase, TrainingJob};

pub const KUBECONFIG_VAR: &str = "TENSORFLEET_TEST_KUBECONFIG";

/// A client of the test API server (TENSORFLEET_TEST_KUBECONFIG), with the CRD installed. The
/// tests that call it are `#[ignore]`d in a plain `cargo test`; `make test` starts an API server
/// and runs them with `--ignored`. Run without the variable, it says what to do.
pub async fn client() -> kube::Client {
    let path = std::env::var(KUBECONFIG_VAR)
        .unwrap_or_else(|_| panic!("{KUBECONFIG_VAR} is not set: `make test` starts an API server and sets it"));
    let kubeconfig = Kubeconfig::read_from(&path).unwrap_or_else(|e| panic!("{KUBECONFIG_VAR}={path}: {e}"));
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    let client = kube::Client::try_from(config).expect("client from kubeconfig");
    install_crd(&client).await;
    client
}

/// Applies the CRD as generated from the Rust types, and waits until it is served.
pub async fn install_crd(client: &kube::Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = TrainingJob::crd();
    crds.patch(&crd.name_any(), &PatchParams::apply("tensorfleet-tests").force(), &Patch::Apply(&crd))
        .await
        .expect("the API server accepts the generated CRD");
    wait_for(Duration::from_secs(30), "the CRD to be established", || async {
        let crd = crds.get(&crd.name_any()).await.ok()?;
        let conditions = crd.status?.conditions?;
        conditions.iter().any(|c| c.type_ == "Established" && c.status == "True").then_some(())
    })
    .await;
}

/// A fresh namespace for one test.
pub async fn namespace(client: &kube::Client, test: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let name = format!("{test}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.expect("create namespace");
    // The controller-manager makes the default ServiceAccount; pods cannot be created before.
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(client.clone(), &name);
    wait_for(Duration::from_secs(30), "the default ServiceAccount", || async { sas.get_opt("default").await.ok()? })
        .await;
    name
}

/// The operator binary, running against the test API server and watching one namespace.
pub struct Operator {
    child: Child,
    pub http_port: u16,
}

impl Operator {
    pub fn start(namespace: &str) -> Operator {
        Self::start_with(namespace, &[])
    }

    pub fn start_with(namespace: &str, extra: &[&str]) -> Operator {
        let kubeconfig = std::env::var(KUBECONFIG_VAR).expect("client() checked it");
        let http_port = free_port();
        let log = std::fs::File::create(std::env::temp_dir().join(format!("operator-{namespace}-{http_port}.log")))
            .expect("operator log file");
        let child = Command::new(env!("CARGO_BIN_EXE_tensorfleet-operator"))
            .args(["--namespaces", namespace, "--http-addr", &format!("127.0.0.1:{http_port}")])
            .args(["--lease-namespace", namespace])
            .args(extra)
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,tensorfleet_operator=debug,kube=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start tensorfleet-operator");
        Operator { child, http_port }
    }

    /// SIGKILL: no graceful shutdown, as when a node dies under the operator.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits for the exit; returns whether it exited by itself in time.
    pub fn terminate(mut self) -> bool {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    pub fn http_get(&self, path: &str) -> (u16, String) {
        http_get("127.0.0.1", self.http_port, path)
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A blocking HTTP/1.1 GET; (status code, body).
pub fn http_get(host: &str, port: u16, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect((host, port)) else { return (0, String::new()) };
    let _ = write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (code, body)
}

/// Polls `check` until it returns Some, or panics naming what it waited for.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A small CPU job: `workers` pods × 1 slot, data parallel over all of them.
pub fn job_manifest(name: &str, workers: i32) -> serde_json::Value {
    json!({
        "apiVersion": "tensorfleet.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "image": "tensorfleet/worker:test",
            "workers": workers,
            "slotsPerWorker": 1,
            "training": {
                "model": {"gpt2": {"layers": 2, "heads": 2, "embed": 64, "seqLen": 64}},
                "data": {"train": {"path": "train", "format": "tokens"}},
                "batchSize": 4,
                "steps": 20,
                "parallelism": {"data": workers}
            }
        }
    })
}

pub async fn apply_job(
    client: &kube::Client,
    ns: &str,
    manifest: &serde_json::Value,
) -> Result<TrainingJob, kube::Error> {
    let api: Api<TrainingJob> = Api::namespaced(client.clone(), ns);
    let name = manifest["metadata"]["name"].as_str().unwrap().to_string();
    let pp = PatchParams::apply("tensorfleet-tests").force().validation_strict();
    api.patch(&name, &pp, &Patch::Apply(manifest)).await
}

pub async fn get_job(client: &kube::Client, ns: &str, name: &str) -> TrainingJob {
    Api::<TrainingJob>::namespaced(client.clone(), ns).get(name).await.expect("get job")
}

/// Waits until the job's status satisfies `pred`; returns the job.
pub async fn wait_job(
    client: &kube::Client,
    ns: &str,
    name: &str,
    what: &str,
    pred: impl Fn(&TrainingJob) -> bool,
) -> TrainingJob {
    let api: Api<TrainingJob> = Api::namespaced(client.clone(), ns);
    wait_for(Duration::from_secs(60), what, || async { api.get(name).await.ok().filter(|j| pred(j)) }).await
}

pub fn phase(job: &TrainingJob) -> &'static str {
    job.status.as_ref().and_then(|s| s.phase).map_or("", JobPhase::as_str)
}

pub async fn pods(client: &kube::Client, ns: &str, role: &str) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(&format!("tensorfleet.dev/role={role}"));
    let mut pods = api.list(&lp).await.expect("list pods").items;
    pods.sort_by_key(|p| p.name_any());
    pods
}

/// Plays the kubelet: sets a pod's phase, readiness, IP and (when it terminated) exit code.
pub async fn set_pod_state(client: &kube::Client, ns: &str, pod: &str, state: PodState<'_>) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let container = api.get(pod).await.expect("pod exists").spec.unwrap().containers[0].name.clone();
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let (phase, ready, container_state, reason) = match state {
        PodState::Running => ("Running", true, json!({"running": {"startedAt": now}}), None),
        PodState::RunningNotReady => ("Running", false, json!({"running": {"startedAt": now}}), None),
        PodState::Exited { code, reason, message } => {
            let phase = if code == 0 { "Succeeded" } else { "Failed" };
            let t = json!({"terminated": {"exitCode": code, "reason": reason, "message": message,
                "startedAt": now, "finishedAt": now}});
            (phase, false, t, None)
        }
        PodState::Evicted => (
            "Failed",
            false,
            json!({"terminated": {"exitCode": 137, "reason": "Error",
            "startedAt": now, "finishedAt": now}}),
            Some("Evicted"),
        ),
    };
    let ready_s = if ready { "True" } else { "False" };
    let mut status = json!({
        "phase": phase,
        "podIP": "127.0.0.1",
        "podIPs": [{"ip": "127.0.0.1"}],
        "conditions": [
            {"type": "Ready", "status": ready_s, "lastTransitionTime": now},
            {"type": "ContainersReady", "status": ready_s, "lastTransitionTime": now}
        ],
        "containerStatuses": [{"name": container, "image": "tensorfleet/worker:test", "imageID": "",
            "ready": ready, "restartCount": 0, "state": container_state}]
    });
    if let Some(r) = reason {
        status["reason"] = json!(r);
        status["message"] = json!("The node was low on resource: memory.");
    }
    api.patch_status(pod, &PatchParams::default(), &Patch::Merge(json!({"status": status})))
        .await
        .unwrap_or_else(|e| panic!("patch status of pod {pod}: {e}"));
}

pub enum PodState<'a> {
    Running,
    RunningNotReady,
    Exited { code: i32, reason: &'a str, message: &'a str },
    Evicted,
}

pub async fn delete_namespace(client: &kube::Client, ns: &str) {
    let _ = Api::<Namespace>::all(client.clone()).delete(ns, &DeleteParams::default()).await;
}
