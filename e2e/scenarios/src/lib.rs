//! The harness of the end-to-end scenarios: a local cluster of real nodes brought up by
//! `e2e/cluster/up.sh` (control plane, kubelets and containerd on this host, e2e/nodes/; the
//! operator installed with helm from its image) and reached through TENSORFLEET_E2E_CLUSTER, its
//! directory. `make e2e` (and so `make test`) brings it up, runs the scenarios and takes it down.
//! Everything a scenario does goes through the API server, kubectl or a node's container runtime,
//! as a user's or an operator's would; it reads results from the claim's directory on the host,
//! which is where the provisioner keeps the volume.

use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::ResourceExt;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use tensorfleet_operator::crd::{JobPhase, TrainingJob};

pub const CLUSTER_VAR: &str = "TENSORFLEET_E2E_CLUSTER";

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the repository root")
}

pub struct Cluster {
    pub client: kube::Client,
    pub dir: PathBuf,
    kubectl: PathBuf,
    /// DIR/env's settings (KEY=value lines): the nodes' containerd sockets among them.
    env: std::collections::BTreeMap<String, String>,
}

/// A running container as its node's runtime knows it.
pub struct Container {
    /// The node's containerd socket.
    pub socket: PathBuf,
    pub id: String,
    /// Its first process, on the host.
    pub pid: u32,
}

/// A node `Cluster::stop_node` stopped: the command lines that start it again. Dropped without
/// `Cluster::restart_node` (a scenario that failed first), it starts the node again all the same,
/// so that the scenarios after it have every node.
pub struct StoppedNode {
    pub name: String,
    dir: PathBuf,
    kubelet: Vec<String>,
    containerd: Vec<String>,
    started: bool,
}

impl StoppedNode {
    /// containerd, and once it answers, the kubelet (which exits when its runtime does not).
    fn start(&mut self) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        start_again(&self.dir, &self.containerd, &format!("containerd-{}", self.name));
        let socket = self.dir.join("nodes").join(&self.name).join("containerd.sock");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !Command::new("ctr").arg("-a").arg(&socket).arg("version").output().is_ok_and(|o| o.status.success()) {
            if Instant::now() > deadline {
                eprintln!("node {}: containerd did not answer within 60 s of its restart", self.name);
                return;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        start_again(&self.dir, &self.kubelet, &format!("kubelet-{}", self.name));
    }
}

impl Drop for StoppedNode {
    fn drop(&mut self) {
        self.start();
    }
}

/// Starts `argv` again in its own session, logging to DIR/logs/`log`.log (appended), and adds it
/// to DIR/pids, where down.sh finds what to stop. It outlives the scenario; should it exit
/// before, it is reaped.
fn start_again(dir: &Path, argv: &[String], log: &str) {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("logs").join(format!("{log}.log")))
        .expect("the component's log");
    // setsid execs without forking (a child is no group leader), so the pid is the program's.
    let mut child = Command::new("setsid")
        .args(argv)
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("the log"))
        .stderr(file)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {} again: {e}", argv[0]));
    let mut pids = std::fs::OpenOptions::new().append(true).open(dir.join("pids")).expect("the pids");
    std::io::Write::write_all(&mut pids, format!("{}\n", child.id()).as_bytes()).expect("recording the pid");
    std::thread::spawn(move || child.wait());
}

/// Whether process `pid` has exited with all its threads, so that its files and sockets are
/// closed: gone, or a zombie left alone in its thread group (a killed multithreaded process's
/// first thread turns zombie while the others still hold its listening socket).
fn exited(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return true };
    let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next());
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
    matches!(state, Some('Z' | 'X') | None) && threads <= 1
}

/// Every process of the host with its command line (those that have one).
fn processes() -> Vec<(u32, Vec<String>)> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let argv: Vec<String> = cmdline
                .split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            (!argv.is_empty()).then_some((pid, argv))
        })
        .collect()
}

impl Cluster {
    /// The cluster `make e2e` started. Panics with what to do when there is none: these tests
    /// cannot run without it and must not pass without it (they are `#[ignore]`d, so a plain
    /// `cargo test` lists them as ignored; e2e/scenarios/run.sh runs them).
    pub async fn connect() -> Cluster {
        let dir = std::env::var_os(CLUSTER_VAR).map(PathBuf::from).unwrap_or_else(|| {
            panic!("{CLUSTER_VAR} is not set: run the scenarios with `make e2e` (as root), which brings up the local cluster")
        });
        let text = std::fs::read_to_string(dir.join("env")).unwrap_or_else(|e| panic!("{}/env: {e}", dir.display()));
        // Values are written with printf %q; the cluster's paths and names need no unquoting.
        let env: std::collections::BTreeMap<String, String> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.trim_matches('\'').to_string()))
            .collect();
        let bin = env
            .get("TENSORFLEET_K8S_BIN")
            .unwrap_or_else(|| panic!("{}/env names no TENSORFLEET_K8S_BIN", dir.display()))
            .clone();
        let kubeconfig_path = dir.join("kubeconfig");
        let kubeconfig = Kubeconfig::read_from(&kubeconfig_path).expect("the cluster's kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .expect("a client configuration");
        let client = kube::Client::try_from(config).expect("a client");
        Cluster { client, kubectl: PathBuf::from(bin).join("kubectl"), dir, env }
    }

    /// The node that keeps the cluster's services (CoreDNS, the provisioner, the operator),
    /// which no scenario may lose.
    pub fn system_node(&self) -> String {
        self.env.get("SYSTEM_NODE").expect("SYSTEM_NODE in the cluster's env").clone()
    }

    /// Runs kubectl against the cluster with `stdin`.
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Output {
        use std::io::Write;
        let mut child = Command::new(&self.kubectl)
            .args(args)
            .current_dir(repo())
            .env("KUBECONFIG", self.dir.join("kubeconfig"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running kubectl");
        let mut input = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            input.write_all(text.as_bytes()).expect("writing to kubectl");
        }
        drop(input);
        child.wait_with_output().expect("kubectl's output")
    }

    /// A fresh namespace for one scenario, where the API server admits only pods that meet the
    /// "restricted" Pod Security Standard (the operator's pods do, by default).
    pub async fn namespace(&self, scenario: &str) -> String {
        let name = format!("{scenario}-{}", std::process::id());
        let labels = json!({"pod-security.kubernetes.io/enforce": "restricted"});
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
        Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("creating a namespace");
        let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(self.client.clone(), &name);
        wait_for(Duration::from_secs(60), "the namespace's default ServiceAccount", || async {
            sas.get_opt("default").await.ok()?
        })
        .await;
        name
    }

    /// The quickstart's data in the namespace, made as e2e/cluster/prepare-data.yaml says: a
    /// claim `tensorfleet-data` filled with token shards by a pod that runs the worker image's
    /// `prepare-data` on the repository's demo corpus.
    pub async fn prepare_data(&self, ns: &str) {
        let corpus = repo().join("examples/local/data/corpus.txt");
        let from_file = format!("--from-file=corpus.txt={}", corpus.display());
        for args in [
            vec!["create", "configmap", "corpus", "-n", ns, from_file.as_str()],
            vec!["apply", "-n", ns, "-f", "e2e/cluster/prepare-data.yaml"],
        ] {
            let out = self.kubectl(&args, None);
            assert!(out.status.success(), "kubectl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let phase = wait_for(Duration::from_secs(120), "the prepare-data pod to finish", || async {
            let p = pods.get("prepare-data").await.ok()?;
            p.status?.phase.filter(|p| p == "Succeeded" || p == "Failed")
        })
        .await;
        assert_eq!(phase, "Succeeded", "prepare-data failed:\n{}", self.diagnostics(ns).await);
    }

    /// Server-side applies a TrainingJob, as `kubectl apply --server-side` would.
    pub async fn apply_job(&self, ns: &str, manifest: &Value) -> Result<TrainingJob, kube::Error> {
        let api: Api<TrainingJob> = Api::namespaced(self.client.clone(), ns);
        let name = manifest["metadata"]["name"].as_str().expect("a name").to_string();
        api.patch(&name, &PatchParams::apply("tensorfleet-e2e").force(), &Patch::Apply(manifest)).await
    }

    pub async fn job(&self, ns: &str, name: &str) -> TrainingJob {
        Api::<TrainingJob>::namespaced(self.client.clone(), ns).get(name).await.expect("reading the TrainingJob")
    }

    /// Polls the job until `check` says yes (calling it on every reading), or panics after
    /// `timeout` with what the cluster looks like.
    pub async fn wait_job(
        &self,
        ns: &str,
        name: &str,
        timeout: Duration,
        what: &str,
        mut check: impl FnMut(&TrainingJob) -> bool,
    ) -> TrainingJob {
        let api: Api<TrainingJob> = Api::namespaced(self.client.clone(), ns);
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(job) = api.get(name).await {
                if check(&job) {
                    return job;
                }
            }
            if Instant::now() > deadline {
                panic!("timed out after {timeout:?} waiting for {what}:\n{}", self.diagnostics(ns).await);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The pods of the namespace by role label (`worker`, `launcher`).
    pub async fn pods(&self, ns: &str, role: &str) -> Vec<Pod> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let lp = ListParams::default().labels(&format!("tensorfleet.dev/role={role}"));
        let mut pods = api.list(&lp).await.expect("listing pods").items;
        pods.sort_by_key(|p| p.name_any());
        pods
    }

    /// The host directory behind a claim (the provisioner's hostPath volume).
    pub async fn claim_dir(&self, ns: &str, claim: &str) -> PathBuf {
        let pvc =
            Api::<PersistentVolumeClaim>::namespaced(self.client.clone(), ns).get(claim).await.expect("the claim");
        let volume = pvc.spec.and_then(|s| s.volume_name).expect("a bound claim");
        let pv = Api::<PersistentVolume>::all(self.client.clone()).get(&volume).await.expect("the volume");
        PathBuf::from(pv.spec.and_then(|s| s.host_path).expect("a hostPath volume").path)
    }

    /// Pod `name`'s first container as its node's containerd runs it.
    pub async fn container(&self, ns: &str, name: &str) -> Container {
        let pod = Api::<Pod>::namespaced(self.client.clone(), ns).get(name).await.expect("the pod");
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).expect("a scheduled pod");
        let id = pod
            .status
            .and_then(|s| s.container_statuses)
            .and_then(|c| c.into_iter().next())
            .and_then(|c| c.container_id)
            .and_then(|id| id.strip_prefix("containerd://").map(str::to_string))
            .unwrap_or_else(|| panic!("{ns}/{name} has no running container"));
        let key = format!("CONTAINERD_{}", node.to_uppercase().replace('-', "_"));
        let socket = PathBuf::from(self.env.get(&key).unwrap_or_else(|| panic!("no {key} in the cluster's env")));
        let out =
            Command::new("ctr").arg("-a").arg(&socket).args(["-n", "k8s.io", "tasks", "ls"]).output().expect("ctr");
        let listing = String::from_utf8_lossy(&out.stdout);
        let pid = listing
            .lines()
            .find_map(|l| {
                let mut fields = l.split_whitespace();
                (fields.next() == Some(&id)).then(|| fields.next()?.parse().ok())?
            })
            .unwrap_or_else(|| panic!("{node}'s containerd has no task {id}:\n{listing}"));
        Container { socket, id, pid }
    }

    /// What pod `name`'s containers logged, its previous start's first where it restarted
    /// (`kubectl logs`; a pod deleted and made again under the same name starts a new log).
    pub fn pod_logs(&self, ns: &str, name: &str) -> String {
        let mut text = String::new();
        for previous in [true, false] {
            let mut args = vec!["logs", "-n", ns, name, "--all-containers"];
            if previous {
                args.push("--previous");
            }
            let out = self.kubectl(&args, None);
            if out.status.success() {
                text.push_str(&String::from_utf8_lossy(&out.stdout));
            }
        }
        text
    }

    /// What to look at when a scenario fails: the jobs, the pods and their logs' tails, and the
    /// kubelets' logs' tails.
    pub async fn diagnostics(&self, ns: &str) -> String {
        let text = |o: Output| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        let mut out = text(self.kubectl(&["get", "trainingjobs,pods,pvc", "-n", ns, "-o", "wide"], None));
        out.push_str(&text(self.kubectl(&["get", "trainingjobs", "-n", ns, "-o", "yaml"], None)));
        let tail = |text: &str, n: usize| {
            text.lines().rev().take(n).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
        };
        if let Ok(pods) = Api::<Pod>::namespaced(self.client.clone(), ns).list(&ListParams::default()).await {
            for p in pods {
                out.push_str(&format!(
                    "--- logs of {}:\n{}\n",
                    p.name_any(),
                    tail(&self.pod_logs(ns, &p.name_any()), 25)
                ));
            }
        }
        let logs = std::fs::read_dir(self.dir.join("logs"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_else(|_| Vec::new());
        for log in logs.iter().filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("kubelet-"))) {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            out.push_str(&format!("--- {} (tail):\n{}\n", log.display(), tail(&text, 10)));
        }
        out
    }

    /// Restarts the API server as a crash and its supervisor would: SIGKILL, then the same
    /// command line again (its log appended to), until it answers. The new process joins
    /// DIR/pids, where down.sh finds what to stop.
    pub async fn restart_api_server(&self) {
        let (pid, argv) = processes()
            .into_iter()
            .find(|(_, argv)| {
                argv[0].ends_with("/kube-apiserver") && argv.iter().any(|a| a.contains(&*self.dir.to_string_lossy()))
            })
            .expect("this cluster's kube-apiserver among the host's processes");
        let killed = Command::new("kill").args(["-KILL", &pid.to_string()]).status().expect("kill");
        assert!(killed.success(), "kill -KILL {pid} (kube-apiserver) failed");
        wait_for(Duration::from_secs(30), "the killed kube-apiserver to exit", || async { exited(pid).then_some(()) })
            .await;
        start_again(&self.dir, &argv, "kube-apiserver");
        let deadline = Instant::now() + Duration::from_secs(90);
        while self.client.apiserver_version().await.is_err() {
            assert!(Instant::now() < deadline, "kube-apiserver did not answer within 90 s of its restart");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Stops node `name` as a power cut would: every container killed through its runtime, then
    /// its kubelet, containerd and the runtime's shims killed. Returns how to start it again
    /// (`restart_node`).
    pub async fn stop_node(&self, name: &str) -> StoppedNode {
        let key = format!("CONTAINERD_{}", name.to_uppercase().replace('-', "_"));
        let socket = self.env.get(&key).unwrap_or_else(|| panic!("no {key} in the cluster's env")).clone();
        // The node's own processes all name its folder: kubelet, containerd and the shims.
        let folder = format!("{}/", self.dir.join("nodes").join(name).display());
        let program = |argv: &[String]| argv[0].rsplit('/').next().unwrap_or_default().to_string();
        let kill = |pid: u32| Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        let (kubelet, rest): (Vec<_>, Vec<_>) = processes()
            .into_iter()
            .filter(|(_, argv)| argv.iter().any(|a| a.contains(&folder)))
            .partition(|(_, argv)| program(argv) == "kubelet");
        let mut stopped = StoppedNode {
            name: name.to_string(),
            dir: self.dir.clone(),
            kubelet: Vec::new(),
            containerd: Vec::new(),
            started: false,
        };
        // The kubelet first: one that outlives its containers reports their deaths (exit 137)
        // before the node is seen lost, which a power cut would not let it do.
        for (pid, argv) in kubelet {
            stopped.kubelet = argv;
            let _ = kill(pid);
        }
        let ctr = |args: &[&str]| Command::new("ctr").args(["-a", &socket, "-n", "k8s.io"]).args(args).output();
        let tasks = ctr(&["tasks", "ls", "-q"]).expect("ctr tasks ls");
        for id in String::from_utf8_lossy(&tasks.stdout).split_whitespace() {
            let _ = ctr(&["tasks", "kill", "--all", "--signal", "SIGKILL", id]);
        }
        for (pid, argv) in rest {
            if program(&argv) == "containerd" {
                stopped.containerd = argv;
            }
            let _ = kill(pid);
        }
        assert!(
            !stopped.kubelet.is_empty() && !stopped.containerd.is_empty(),
            "node {name}: no kubelet or containerd among the processes naming {folder}"
        );
        stopped
    }

    /// Starts a node `stop_node` stopped (containerd, then its kubelet, with the same command
    /// lines, their logs appended to) and waits until the API says it is Ready.
    pub async fn restart_node(&self, mut node: StoppedNode) {
        node.start();
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.client.clone());
        wait_for(Duration::from_secs(120), &format!("node {} to be Ready again", node.name), || async {
            let n = nodes.get(&node.name).await.ok()?;
            let ready = n.status?.conditions?.into_iter().any(|c| c.type_ == "Ready" && c.status == "True");
            ready.then_some(())
        })
        .await;
    }

    pub async fn delete_namespace(&self, ns: &str) {
        let _ = Api::<Namespace>::all(self.client.clone()).delete(ns, &DeleteParams::default()).await;
    }
}

/// examples/cpu-quickstart.yaml as a JSON value, renamed, with `training` merged over its
/// spec.training (a JSON merge patch: objects merge, anything else replaces).
///
/// Each node of the local cluster is this whole host (2 CPUs on the development machines), so
/// the example's request of 2 CPUs per worker pod would leave one of its pods unschedulable:
/// the scenarios ask for half a CPU.
pub fn quickstart(name: &str, training: Value) -> Value {
    let text = std::fs::read_to_string(repo().join("examples/cpu-quickstart.yaml")).expect("the quickstart example");
    let mut manifest: Value = serde_yaml::from_str(&text).expect("the quickstart example parses");
    manifest["metadata"]["name"] = json!(name);
    manifest["spec"]["resources"]["requests"]["cpu"] = json!("500m");
    merge(&mut manifest["spec"]["training"], training);
    manifest
}

/// Long enough for a small job on two busy cores, short enough that a hang fails the run.
pub const TRAINING: Duration = Duration::from_secs(600);

/// A job long enough to be caught mid-run: 60 steps, a checkpoint every 10. Its steps are the
/// quickstart's model on a quarter of the batch, of half-length sequences (a step takes a
/// quarter of the time): these scenarios are about what happens around training, and the
/// quickstart's own scenario trains the example as shipped.
pub fn long_quickstart(name: &str) -> Value {
    quickstart(
        name,
        json!({"steps": 60, "batchSize": 2, "model": {"gpt2": {"seqLen": 32}}, "checkpoint": {"every": 10, "keep": 3}, "evaluation": {"every": 0}, "logging": {"every": 1}, "lrSchedule": {"warmupSteps": 5}}),
    )
}

/// JSON merge patch (RFC 7386) of `patch` into `target`.
pub fn merge(target: &mut Value, patch: Value) {
    match patch {
        Value::Object(fields) => {
            if !target.is_object() {
                *target = json!({});
            }
            let object = target.as_object_mut().expect("made an object above");
            for (k, v) in fields {
                if v.is_null() {
                    object.remove(&k);
                } else {
                    merge(object.entry(k).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other,
    }
}

pub fn phase(job: &TrainingJob) -> &'static str {
    job.status.as_ref().and_then(|s| s.phase).map_or("", JobPhase::as_str)
}

/// The lines of a metrics.jsonl.
pub fn metrics(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

/// The training loss of each logged step, the last logged value winning (a resumed run logs
/// again the steps after its checkpoint).
pub fn losses(metrics: &[Value]) -> std::collections::BTreeMap<u64, f64> {
    metrics.iter().filter_map(|m| Some((m.get("step")?.as_u64()?, m.get("loss")?.as_f64()?))).collect()
}

/// Waits until `path` exists (a checkpoint on a claim, say), polling the host's filesystem every
/// 50 ms: the operator's progress is read every 10 s, too coarse to catch a short run mid-way.
pub async fn wait_for_path(path: &Path, timeout: Duration) {
    wait_for(timeout, &format!("{} to exist", path.display()), || async { path.exists().then_some(()) }).await
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
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
