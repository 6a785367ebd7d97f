//! The kubelet's pod loop: every pod bound to one of the agent's nodes is run as isolated
//! processes (one shim per container, see `container`), probed, restarted by its restartPolicy,
//! stopped gracefully when deleted, and reported in its status: phase, IP, conditions, and each
//! container's state with exit code, reason and termination message. Container logs are kept on
//! disk under the pod's directory, one file per start.
//!
//! One task owns all pod state; the pod watch, the containers' exits and a one-second tick come
//! to it as events, so there is no locking and the order of what happens to a pod is the order of
//! the events.

use crate::dns::{self, SharedDns};
use crate::images::{self, Images};
use crate::network::{Network, Sandbox};
use crate::probes::{ProbeState, Verdict};
use crate::volumes::{self, HostVolume};
use crate::{container, node};
use anyhow::{bail, Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
    ContainerStatus, EnvVar, HostIP, Pod, PodCondition, PodIP, PodStatus, Secret,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Names of the agent's network namespaces start with this (leftovers are deleted at start).
pub const NETNS_PREFIX: &str = "tf-";
/// How long a failed pod setup (volume not ready, say) waits before the next try.
const RETRY: Duration = Duration::from_secs(2);
/// Restart back-off of a crashing container: doubles from 1 s up to this.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// The kubelet's limits on a termination message taken from the log.
const LOG_MESSAGE_LINES: usize = 80;
const LOG_MESSAGE_BYTES: usize = 2048;

pub struct Config {
    pub client: Client,
    pub nodes: HashSet<String>,
    pub state: PathBuf,
    pub images: Images,
    pub network: Network,
    pub dns: SharedDns,
    /// This binary, which is also the container shim.
    pub shim: PathBuf,
    /// The `kubernetes` Service's address and port, for the containers' environment.
    pub service_ip: Ipv4Addr,
}

enum Event {
    Pod(Box<Pod>),
    Gone(Box<Pod>),
    Exited { uid: String, index: usize, start: u32, code: i32 },
}

enum State {
    Waiting { reason: String, message: Option<String> },
    Running { shim: u32, since: Time, started: Instant },
    Terminated(ContainerStateTerminated),
}

struct ContainerRuntime {
    spec: Container,
    state: State,
    /// Starts so far; the first start is 1, so restarts = starts - 1.
    starts: u32,
    ready: bool,
    readiness: ProbeState,
    liveness: ProbeState,
    last_termination: Option<ContainerStateTerminated>,
    not_before: Option<Instant>,
    backoff: Duration,
}

struct PodRuntime {
    pod: Pod,
    dir: PathBuf,
    sandbox: Option<Sandbox>,
    volumes: Option<BTreeMap<String, HostVolume>>,
    containers: Vec<ContainerRuntime>,
    /// Why the pod's containers could not be created yet (a volume, the network).
    setup_error: Option<String>,
    next_try: Instant,
    start_time: Time,
    /// Set once SIGTERM went out; SIGKILL follows at this deadline.
    kill_at: Option<Instant>,
    /// Deleted from the API server (no status to write, nothing to delete).
    gone: bool,
    /// The pod reached Succeeded or Failed and its sandbox is gone.
    finished: bool,
    last_status: Option<serde_json::Value>,
}

pub async fn run(mut cfg: Config) -> Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Event>();
    let watch_tx = tx.clone();
    let nodes = cfg.nodes.clone();
    let pods_api = Api::<Pod>::all(cfg.client.clone());
    tokio::spawn(async move {
        use kube::runtime::WatchStreamExt;
        let mut events = watcher(pods_api, watcher::Config::default()).default_backoff().boxed();
        while let Some(event) = events.next().await {
            let ours = |p: &Pod| p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some_and(|n| nodes.contains(n));
            let sent = match event {
                Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) if ours(&p) => {
                    watch_tx.send(Event::Pod(Box::new(p)))
                }
                Ok(watcher::Event::Delete(p)) if ours(&p) => watch_tx.send(Event::Gone(Box::new(p))),
                Ok(_) => Ok(()),
                Err(e) => {
                    tracing::warn!("watching pods: {e}");
                    Ok(())
                }
            };
            if sent.is_err() {
                return;
            }
        }
    });
    let mut pods: HashMap<String, PodRuntime> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        let touched: Vec<String> = tokio::select! {
            Some(event) = rx.recv() => match event {
                Event::Pod(pod) => {
                    let uid = pod.uid().unwrap_or_default();
                    match pods.get_mut(&uid) {
                        Some(rt) => rt.pod = *pod,
                        None => {
                            let terminal = matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"));
                            if terminal && pod.metadata.deletion_timestamp.is_none() {
                                continue; // finished before this agent started
                            }
                            pods.insert(uid.clone(), PodRuntime::new(*pod, &cfg.state));
                        }
                    }
                    vec![uid]
                }
                Event::Gone(pod) => {
                    let uid = pod.uid().unwrap_or_default();
                    if let Some(rt) = pods.get_mut(&uid) {
                        rt.gone = true;
                    }
                    vec![uid]
                }
                Event::Exited { uid, index, start, code } => {
                    if let Some(rt) = pods.get_mut(&uid) {
                        rt.exited(index, start, code);
                    }
                    vec![uid]
                }
            },
            _ = tick.tick() => pods.keys().cloned().collect(),
        };
        for uid in touched {
            let Some(rt) = pods.get_mut(&uid) else { continue };
            if let Err(e) = rt.sync(&mut cfg, &tx).await {
                tracing::warn!(pod = %rt.key(), "{e:#}");
            }
            if rt.removable() {
                pods.remove(&uid);
            }
        }
    }
}

fn now() -> Time {
    Time(Timestamp::now())
}

impl PodRuntime {
    fn new(pod: Pod, state: &Path) -> PodRuntime {
        let dir = state.join(format!(
            "{}_{}_{}",
            pod.namespace().unwrap_or_default(),
            pod.name_any(),
            pod.uid().unwrap_or_default()
        ));
        let containers = pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .map(|c| ContainerRuntime {
                spec: c.clone(),
                state: State::Waiting { reason: "ContainerCreating".into(), message: None },
                starts: 0,
                ready: false,
                readiness: ProbeState::default(),
                liveness: ProbeState::default(),
                last_termination: None,
                not_before: None,
                backoff: Duration::from_secs(1),
            })
            .collect();
        PodRuntime {
            pod,
            dir,
            sandbox: None,
            volumes: None,
            containers,
            setup_error: None,
            next_try: Instant::now(),
            start_time: now(),
            kill_at: None,
            gone: false,
            finished: false,
            last_status: None,
        }
    }

    fn key(&self) -> String {
        format!("{}/{}", self.pod.namespace().unwrap_or_default(), self.pod.name_any())
    }

    fn uid(&self) -> String {
        self.pod.uid().unwrap_or_default()
    }

    fn restart_policy(&self) -> &str {
        self.pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()).unwrap_or("Always")
    }

    fn deleting(&self) -> bool {
        self.gone || self.pod.metadata.deletion_timestamp.is_some()
    }

    fn running(&self) -> impl Iterator<Item = u32> + '_ {
        self.containers.iter().filter_map(|c| match c.state {
            State::Running { shim, .. } => Some(shim),
            _ => None,
        })
    }

    /// Removable from the agent's table: deleted and nothing left running.
    fn removable(&self) -> bool {
        self.gone && self.running().next().is_none() && self.sandbox.is_none()
    }

    fn exited(&mut self, index: usize, start: u32, code: i32) {
        let Some(c) = self.containers.get_mut(index) else { return };
        let State::Running { since, .. } = &c.state else { return };
        if c.starts != start {
            return;
        }
        let message = termination_message(&self.dir, &c.spec, c.starts, code);
        c.state = State::Terminated(ContainerStateTerminated {
            exit_code: code,
            reason: Some(if code == 0 { "Completed" } else { "Error" }.into()),
            message,
            started_at: Some(since.clone()),
            finished_at: Some(now()),
            container_id: Some(container_id(&self.pod, &c.spec.name, c.starts)),
            signal: (code > 128).then_some(code - 128),
        });
        c.ready = false;
    }

    async fn sync(&mut self, cfg: &mut Config, tx: &mpsc::UnboundedSender<Event>) -> Result<()> {
        if self.deleting() {
            return self.stop(cfg).await;
        }
        if self.finished {
            return Ok(());
        }
        if self.volumes.is_none() || self.sandbox.is_none() {
            if Instant::now() < self.next_try {
                return Ok(());
            }
            if let Err(e) = self.set_up(cfg).await {
                self.setup_error = Some(format!("{e:#}"));
                self.next_try = Instant::now() + RETRY;
                return self.publish(cfg).await;
            }
            self.setup_error = None;
        }
        let policy = self.restart_policy().to_string();
        for index in 0..self.containers.len() {
            self.sync_container(cfg, tx, index, &policy).await;
        }
        if self.terminal_phase().is_some() {
            self.tear_down(cfg).await;
            self.finished = true;
        }
        self.publish(cfg).await
    }

    async fn sync_container(
        &mut self,
        cfg: &mut Config,
        tx: &mpsc::UnboundedSender<Event>,
        index: usize,
        policy: &str,
    ) {
        let ip = self.sandbox.as_ref().map(|s| s.ip).unwrap_or(Ipv4Addr::UNSPECIFIED);
        let c = &mut self.containers[index];
        let due = c.not_before.is_none_or(|t| Instant::now() >= t);
        match &c.state {
            State::Waiting { .. } if due => {
                let result = self.start(cfg, tx, index).await;
                let c = &mut self.containers[index];
                if let Err(e) = result {
                    let reason = if format!("{e:#}").contains("is not one this node can run") {
                        "ErrImagePull"
                    } else {
                        "CreateContainerError"
                    };
                    c.state = State::Waiting { reason: reason.into(), message: Some(format!("{e:#}")) };
                    c.not_before = Some(Instant::now() + RETRY);
                }
            }
            State::Terminated(t) => {
                let restart = policy == "Always" || (policy == "OnFailure" && t.exit_code != 0);
                if restart {
                    c.last_termination = Some(t.clone());
                    c.state = State::Waiting { reason: "CrashLoopBackOff".into(), message: None };
                    c.not_before = Some(Instant::now() + c.backoff);
                    c.backoff = (c.backoff * 2).min(MAX_BACKOFF);
                }
            }
            State::Running { shim, started, .. } => {
                let (shim, started) = (*shim, *started);
                if let Some(probe) = c.spec.readiness_probe.clone() {
                    match c.readiness.run(&probe, &c.spec, ip, started).await {
                        Verdict::Passed => c.ready = true,
                        Verdict::Failed(_) => c.ready = false,
                        Verdict::Unchanged => {}
                    }
                } else {
                    c.ready = true;
                }
                if let Some(probe) = c.spec.liveness_probe.clone() {
                    if let Verdict::Failed(why) = c.liveness.run(&probe, &c.spec, ip, started).await {
                        tracing::info!(pod = %self.pod.name_any(), container = %c.spec.name, "liveness probe failed ({why}); killing it");
                        signal(shim, nix::sys::signal::Signal::SIGKILL);
                        c.liveness = ProbeState::default();
                    }
                }
            }
            State::Waiting { .. } => {}
        }
    }

    /// The pod's network namespace, hosts file and volumes.
    async fn set_up(&mut self, cfg: &mut Config) -> Result<()> {
        std::fs::create_dir_all(self.dir.join("logs")).with_context(|| format!("creating {}", self.dir.display()))?;
        if self.volumes.is_none() {
            self.volumes = Some(volumes::prepare(&cfg.client, &self.pod, &self.dir.join("volumes")).await?);
        }
        if self.sandbox.is_none() {
            let netns = format!("{NETNS_PREFIX}{}", &self.uid()[..self.uid().len().min(13)]);
            let sandbox = cfg.network.create(&netns).await?;
            let spec = self.pod.spec.clone().unwrap_or_default();
            let hostname = self.hostname();
            let ns = self.pod.namespace().unwrap_or_default();
            let own = dns::own_lines(&sandbox.ip.to_string(), &hostname, spec.subdomain.as_deref(), &ns);
            cfg.dns.lock().unwrap().add_pod(&self.uid(), self.dir.join("hosts"), own)?;
            std::fs::write(self.dir.join("hostname"), format!("{hostname}\n"))?;
            std::fs::write(
                self.dir.join("resolv.conf"),
                format!(
                    "# Names resolve from /etc/hosts (tensorfleet-node-agent); there is no DNS server.\nsearch {ns}.svc.{d} svc.{d} {d}\nnameserver 127.0.0.1\noptions ndots:5 timeout:1 attempts:1\n",
                    d = dns::CLUSTER_DOMAIN
                ),
            )?;
            self.sandbox = Some(sandbox);
            self.start_time = now();
        }
        Ok(())
    }

    fn hostname(&self) -> String {
        let spec = self.pod.spec.as_ref();
        let name = spec.and_then(|s| s.hostname.clone()).unwrap_or_else(|| self.pod.name_any());
        name.chars().take(63).collect()
    }

    async fn start(&mut self, cfg: &mut Config, tx: &mpsc::UnboundedSender<Event>, index: usize) -> Result<()> {
        let sandbox = self.sandbox.clone().context("no sandbox")?;
        let volumes = self.volumes.clone().unwrap_or_default();
        let c = &self.containers[index];
        let spec = &c.spec;
        let image_ref = spec.image.clone().unwrap_or_default();
        let image = cfg.images.resolve(&image_ref)?;
        let argv = images::argv(image, spec.command.as_deref().unwrap_or(&[]), spec.args.as_deref());
        if argv.is_empty() {
            bail!("container {}: no command, and image {image_ref} has no ENTRYPOINT or CMD", spec.name);
        }
        let env = self.environment(&cfg.client, spec, &sandbox, cfg.service_ip).await?;
        let start = c.starts + 1;
        let termination_log = self.dir.join(format!("{}.termination-log", spec.name));
        std::fs::write(&termination_log, b"")?;
        let mut mounts = vec![
            container::Mount { source: image.programs.clone(), target: images::PROGRAM_DIR.into(), read_only: true },
            container::Mount { source: self.dir.join("hosts"), target: "/etc/hosts".into(), read_only: true },
            container::Mount { source: self.dir.join("hostname"), target: "/etc/hostname".into(), read_only: true },
            container::Mount {
                source: self.dir.join("resolv.conf"),
                target: "/etc/resolv.conf".into(),
                read_only: true,
            },
            container::Mount {
                source: termination_log,
                target: spec.termination_message_path.clone().unwrap_or_else(|| "/dev/termination-log".into()).into(),
                read_only: false,
            },
        ];
        for m in spec.volume_mounts.iter().flatten() {
            let v = volumes
                .get(&m.name)
                .with_context(|| format!("volumeMount {:?}: the pod has no such volume", m.name))?;
            let mut source = v.path.clone();
            if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
                if Path::new(sub).components().any(|c| !matches!(c, std::path::Component::Normal(_))) {
                    bail!("volumeMount {:?}: subPath {sub:?} must stay inside the volume", m.name);
                }
                source = source.join(sub);
                if !source.exists() {
                    std::fs::create_dir_all(&source)?;
                }
            }
            mounts.push(container::Mount {
                source,
                target: m.mount_path.clone().into(),
                read_only: v.read_only || m.read_only.unwrap_or(false),
            });
        }
        let pid_file = self.dir.join(format!("{}.pid", spec.name));
        let shim_spec = container::Spec {
            netns: sandbox.netns_path(),
            hostname: self.hostname(),
            mounts,
            env,
            working_dir: spec.working_dir.clone().map(PathBuf::from),
            argv,
            pid_file,
        };
        let spec_file = self.dir.join(format!("{}.json", spec.name));
        std::fs::write(&spec_file, serde_json::to_vec_pretty(&shim_spec)?)?;
        let log_dir = self.dir.join("logs").join(&spec.name);
        std::fs::create_dir_all(&log_dir)?;
        let log_path = log_dir.join(format!("{}.log", start - 1));
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path)?;
        let mut child = tokio::process::Command::new(&cfg.shim)
            .arg("container")
            .arg(&spec_file)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting the container shim")?;
        let shim = child.id().context("the shim has no pid")?;
        let (tx, uid) = (tx.clone(), self.uid());
        tokio::spawn(async move {
            let code = match child.wait().await {
                Ok(status) => status
                    .code()
                    .unwrap_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&status).unwrap_or(9)),
                Err(_) => 128,
            };
            let _ = tx.send(Event::Exited { uid, index, start, code });
        });
        let key = self.key();
        let c = &mut self.containers[index];
        c.starts = start;
        c.state = State::Running { shim, since: now(), started: Instant::now() };
        c.readiness = ProbeState::default();
        c.liveness = ProbeState::default();
        tracing::info!(pod = %key, container = %c.spec.name, ip = %sandbox.ip, "started (log {})", log_path.display());
        Ok(())
    }

    /// The container's environment: the image's defaults, the `kubernetes` Service's variables,
    /// then envFrom and env in order (later wins, as in Kubernetes).
    async fn environment(
        &self,
        client: &Client,
        spec: &Container,
        sandbox: &Sandbox,
        service_ip: Ipv4Addr,
    ) -> Result<Vec<(String, String)>> {
        let ns = self.pod.namespace().unwrap_or_default();
        let mut env: Vec<(String, String)> = vec![
            ("PATH".into(), images::DEFAULT_PATH.into()),
            ("HOSTNAME".into(), self.hostname()),
            ("HOME".into(), "/root".into()),
            ("KUBERNETES_SERVICE_HOST".into(), service_ip.to_string()),
            ("KUBERNETES_SERVICE_PORT".into(), "443".into()),
            ("KUBERNETES_SERVICE_PORT_HTTPS".into(), "443".into()),
            ("KUBERNETES_PORT".into(), format!("tcp://{service_ip}:443")),
        ];
        let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
            env.retain(|(name, _)| *name != k);
            env.push((k, v));
        };
        for from in spec.env_from.iter().flatten() {
            let prefix = from.prefix.clone().unwrap_or_default();
            if let Some(r) = &from.config_map_ref {
                match Api::<ConfigMap>::namespaced(client.clone(), &ns).get_opt(&r.name).await? {
                    Some(cm) => cm
                        .data
                        .unwrap_or_default()
                        .into_iter()
                        .for_each(|(k, v)| set(&mut env, format!("{prefix}{k}"), v)),
                    None if r.optional == Some(true) => {}
                    None => bail!("envFrom: ConfigMap {ns}/{} does not exist", r.name),
                }
            }
            if let Some(r) = &from.secret_ref {
                match Api::<Secret>::namespaced(client.clone(), &ns).get_opt(&r.name).await? {
                    Some(s) => s.data.unwrap_or_default().into_iter().for_each(|(k, v)| {
                        set(&mut env, format!("{prefix}{k}"), String::from_utf8_lossy(&v.0).into_owned())
                    }),
                    None if r.optional == Some(true) => {}
                    None => bail!("envFrom: Secret {ns}/{} does not exist", r.name),
                }
            }
        }
        for var in spec.env.iter().flatten() {
            let value = self.env_value(client, &ns, var, sandbox).await.with_context(|| format!("env {}", var.name))?;
            let value = expand(&value, &env);
            set(&mut env, var.name.clone(), value);
        }
        Ok(env)
    }

    async fn env_value(&self, client: &Client, ns: &str, var: &EnvVar, sandbox: &Sandbox) -> Result<String> {
        let Some(from) = &var.value_from else { return Ok(var.value.clone().unwrap_or_default()) };
        if let Some(field) = &from.field_ref {
            return match field.field_path.as_str() {
                "status.podIP" => Ok(sandbox.ip.to_string()),
                path => field_value(&self.pod, path),
            };
        }
        if let Some(key) = &from.config_map_key_ref {
            let cm = Api::<ConfigMap>::namespaced(client.clone(), ns).get_opt(&key.name).await?;
            let value = cm.and_then(|cm| cm.data).and_then(|d| d.get(&key.key).cloned());
            return match value {
                Some(v) => Ok(v),
                None if key.optional == Some(true) => Ok(String::new()),
                None => bail!("ConfigMap {ns}/{} has no key {:?}", key.name, key.key),
            };
        }
        if let Some(key) = &from.secret_key_ref {
            let secret = Api::<Secret>::namespaced(client.clone(), ns).get_opt(&key.name).await?;
            let value = secret.and_then(|s| s.data).and_then(|d| d.get(&key.key).cloned());
            return match value {
                Some(v) => Ok(String::from_utf8_lossy(&v.0).into_owned()),
                None if key.optional == Some(true) => Ok(String::new()),
                None => bail!("Secret {ns}/{} has no key {:?}", key.name, key.key),
            };
        }
        bail!("only fieldRef, configMapKeyRef and secretKeyRef are supported by the node agent")
    }

    /// Stops what runs (SIGTERM, then SIGKILL after the grace period), frees the sandbox and,
    /// for a pod being deleted, completes the deletion as the kubelet does.
    async fn stop(&mut self, cfg: &mut Config) -> Result<()> {
        let running: Vec<u32> = self.running().collect();
        if !running.is_empty() {
            match self.kill_at {
                None => {
                    let grace = if self.gone {
                        0
                    } else {
                        self.pod.metadata.deletion_grace_period_seconds.unwrap_or(30).max(0) as u64
                    };
                    running.iter().for_each(|&shim| signal(shim, nix::sys::signal::Signal::SIGTERM));
                    self.kill_at = Some(Instant::now() + Duration::from_secs(grace));
                }
                Some(deadline) if Instant::now() >= deadline => {
                    running.iter().for_each(|&shim| signal(shim, nix::sys::signal::Signal::SIGKILL));
                }
                Some(_) => {}
            }
            return Ok(());
        }
        self.tear_down(cfg).await;
        if !self.gone {
            // Containers are down: the kubelet's part of a graceful delete is to finish it.
            let api = Api::<Pod>::namespaced(cfg.client.clone(), &self.pod.namespace().unwrap_or_default());
            let dp = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions { uid: self.pod.uid(), resource_version: None }),
                ..DeleteParams::default()
            };
            match api.delete(&self.pod.name_any(), &dp).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
                Err(e) => return Err(e).context("completing the pod's deletion"),
            }
            self.gone = true;
        }
        Ok(())
    }

    async fn tear_down(&mut self, cfg: &mut Config) {
        cfg.dns.lock().unwrap().remove_pod(&self.uid());
        if let Some(sandbox) = self.sandbox.take() {
            cfg.network.delete(&sandbox).await;
        }
    }

    /// Succeeded or Failed once every container has terminated for good.
    fn terminal_phase(&self) -> Option<&'static str> {
        if self.containers.is_empty() {
            return None;
        }
        let mut failed = false;
        for c in &self.containers {
            let State::Terminated(t) = &c.state else { return None };
            match self.restart_policy() {
                "Always" => return None,
                "OnFailure" if t.exit_code != 0 => return None,
                _ => failed |= t.exit_code != 0,
            }
        }
        Some(if failed { "Failed" } else { "Succeeded" })
    }

    fn status(&self, node_ip: Ipv4Addr) -> PodStatus {
        let terminal = self.terminal_phase();
        let any_started = self.containers.iter().any(|c| c.starts > 0);
        let phase = terminal.unwrap_or(if any_started { "Running" } else { "Pending" });
        let all_ready = !self.containers.is_empty() && self.containers.iter().all(|c| c.ready);
        let condition = |type_: &str, ok: bool, reason: Option<&str>| PodCondition {
            type_: type_.into(),
            status: if ok { "True" } else { "False" }.into(),
            reason: reason.map(String::from),
            last_transition_time: Some(now()),
            ..PodCondition::default()
        };
        let old_conditions = self.pod.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
        let mut conditions: Vec<PodCondition> =
            old_conditions.iter().filter(|c| c.type_ == "PodScheduled").cloned().collect();
        let not_ready = (!all_ready).then_some(if terminal.is_some() { "PodCompleted" } else { "ContainersNotReady" });
        conditions.push(condition("PodReadyToStartContainers", self.sandbox.is_some() || self.finished, None));
        conditions.push(condition("Initialized", true, None));
        conditions.push(condition("ContainersReady", all_ready, not_ready));
        conditions.push(condition("Ready", all_ready, not_ready));
        // A transition time only moves when the status does.
        for c in &mut conditions {
            if let Some(old) = old_conditions.iter().find(|o| o.type_ == c.type_ && o.status == c.status) {
                c.last_transition_time = old.last_transition_time.clone();
            }
        }
        let ip = self
            .sandbox
            .as_ref()
            .map(|s| s.ip.to_string())
            .or_else(|| self.pod.status.as_ref().and_then(|s| s.pod_ip.clone()));
        PodStatus {
            phase: Some(phase.into()),
            conditions: Some(conditions),
            host_ip: Some(node_ip.to_string()),
            host_ips: Some(vec![HostIP { ip: node_ip.to_string() }]),
            pod_ip: ip.clone(),
            pod_ips: ip.map(|ip| vec![PodIP { ip }]),
            start_time: Some(self.start_time.clone()),
            message: self.setup_error.clone(),
            reason: None,
            container_statuses: Some(self.containers.iter().map(|c| self.container_status(c)).collect()),
            ..PodStatus::default()
        }
    }

    fn container_status(&self, c: &ContainerRuntime) -> ContainerStatus {
        let state = match &c.state {
            State::Waiting { reason, message } => ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some(reason.clone()),
                    message: message.clone().or_else(|| self.setup_error.clone()),
                }),
                ..ContainerState::default()
            },
            State::Running { since, .. } => ContainerState {
                running: Some(ContainerStateRunning { started_at: Some(since.clone()) }),
                ..ContainerState::default()
            },
            State::Terminated(t) => ContainerState { terminated: Some(t.clone()), ..ContainerState::default() },
        };
        ContainerStatus {
            name: c.spec.name.clone(),
            image: c.spec.image.clone().unwrap_or_default(),
            image_id: String::new(),
            container_id: (c.starts > 0).then(|| container_id(&self.pod, &c.spec.name, c.starts)),
            ready: c.ready,
            started: Some(matches!(c.state, State::Running { .. })),
            restart_count: c.starts.saturating_sub(1) as i32,
            state: Some(state),
            last_state: c
                .last_termination
                .clone()
                .map(|t| ContainerState { terminated: Some(t), ..ContainerState::default() }),
            ..ContainerStatus::default()
        }
    }

    /// Writes the status when it changed (JSON merge: lists are replaced whole).
    async fn publish(&mut self, cfg: &Config) -> Result<()> {
        if self.gone {
            return Ok(());
        }
        let status = serde_json::to_value(self.status(cfg.network.gateway))?;
        if self.last_status.as_ref() == Some(&status) {
            return Ok(());
        }
        let api = Api::<Pod>::namespaced(cfg.client.clone(), &self.pod.namespace().unwrap_or_default());
        let pp = PatchParams { field_manager: Some(node::MANAGER.into()), ..PatchParams::default() };
        match api.patch_status(&self.pod.name_any(), &pp, &Patch::Merge(serde_json::json!({ "status": status }))).await
        {
            Ok(pod) => {
                if pod.uid() == self.pod.uid() {
                    self.pod = pod;
                }
                self.last_status = Some(status);
                Ok(())
            }
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e).context("writing the pod's status"),
        }
    }
}

fn container_id(pod: &Pod, name: &str, start: u32) -> String {
    format!("tensorfleet://{}/{name}/{start}", pod.uid().unwrap_or_default())
}

fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
}

/// The termination message: the file at terminationMessagePath, else (FallbackToLogsOnError and
/// a failure) the tail of the log.
fn termination_message(dir: &Path, spec: &Container, start: u32, code: i32) -> Option<String> {
    let file = std::fs::read_to_string(dir.join(format!("{}.termination-log", spec.name))).unwrap_or_default();
    if !file.trim().is_empty() {
        return Some(file);
    }
    if code == 0 || spec.termination_message_policy.as_deref() != Some("FallbackToLogsOnError") {
        return None;
    }
    let log = std::fs::read(dir.join("logs").join(&spec.name).join(format!("{}.log", start - 1))).ok()?;
    let text = String::from_utf8_lossy(&log);
    let lines: Vec<&str> = text.lines().collect();
    let mut tail = lines[lines.len().saturating_sub(LOG_MESSAGE_LINES)..].join("\n");
    if tail.len() > LOG_MESSAGE_BYTES {
        let mut cut = tail.len() - LOG_MESSAGE_BYTES;
        while !tail.is_char_boundary(cut) {
            cut += 1;
        }
        tail = tail[cut..].to_string();
    }
    (!tail.is_empty()).then_some(tail)
}

/// A downward-API field of the pod (`metadata.name`, `metadata.labels['k']`, …).
pub fn field_value(pod: &Pod, path: &str) -> Result<String> {
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    let keyed = |prefix: &str, map: &BTreeMap<String, String>| -> Option<String> {
        let key = path.strip_prefix(prefix)?.strip_suffix("']")?;
        Some(map.get(key).cloned().unwrap_or_default())
    };
    let value = match path {
        "metadata.name" => pod.name_any(),
        "metadata.namespace" => pod.namespace().unwrap_or_default(),
        "metadata.uid" => pod.uid().unwrap_or_default(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()).unwrap_or_default(),
        "status.hostIP" => status.and_then(|s| s.host_ip.clone()).unwrap_or_default(),
        "status.podIP" => status.and_then(|s| s.pod_ip.clone()).unwrap_or_default(),
        "metadata.labels" => pod.labels().iter().map(|(k, v)| format!("{k}={v:?}\n")).collect(),
        "metadata.annotations" => pod.annotations().iter().map(|(k, v)| format!("{k}={v:?}\n")).collect(),
        _ => keyed("metadata.labels['", pod.labels())
            .or_else(|| keyed("metadata.annotations['", pod.annotations()))
            .with_context(|| format!("fieldRef {path:?} is not supported by the node agent"))?,
    };
    Ok(value)
}

/// `$(VAR)` references to earlier variables, as Kubernetes expands them; `$$` escapes.
fn expand(value: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.push('$');
            rest = stripped;
        } else if let Some(end) = after.strip_prefix('(').and_then(|a| a.find(')')) {
            let name = &after[1..1 + end];
            match env.iter().rev().find(|(k, _)| k == name) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(&rest[i..i + 2 + end + 1]),
            }
            rest = &after[end + 2..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variable_references_expand_like_kubernetes() {
        let env = vec![("A".to_string(), "x".to_string())];
        assert_eq!(expand("$(A)-$(B)-$$(A)-$", &env), "x-$(B)-$(A)-$");
    }
}
