//! Reconcile throughput of the operator next to Kubeflow's MPI Operator, in the same run on the
//! same API server: 100 jobs × 8 workers submitted at once, the time until every job's children
//! exist, the API requests each operator sent, and its peak memory.
//!
//! Needs a real API server (TENSORFLEET_TEST_KUBECONFIG, as for the operator's tests; skipped
//! when unset). The operator binary comes from TENSORFLEET_OPERATOR_BIN (default: the one Cargo
//! built for this bench); the peer from TENSORFLEET_MPI_OPERATOR_DIR, the output of
//! `e2e/mpi-operator/build.sh` (skipped when unset). Writes target/bench-operator.json.
//!
//! What is counted, for both: per job 8 worker pods `<job>-worker-<i>`, ConfigMap `<job>-config`,
//! Secret `<job>-ssh`, Service `<job>`. Each also makes one more child at once, timed apart:
//! tensorfleet the claim `<job>-ckpt`, the MPI Operator (launcherCreationPolicy AtStartup, its
//! default) the launcher batch Job `<job>-launcher`. There is no kubelet, so no pod becomes ready
//! and tensorfleet's launcher (made once the workers are ready) never appears.
//!
//! API requests: each operator runs as its own ServiceAccount, and a FlowSchema matching only that
//! account puts its requests in their own API Priority and Fairness flow, whose
//! `apiserver_flowcontrol_dispatched_requests_total` counts every request it sent (a watch counts
//! once, when it opens). Its Lease requests (leader election, which the MPI Operator always runs)
//! go to a second FlowSchema and are reported apart. The same method for both; tensorfleet's own
//! `tensorfleet_operator_api_requests_total` is reported next to it as a cross-check.

#[path = "../tests/common/mod.rs"]
mod common;

use futures::{stream, StreamExt, TryStreamExt};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, PersistentVolumeClaim, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::flowcontrol::v1::FlowSchema;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;
use kube::{CustomResourceExt, Resource, ResourceExt};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tensorfleet_operator::crd::TrainingJob;

const JOBS: usize = 100;
const WORKERS: usize = 8;
/// Longest wait for all children (the MPI Operator as shipped is held to 5 requests/s).
const CHILDREN_TIMEOUT: Duration = Duration::from_secs(900);
/// After the children exist, an operator is settled when its request count holds this long.
const SETTLE_QUIET: Duration = Duration::from_secs(5);
const SETTLE_MAX: Duration = Duration::from_secs(120);
/// The MPI Operator's health endpoint; the port is fixed in its source (cmd/mpi-operator/app).
const MPI_HEALTH_PORT: u16 = 8080;

type Result<T> = std::result::Result<T, String>;

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("bench reconcile: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<()> {
    let Ok(kubeconfig) = std::env::var("TENSORFLEET_TEST_KUBECONFIG") else {
        eprintln!(
            "bench reconcile skipped: TENSORFLEET_TEST_KUBECONFIG is not set \
             (start an API server with e2e/control-plane/up.sh DIR and point it at DIR/kubeconfig)"
        );
        return Ok(());
    };
    let cluster = Cluster::connect(&kubeconfig).await?;
    let operator_bin = std::env::var("TENSORFLEET_OPERATOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_BIN_EXE_tensorfleet-operator")));
    let mpi_dir = std::env::var("TENSORFLEET_MPI_OPERATOR_DIR").ok().map(PathBuf::from);

    let mut contenders = vec![Contender::Tensorfleet { bin: operator_bin }];
    match &mpi_dir {
        Some(dir) => {
            let bin = dir.join("mpi-operator");
            // As its manifests deploy it (client-go held to 5 requests/s, burst 10), and with
            // that client-side limit lifted, to see what is left once it is out of the way.
            contenders.push(Contender::MpiOperator { bin: bin.clone(), qps: None });
            contenders.push(Contender::MpiOperator { bin, qps: Some(1000) });
        }
        None => eprintln!(
            "bench reconcile: the MPI Operator is skipped: TENSORFLEET_MPI_OPERATOR_DIR is not set \
             (DIR=$(e2e/mpi-operator/build.sh | tail -1))"
        ),
    }

    install_crd(&cluster.client, TrainingJob::crd()).await?;
    if let Some(dir) = &mpi_dir {
        let path = dir.join("kubeflow.org_mpijobs.yaml");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let crd: CustomResourceDefinition =
            serde_yaml::from_str(&text).map_err(|e| format!("{}: not a CRD: {e}", path.display()))?;
        install_crd(&cluster.client, crd).await?;
    }

    let mut results = BTreeMap::new();
    for contender in &contenders {
        eprintln!("bench reconcile: {} ({JOBS} jobs × {WORKERS} workers)", contender.label());
        let result = measure(&cluster, contender).await?;
        eprintln!("bench reconcile: {} {result:?}", contender.label());
        results.insert(contender.key(), result);
    }

    print_table(&contenders, &results);
    let json = report(&contenders, &results);
    let target = target_dir();
    let path = target.canonicalize().unwrap_or(target).join("bench-operator.json");
    let text = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
    std::fs::write(&path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    eprintln!("bench reconcile: wrote {}", path.display());
    Ok(())
}

// ---- the two operators -----------------------------------------------------------------------

enum Contender {
    Tensorfleet {
        bin: PathBuf,
    },
    /// `qps`: client-go's --kube-api-qps (and a burst of twice that); None keeps its defaults.
    MpiOperator {
        bin: PathBuf,
        qps: Option<u32>,
    },
}

impl Contender {
    fn key(&self) -> &'static str {
        match self {
            Contender::Tensorfleet { .. } => "tensorfleet",
            Contender::MpiOperator { qps: None, .. } => "mpiOperator",
            Contender::MpiOperator { qps: Some(_), .. } => "mpiOperatorUnthrottled",
        }
    }

    fn label(&self) -> String {
        match self {
            Contender::Tensorfleet { .. } => "tensorfleet-operator".into(),
            Contender::MpiOperator { qps: None, .. } => "mpi-operator (defaults: qps 5, burst 10)".into(),
            Contender::MpiOperator { qps: Some(q), .. } => format!("mpi-operator (qps {q}, burst {})", 2 * q),
        }
    }

    /// The one child each makes besides the common ones, by its name for job `job`.
    fn extra_child(&self, job: &str) -> (Kind, String) {
        match self {
            Contender::Tensorfleet { .. } => (Kind::Claim, format!("{job}-ckpt")),
            Contender::MpiOperator { .. } => (Kind::BatchJob, format!("{job}-launcher")),
        }
    }

    fn counted(&self) -> String {
        let common = format!("{WORKERS} worker pods, ConfigMap <job>-config, Secret <job>-ssh, Service <job>");
        match self {
            Contender::Tensorfleet { .. } => format!("{common}; all: + PVC <job>-ckpt"),
            Contender::MpiOperator { .. } => format!("{common}; all: + launcher batch Job <job>-launcher"),
        }
    }

    /// Starts the operator watching `ns` with the credentials in `kubeconfig`; its log goes to `log`.
    fn start(&self, ns: &str, kubeconfig: &Path, log: &Path) -> Result<Running> {
        let log_file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd;
        let mut http_port = None;
        match self {
            Contender::Tensorfleet { bin } => {
                let port = free_port()?;
                http_port = Some(port);
                cmd = Command::new(bin);
                cmd.args(["--namespaces", ns, "--http-addr", &format!("127.0.0.1:{port}")])
                    .env("RUST_LOG", "info,kube=warn");
            }
            Contender::MpiOperator { bin, qps } => {
                // It always runs leader election (--lock-namespace keeps the Lease in the bench's
                // namespace) and serves /healthz on a fixed port.
                if std::net::TcpListener::bind(("0.0.0.0", MPI_HEALTH_PORT)).is_err() {
                    return Err(format!(
                        "port {MPI_HEALTH_PORT} is taken; the MPI Operator serves /healthz there and cannot be told otherwise"
                    ));
                }
                cmd = Command::new(bin);
                cmd.args(["--namespace", ns, "--lock-namespace", ns]);
                if let Some(q) = qps {
                    cmd.args(["--kube-api-qps", &q.to_string(), "--kube-api-burst", &(2 * q).to_string()]);
                }
            }
        }
        let child = cmd
            .env("KUBECONFIG", kubeconfig)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", self.label()))?;
        Ok(Running { child, http_port, log: log.to_path_buf() })
    }

    /// A job manifest with WORKERS workers of one slot each.
    fn job_manifest(&self, name: &str) -> Value {
        match self {
            // The same small job the operator's tests apply.
            Contender::Tensorfleet { .. } => common::job_manifest(name, WORKERS as i32),
            // The MPI Operator's own example (examples/v2beta1/pi), with WORKERS workers.
            Contender::MpiOperator { .. } => json!({
                "apiVersion": "kubeflow.org/v2beta1",
                "kind": "MPIJob",
                "metadata": {"name": name},
                "spec": {
                    "slotsPerWorker": 1,
                    "runPolicy": {"cleanPodPolicy": "Running"},
                    "sshAuthMountPath": "/home/mpiuser/.ssh",
                    "mpiReplicaSpecs": {
                        "Launcher": {"replicas": 1, "template": {"spec": {"containers": [{
                            "name": "mpi-launcher", "image": "mpioperator/mpi-pi:openmpi",
                            "command": ["mpirun", "-n", WORKERS.to_string(), "/home/mpiuser/pi"]
                        }]}}},
                        "Worker": {"replicas": WORKERS, "template": {"spec": {"containers": [{
                            "name": "mpi-worker", "image": "mpioperator/mpi-pi:openmpi",
                            "command": ["/usr/sbin/sshd", "-De"]
                        }]}}}
                    }
                }
            }),
        }
    }

    fn job_api(&self, client: &kube::Client, ns: &str) -> Api<DynamicObject> {
        let gvk = match self {
            Contender::Tensorfleet { .. } => GroupVersionKind::gvk("tensorfleet.dev", "v1alpha1", "TrainingJob"),
            Contender::MpiOperator { .. } => GroupVersionKind::gvk("kubeflow.org", "v2beta1", "MPIJob"),
        };
        Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk))
    }
}

/// An operator process; killed when dropped.
struct Running {
    child: Child,
    http_port: Option<u16>,
    log: PathBuf,
}

impl Running {
    /// Waits until the operator reconciles: tensorfleet's /readyz, the MPI Operator's log line
    /// after its informers synced.
    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("the operator exited ({status}) during startup; its log: {}", self.log.display()));
            }
            let ready = match self.http_port {
                Some(port) => http_get(port, "/readyz").map(|(code, _)| code == 200).unwrap_or(false),
                None => std::fs::read_to_string(&self.log).is_ok_and(|l| l.contains("Started workers")),
            };
            if ready {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the operator was not ready after 60 s; its log: {}", self.log.display()));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What tensorfleet counts itself (the MPI Operator exports no request counter).
    fn own_metrics(&self) -> Option<OwnMetrics> {
        let (_, body) = http_get(self.http_port?, "/metrics")?;
        let mut own = OwnMetrics::default();
        for line in body.lines() {
            let Some((series, value)) = line.rsplit_once(' ') else { continue };
            let Ok(value) = value.parse::<f64>() else { continue };
            if let Some(labels) = series.strip_prefix("tensorfleet_operator_api_requests_total{") {
                let method = labels.trim_start_matches("method=\"").trim_end_matches("\"}");
                own.requests_by_method.insert(method.to_string(), value as u64);
            } else if series == "tensorfleet_operator_reconciles_total" {
                own.reconciles = value as u64;
            }
        }
        Some(own)
    }

    /// Peak resident memory (VmHWM) in MiB and CPU time (user + system) in seconds.
    fn memory_and_cpu(&self) -> Result<(f64, f64)> {
        let pid = self.child.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| format!("pid {pid}: {e}"))?;
        let hwm_kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| format!("no VmHWM in /proc/{pid}/status"))?;
        // Fields after the command name (which may hold spaces): utime and stime are 14 and 15.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| format!("pid {pid}: {e}"))?;
        let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
        let ticks = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        let clock_ticks = 100.0; // USER_HZ on Linux
        Ok((hwm_kib / 1024.0, (ticks(14) + ticks(15)) / clock_ticks))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---- one measurement ---------------------------------------------------------------------------

#[derive(Debug, Default)]
struct OwnMetrics {
    requests_by_method: BTreeMap<String, u64>,
    reconciles: u64,
}

#[derive(Debug)]
struct Measured {
    submit_s: f64,
    children_s: f64,
    all_children_s: f64,
    /// The operator's requests (leader election apart) when the children existed, and settled.
    requests_at_children: u64,
    requests_settled: u64,
    settled_after_s: f64,
    lease_requests: u64,
    own: Option<OwnMetrics>,
    peak_rss_mib: f64,
    cpu_s: f64,
    counted: String,
}

async fn measure(cluster: &Cluster, contender: &Contender) -> Result<Measured> {
    let ns = format!("bench-{}-{}", contender.key().to_lowercase(), std::process::id());
    let work = std::env::temp_dir().join(&ns);
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    create_namespace(&cluster.client, &ns).await?;
    let result = measure_in(cluster, contender, &ns, &work).await;
    delete_identity(&cluster.client, &ns).await;
    delete_namespace(&cluster.client, &ns).await;
    // The operator's log stays for a failed run (the error names it).
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&work);
    }
    result
}

async fn measure_in(cluster: &Cluster, contender: &Contender, ns: &str, work: &Path) -> Result<Measured> {
    let flow = FlowCounter::new(cluster, ns, work).await?;
    let mut operator = contender.start(ns, &flow.kubeconfig, &work.join("operator.log"))?;
    operator.wait_ready().await?;

    let names: Vec<String> = (0..JOBS).map(|i| format!("bench-{i:03}")).collect();
    let mut common = HashSet::new();
    let mut extra = HashSet::new();
    for job in &names {
        common.extend((0..WORKERS).map(|i| (Kind::Pod, format!("{job}-worker-{i}"))));
        common.insert((Kind::ConfigMap, format!("{job}-config")));
        common.insert((Kind::Secret, format!("{job}-ssh")));
        common.insert((Kind::Service, job.clone()));
        extra.insert(contender.extra_child(job));
    }
    let mut seen = watch_children(&cluster.client, ns).await?;

    // All jobs at once, each create from its own task.
    let api = contender.job_api(&cluster.client, ns);
    let start = Instant::now();
    let submits: Vec<_> = names
        .iter()
        .map(|name| {
            let api = api.clone();
            let obj: DynamicObject = serde_json::from_value(contender.job_manifest(name)).expect("a valid object");
            tokio::spawn(async move { api.create(&PostParams::default(), &obj).await.map(|_| ()) })
        })
        .collect();
    for (submit, name) in submits.into_iter().zip(&names) {
        submit.await.map_err(|e| e.to_string())?.map_err(|e| format!("creating job {name} in {ns}: {e}"))?;
    }
    let submit_s = start.elapsed().as_secs_f64();

    let (mut children_s, mut all_children_s) = (None, None);
    let mut missing_common = common.clone();
    let mut missing_extra = extra.clone();
    let deadline = start + CHILDREN_TIMEOUT;
    while children_s.is_none() || all_children_s.is_none() {
        let next = tokio::time::timeout_at(deadline.into(), seen.next()).await.map_err(|_| {
            format!(
                "{} children still missing after {CHILDREN_TIMEOUT:?} (e.g. {:?}); operator log: {}",
                missing_common.len() + missing_extra.len(),
                missing_common.iter().chain(&missing_extra).next(),
                operator.log.display()
            )
        })?;
        let child = next.ok_or("the watches of the children ended")??;
        missing_common.remove(&child);
        missing_extra.remove(&child);
        if missing_common.is_empty() && children_s.is_none() {
            children_s = Some(start.elapsed().as_secs_f64());
        }
        if missing_common.is_empty() && missing_extra.is_empty() {
            all_children_s = Some(start.elapsed().as_secs_f64());
        }
    }
    let requests_at_children = flow.count(cluster).await?.work;

    // Settled: the operator's request count (leader election apart) holds still for
    // SETTLE_QUIET: the status updates that follow the children are done.
    let settle_start = Instant::now();
    let (mut last, mut last_change) = (requests_at_children, Instant::now());
    while last_change.elapsed() < SETTLE_QUIET && settle_start.elapsed() < SETTLE_MAX {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = flow.count(cluster).await?.work;
        if now != last {
            (last, last_change) = (now, Instant::now());
        }
    }
    let own = operator.own_metrics();
    let settled = flow.count(cluster).await?;
    let (peak_rss_mib, cpu_s) = operator.memory_and_cpu()?;
    Ok(Measured {
        submit_s,
        children_s: children_s.unwrap_or_default(),
        all_children_s: all_children_s.unwrap_or_default(),
        requests_at_children,
        requests_settled: settled.work,
        settled_after_s: (last_change - start).as_secs_f64(),
        lease_requests: settled.leases,
        own,
        peak_rss_mib,
        cpu_s,
        counted: contender.counted(),
    })
}

// ---- watching the children -------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Pod,
    ConfigMap,
    Secret,
    Service,
    Claim,
    BatchJob,
}

/// One stream of (kind, name) for every child object seen in `ns`, from metadata-only watches
/// that are open and listed before this returns (so no creation is missed).
async fn watch_children(
    client: &kube::Client,
    ns: &str,
) -> Result<impl futures::Stream<Item = Result<(Kind, String)>> + Unpin> {
    fn names<K>(client: &kube::Client, ns: &str, kind: Kind) -> stream::BoxStream<'static, Result<(Kind, String)>>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
        K: Send + Sync + 'static,
        K::DynamicType: Default,
    {
        let api: Api<PartialObjectMeta<K>> = Api::namespaced(client.clone(), ns);
        watcher(api, watcher::Config::default())
            .map_err(move |e| format!("watching {kind:?}s: {e}"))
            .try_filter_map(move |event| async move {
                Ok(match event {
                    watcher::Event::Apply(o) | watcher::Event::InitApply(o) => Some((kind, o.name_any())),
                    watcher::Event::InitDone => Some((kind, String::new())),
                    _ => None,
                })
            })
            .boxed()
    }
    let streams = vec![
        names::<Pod>(client, ns, Kind::Pod),
        names::<ConfigMap>(client, ns, Kind::ConfigMap),
        names::<Secret>(client, ns, Kind::Secret),
        names::<Service>(client, ns, Kind::Service),
        names::<PersistentVolumeClaim>(client, ns, Kind::Claim),
        names::<Job>(client, ns, Kind::BatchJob),
    ];
    let count = streams.len();
    let mut all = stream::select_all(streams);
    // An empty name marks a watch's initial list as done.
    let mut listed = 0;
    while listed < count {
        let (_, name) = all.next().await.ok_or("the watches of the children ended")??;
        if name.is_empty() {
            listed += 1;
        }
    }
    Ok(all)
}

// ---- counting an operator's requests -----------------------------------------------------------

/// The operator's own ServiceAccount (cluster-admin), a kubeconfig for it, and two FlowSchemas
/// that match only it, so the API server counts its requests apart from everyone else's: one for
/// its Leases (leader election, a fixed cost whatever the jobs), one for everything else.
struct FlowCounter {
    kubeconfig: PathBuf,
    requests_flow: String,
    leases_flow: String,
    baseline: Requests,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Requests {
    /// Everything but leader election.
    work: u64,
    leases: u64,
}

impl FlowCounter {
    async fn new(cluster: &Cluster, ns: &str, work: &Path) -> Result<FlowCounter> {
        let client = &cluster.client;
        let sa: ServiceAccount = from_json(json!({"metadata": {"name": "operator", "namespace": ns}}))?;
        Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &sa)
            .await
            .map_err(|e| format!("creating ServiceAccount {ns}/operator: {e}"))?;
        let binding: ClusterRoleBinding = from_json(json!({
            "metadata": {"name": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": ns}]
        }))?;
        Api::<ClusterRoleBinding>::all(client.clone())
            .create(&PostParams::default(), &binding)
            .await
            .map_err(|e| format!("creating ClusterRoleBinding {ns}: {e}"))?;
        let counter = FlowCounter {
            kubeconfig: work.join("kubeconfig"),
            requests_flow: ns.to_string(),
            leases_flow: format!("{ns}-leases"),
            baseline: Requests::default(),
        };
        // Precedences 2 and 3 come right after `exempt` (1); the exempt priority level keeps the
        // operator's requests from being queued, as the admin's are not.
        let subjects = json!([{"kind": "ServiceAccount", "serviceAccount": {"namespace": ns, "name": "operator"}}]);
        let leases = json!({
            "subjects": subjects,
            "resourceRules": [{"verbs": ["*"], "apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                "namespaces": ["*"]}]
        });
        let everything = json!({
            "subjects": subjects,
            "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "clusterScope": true,
                "namespaces": ["*"]}],
            "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]
        });
        for (name, precedence, rule) in [(&counter.leases_flow, 2, leases), (&counter.requests_flow, 3, everything)] {
            let flow_schema: FlowSchema = from_json(json!({
                "metadata": {"name": name},
                "spec": {"matchingPrecedence": precedence, "priorityLevelConfiguration": {"name": "exempt"},
                    "rules": [rule]}
            }))?;
            Api::<FlowSchema>::all(client.clone())
                .create(&PostParams::default(), &flow_schema)
                .await
                .map_err(|e| format!("creating FlowSchema {name}: {e}"))?;
        }

        let request = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 7200}});
        let token: Value = Api::<ServiceAccount>::namespaced(client.clone(), ns)
            .create_subresource("token", "operator", &PostParams::default(), &request)
            .await
            .map_err(|e| format!("requesting a token for {ns}/operator: {e}"))?;
        let token = token["status"]["token"].as_str().ok_or("TokenRequest without status.token")?;
        std::fs::write(&counter.kubeconfig, cluster.kubeconfig_for_token(token))
            .map_err(|e| format!("{}: {e}", counter.kubeconfig.display()))?;

        // The API server picks FlowSchemas up asynchronously: probe both flows as the account
        // until each has counted a request, and count from there.
        let as_operator = Cluster::connect(&counter.kubeconfig.to_string_lossy()).await?.client;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let _ = Api::<Namespace>::all(as_operator.clone()).get_opt(ns).await;
            let _ = Api::<Lease>::namespaced(as_operator.clone(), ns).get_opt("bench-probe").await;
            let n = counter.count(cluster).await?;
            if n.work > 0 && n.leases > 0 {
                return Ok(FlowCounter { baseline: n, ..counter });
            }
            if Instant::now() > deadline {
                return Err(format!("the API server did not count requests in FlowSchemas {ns}* within 30 s"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Requests the operator sent since it was set up.
    async fn count(&self, cluster: &Cluster) -> Result<Requests> {
        let metrics = cluster.apiserver_metrics().await?;
        let dispatched = |flow: &str| {
            let label = format!("flow_schema=\"{flow}\"");
            let n: f64 = metrics
                .lines()
                .filter(|l| l.starts_with("apiserver_flowcontrol_dispatched_requests_total{") && l.contains(&label))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            n as u64
        };
        Ok(Requests {
            work: dispatched(&self.requests_flow).saturating_sub(self.baseline.work),
            leases: dispatched(&self.leases_flow).saturating_sub(self.baseline.leases),
        })
    }
}

async fn delete_identity(client: &kube::Client, ns: &str) {
    let dp = DeleteParams::default();
    let _ = Api::<FlowSchema>::all(client.clone()).delete(ns, &dp).await;
    let _ = Api::<FlowSchema>::all(client.clone()).delete(&format!("{ns}-leases"), &dp).await;
    let _ = Api::<ClusterRoleBinding>::all(client.clone()).delete(ns, &dp).await;
}

// ---- the cluster -----------------------------------------------------------------------------

struct Cluster {
    client: kube::Client,
    kubeconfig: Kubeconfig,
}

impl Cluster {
    async fn connect(path: &str) -> Result<Cluster> {
        let kubeconfig = Kubeconfig::read_from(path).map_err(|e| format!("{path}: {e}"))?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig.clone(), &KubeConfigOptions::default())
            .await
            .map_err(|e| format!("{path}: {e}"))?;
        let client = kube::Client::try_from(config).map_err(|e| format!("{path}: {e}"))?;
        Ok(Cluster { client, kubeconfig })
    }

    /// A kubeconfig with this cluster's server and CA, and `token` as the user.
    fn kubeconfig_for_token(&self, token: &str) -> String {
        let cluster = self.kubeconfig.clusters.first().and_then(|c| c.cluster.as_ref());
        let server = cluster.and_then(|c| c.server.clone()).unwrap_or_default();
        let ca = cluster.and_then(|c| c.certificate_authority_data.clone()).unwrap_or_default();
        format!(
            "apiVersion: v1\nkind: Config\n\
             clusters:\n- name: bench\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\n\
             users:\n- name: operator\n  user:\n    token: {token}\n\
             contexts:\n- name: bench\n  context:\n    cluster: bench\n    user: operator\n\
             current-context: bench\n"
        )
    }

    async fn apiserver_metrics(&self) -> Result<String> {
        let request = http::Request::get("/metrics").body(Vec::new()).map_err(|e| e.to_string())?;
        self.client.request_text(request).await.map_err(|e| format!("GET /metrics of the API server: {e}"))
    }
}

async fn install_crd(client: &kube::Client, crd: CustomResourceDefinition) -> Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd.name_any();
    api.patch(&name, &PatchParams::apply("tensorfleet-bench").force(), &Patch::Apply(&crd))
        .await
        .map_err(|e| format!("applying CRD {name}: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let crd = api.get(&name).await.map_err(|e| format!("reading CRD {name}: {e}"))?;
        let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
        if conditions.iter().any(|c| c.type_ == "Established" && c.status == "True") {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("CRD {name} not established after 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn create_namespace(client: &kube::Client, ns: &str) -> Result<()> {
    let namespace: Namespace = from_json(json!({"metadata": {"name": ns}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .map_err(|e| format!("creating namespace {ns}: {e}"))?;
    // Pods cannot be created before the controller-manager made the default ServiceAccount.
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let deadline = Instant::now() + Duration::from_secs(30);
    while accounts.get_opt("default").await.ok().flatten().is_none() {
        if Instant::now() > deadline {
            return Err(format!("no ServiceAccount {ns}/default after 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Deletes the namespace and waits (up to 3 min) until it is gone, so the next measurement does
/// not share the API server with the garbage collection of this one.
async fn delete_namespace(client: &kube::Client, ns: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    let _ = api.delete(ns, &DeleteParams::default()).await;
    let deadline = Instant::now() + Duration::from_secs(180);
    while api.get_opt(ns).await.ok().flatten().is_some() {
        if Instant::now() > deadline {
            eprintln!("bench reconcile: namespace {ns} still terminating after 3 min; going on");
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

// ---- output ----------------------------------------------------------------------------------

fn print_table(contenders: &[Contender], results: &BTreeMap<&str, Measured>) {
    println!();
    println!("Reconcile throughput: {JOBS} jobs × {WORKERS} workers submitted at once ({})", machine_line());
    println!(
        "{:<42} {:>9} {:>11} {:>11} {:>10} {:>13} {:>10} {:>8}",
        "operator", "submit s", "children s", "all+1 s", "jobs/s", "API req/job", "peak MiB", "CPU s"
    );
    for c in contenders {
        let Some(m) = results.get(c.key()) else { continue };
        println!(
            "{:<42} {:>9.2} {:>11.2} {:>11.2} {:>10.1} {:>6.1} ({:>4.1}) {:>10.1} {:>8.1}",
            c.label(),
            m.submit_s,
            m.children_s,
            m.all_children_s,
            JOBS as f64 / m.children_s,
            m.requests_at_children as f64 / JOBS as f64,
            m.requests_settled as f64 / JOBS as f64,
            m.peak_rss_mib,
            m.cpu_s
        );
    }
    println!("children: {WORKERS} worker pods + <job>-config + <job>-ssh + Service <job> of every job, from the first submit");
    println!("all+1: also tensorfleet's PVC <job>-ckpt / the MPI Operator's launcher Job <job>-launcher");
    println!("API req/job: the operator's requests until the children existed (and once it settled), per job,");
    println!("  counted by the API server in a FlowSchema matching only the operator's ServiceAccount;");
    println!("  leader election apart:");
    for c in contenders {
        let Some(m) = results.get(c.key()) else { continue };
        println!("  {}: {} Lease requests in {:.0} s", c.label(), m.lease_requests, m.settled_after_s);
        if let Some(own) = &m.own {
            let total: u64 = own.requests_by_method.values().sum();
            println!(
                "  {}: its own counter says {total} requests {:?} in {} reconciles",
                c.label(),
                own.requests_by_method,
                own.reconciles
            );
        }
    }
}

fn report(contenders: &[Contender], results: &BTreeMap<&str, Measured>) -> Value {
    let mut json = json!({
        "jobs": JOBS,
        "workersPerJob": WORKERS,
        "machine": machine(),
        "method": {
            "time": "seconds from the first create to the moment the bench's watches had seen every counted child",
            "apiRequests": "apiserver_flowcontrol_dispatched_requests_total of a FlowSchema matching only the \
                operator's ServiceAccount (a watch counts once), from the operator's start; its Lease requests \
                (leader election) in a FlowSchema of their own, reported apart",
            "settled": "once the operator's request count held still for 5 s after the children existed \
                (at most 120 s after)",
            "memory": "VmHWM of the operator process, read before it is stopped",
        },
    });
    for c in contenders {
        let Some(m) = results.get(c.key()) else { continue };
        json[c.key()] = json!({
            "operator": c.label(),
            "counted": m.counted,
            "submitSeconds": round(m.submit_s),
            "childrenSeconds": round(m.children_s),
            "allChildrenSeconds": round(m.all_children_s),
            "jobsPerSecond": round(JOBS as f64 / m.children_s),
            "apiRequestsAtChildren": m.requests_at_children,
            "apiRequestsPerJobAtChildren": round(m.requests_at_children as f64 / JOBS as f64),
            "apiRequestsSettled": m.requests_settled,
            "apiRequestsPerJobSettled": round(m.requests_settled as f64 / JOBS as f64),
            "settledAfterSeconds": round(m.settled_after_s),
            "leaseRequests": m.lease_requests,
            "ownRequestsByMethod": m.own.as_ref().map(|o| &o.requests_by_method),
            "ownReconciles": m.own.as_ref().map(|o| o.reconciles),
            "peakRssMiB": round(m.peak_rss_mib),
            "cpuSeconds": round(m.cpu_s),
        });
    }
    json
}

fn machine() -> Value {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu =
        cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|v| v.trim_start_matches([' ', '\t', ':']));
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "memoryGiB": round(mem_kib / 1024.0 / 1024.0),
        "cpu": cpu,
    })
}

fn machine_line() -> String {
    let m = machine();
    format!("{} CPUs, {} GiB, {}", m["nproc"], m["memoryGiB"], m["cpu"].as_str().unwrap_or("unknown CPU"))
}

fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

// ---- small helpers ---------------------------------------------------------------------------

/// target/ of the workspace (or CARGO_TARGET_DIR); benches run with the package as working dir.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("target"))
}

fn from_json<T: serde::de::DeserializeOwned>(v: Value) -> Result<T> {
    serde_json::from_value(v).map_err(|e| format!("building an object: {e}"))
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("finding a free port: {e}"))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

/// A blocking HTTP/1.1 GET on 127.0.0.1; (status code, body).
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((code, body))
}
