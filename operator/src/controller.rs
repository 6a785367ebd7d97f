//! The reconciler: from a TrainingJob and the pods that exist, decide the next step.
//!
//! One pass: finished jobs are cleaned up (cleanPodPolicy, ttlSecondsAfterFinished); suspended
//! jobs lose their pods; a job past its deadline fails; otherwise the children are applied, the
//! pods of the current attempt are checked for failure (a failed rank restarts the whole gang,
//! exit code 2, 3 or 4 fails the job), missing workers are created, and the launcher is created
//! once every worker is ready. The status is written last, with the job's resourceVersion as a
//! precondition, so a pass that acted on a stale view fails with a conflict and runs again
//! instead of counting a restart twice.

use crate::crd::{CleanPodPolicy, FailureCause, JobPhase, LauncherCreationPolicy, TrainingJob, TrainingJobStatus};
use crate::metrics::Metrics;
use crate::resources::network_policy::OperatorPods;
use crate::resources::{self, labels, names, FIELD_MANAGER};
use crate::status::{self, LauncherFailure};
use crate::{progress, Error, Result};
use k8s_openapi::api::core::v1::{ConfigMap, Node, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Resource, ResourceExt};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

/// How often a running job's progress is read.
const PROGRESS_PERIOD: Duration = Duration::from_secs(10);
/// How soon to look again while pods of an old attempt are still terminating.
const TERMINATING_PERIOD: Duration = Duration::from_secs(2);

/// The pod events that can change a decision: phase, readiness, IP, a terminated container,
/// deletion, attempt. Others (the scheduler's PodScheduled=False on a pending pod, a status
/// heartbeat) would only wake the job to find nothing to do; they are dropped here. Deletions
/// always pass.
pub fn pod_triggers(
    pods: Api<Pod>,
    config: kube::runtime::watcher::Config,
) -> impl futures::Stream<Item = Result<Pod, kube::runtime::watcher::Error>> + Send + 'static {
    use futures::StreamExt;
    use kube::runtime::{watcher, WatchStreamExt};
    let mut seen: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    watcher(pods, config).default_backoff().filter_map(move |event| {
        let trigger = match event {
            Ok(watcher::Event::Apply(pod)) | Ok(watcher::Event::InitApply(pod)) => {
                let state = pod_state(&pod);
                (seen.insert(pod.uid().unwrap_or_default(), state) != Some(state)).then_some(Ok(pod))
            }
            Ok(watcher::Event::Delete(pod)) => {
                seen.remove(&pod.uid().unwrap_or_default());
                Some(Ok(pod))
            }
            Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
            Err(e) => Some(Err(e)),
        };
        futures::future::ready(trigger)
    })
}

/// A hash of what reconcile reads from a pod.
fn pod_state(pod: &Pod) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    status::phase(pod).hash(&mut h);
    status::is_ready(pod).hash(&mut h);
    pod.metadata.deletion_timestamp.is_some().hash(&mut h);
    pod.labels().get(labels::ATTEMPT).hash(&mut h);
    if let Some(st) = &pod.status {
        st.pod_ip.hash(&mut h);
        st.reason.hash(&mut h);
        for cs in st.container_statuses.iter().flatten() {
            let t = cs.state.as_ref().and_then(|s| s.terminated.as_ref());
            t.map(|t| (t.exit_code, t.reason.clone(), t.message.clone())).hash(&mut h);
        }
    }
    h.finish()
}

/// What every reconcile needs.
pub struct Context {
    pub client: kube::Client,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    /// This operator's pods, which the jobs' NetworkPolicies admit to the progress port; `None`
    /// when it runs outside the cluster.
    pub operator_pods: Option<OperatorPods>,
}

/// The pods of one job, split by role and attempt, and the lost nodes under them.
struct Pods {
    workers: Vec<Pod>,
    launcher: Option<Pod>,
    /// Pods of earlier attempts (or marked for deletion): they must be gone before new pods
    /// with the same names are created.
    stale: Vec<Pod>,
    /// The pods' nodes that are lost (status::node_lost), with why: their pods will not report
    /// again, nor end when deleted.
    lost_nodes: BTreeMap<String, String>,
    /// Seconds until a node of the pods that is not Ready now would count as lost.
    next_node_check: Option<u64>,
}

impl Pods {
    fn split(all: Vec<Pod>, attempt: i32) -> Pods {
        let mut pods = Pods {
            workers: Vec::new(),
            launcher: None,
            stale: Vec::new(),
            lost_nodes: BTreeMap::new(),
            next_node_check: None,
        };
        for pod in all {
            let l = pod.labels();
            let current = l.get(labels::ATTEMPT).is_some_and(|a| *a == attempt.to_string());
            if !current || pod.metadata.deletion_timestamp.is_some() {
                pods.stale.push(pod);
            } else if l.get(labels::ROLE).map(String::as_str) == Some(labels::LAUNCHER) {
                pods.launcher = Some(pod);
            } else {
                pods.workers.push(pod);
            }
        }
        pods
    }

    fn worker(&self, name: &str) -> Option<&Pod> {
        self.workers.iter().find(|p| p.name_any() == name)
    }

    fn all(&self) -> impl Iterator<Item = &Pod> {
        self.workers.iter().chain(self.launcher.iter()).chain(self.stale.iter())
    }

    /// Reads the pods' nodes into `lost_nodes` and `next_node_check`. Without the right to read
    /// nodes it finds none lost, and says so in the log.
    async fn check_nodes(&mut self, job: &TrainingJob, ctx: &Context) {
        let api: Api<Node> = Api::all(ctx.client.clone());
        let names: BTreeSet<String> = self.all().filter_map(status::node_of).map(str::to_string).collect();
        let now = status::now();
        for name in names {
            let node = match api.get_opt(&name).await {
                Ok(node) => node,
                Err(e) => {
                    tracing::warn!(node = %name, "cannot read the node, so cannot tell whether it is lost: {e}");
                    continue;
                }
            };
            match status::node_lost(&name, node.as_ref(), job.spec.run_policy.node_lost_after_seconds, &now) {
                Ok(Some(why)) => {
                    self.lost_nodes.insert(name, why);
                }
                Ok(None) => {}
                Err(left) => self.next_node_check = Some(self.next_node_check.map_or(left, |n| n.min(left))),
            }
        }
    }

    /// A current pod on a lost node, and why the node is lost.
    fn on_lost_node(&self) -> Option<(&Pod, &String)> {
        self.workers
            .iter()
            .chain(self.launcher.iter())
            .find_map(|p| Some((p, self.lost_nodes.get(status::node_of(p)?)?)))
    }
}

pub async fn reconcile(job: Arc<TrainingJob>, ctx: Arc<Context>) -> Result<Action> {
    let started = std::time::Instant::now();
    let result = reconcile_job(&job, &ctx).await;
    ctx.metrics.reconciled(&job, started.elapsed(), result.is_err());
    result
}

/// Requeues a failed pass with a short delay; conflicts (a stale view) retry at once.
pub fn error_policy(job: Arc<TrainingJob>, error: &Error, _ctx: Arc<Context>) -> Action {
    if error.is_conflict() {
        tracing::debug!(job = %job.name_any(), "stale view, reconciling again: {error}");
        return Action::requeue(Duration::from_millis(200));
    }
    tracing::warn!(job = %job.name_any(), namespace = ?job.namespace(), "reconcile failed: {error}");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile_job(job: &TrainingJob, ctx: &Context) -> Result<Action> {
    if job.metadata.deletion_timestamp.is_some() {
        // Owner references hand the children to the garbage collector.
        return Ok(Action::await_change());
    }
    let ns = names::namespace(job);
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let old = job.status.clone().unwrap_or_default();
    let mut st = old.clone();
    st.observed_generation = job.metadata.generation;
    let selector = format!("{}={}", labels::JOB, job.name_any());
    let all = pods_api.list(&ListParams::default().labels(&selector)).await?.items;
    let mut pods = Pods::split(all, st.restart_count);
    pods.check_nodes(job, ctx).await;

    if st.is_finished() {
        return finish(job, ctx, &pods_api, &pods, st, &old).await;
    }

    if st.phase.is_none() {
        st.set_phase(JobPhase::Created, "JobCreated", "the operator accepted the job".into());
        publish(ctx, job, EventType::Normal, "Created", "creating children".into()).await;
    }

    if let Err(message) = check_spec(job) {
        st.set_phase(JobPhase::Failed, "InvalidSpec", message.clone());
        st.completion_time = Some(status::now());
        publish(ctx, job, EventType::Warning, "InvalidSpec", message).await;
        write_status(ctx, job, &st, &old).await?;
        return Ok(Action::requeue(Duration::from_secs(1)));
    }

    if job.spec.run_policy.suspend {
        delete_pods(&pods_api, pods.all(), &pods.lost_nodes).await?;
        if st.phase != Some(JobPhase::Suspended) {
            st.set_phase(JobPhase::Suspended, "JobSuspended", "spec.runPolicy.suspend is true: pods deleted".into());
            publish(ctx, job, EventType::Normal, "Suspended", "pods deleted".into()).await;
        }
        // The deadline counts active time only: it starts again on resume.
        st.active_since = None;
        st.workers = Default::default();
        st.workers_summary = Some(format!("0/{}", job.spec.workers));
        st.launcher = None;
        write_status(ctx, job, &st, &old).await?;
        return Ok(Action::await_change());
    }
    if st.phase == Some(JobPhase::Suspended) {
        st.set_phase(JobPhase::Created, "JobResumed", "spec.runPolicy.suspend is false: pods come back".into());
        publish(ctx, job, EventType::Normal, "Resumed", "recreating pods".into()).await;
    }
    let active_since = st.active_since.get_or_insert_with(status::now).clone();

    if let Some(deadline) = job.spec.run_policy.active_deadline_seconds {
        let active = status::now().0.duration_since(active_since.0).as_secs();
        if active >= deadline {
            let message =
                format!("active for {active} s, longer than spec.runPolicy.activeDeadlineSeconds ({deadline})");
            st.failure = Some(FailureCause {
                pod: String::new(),
                reason: "DeadlineExceeded".into(),
                message: message.clone(),
                ..Default::default()
            });
            st.set_phase(JobPhase::Failed, "DeadlineExceeded", message.clone());
            st.completion_time = Some(status::now());
            publish(ctx, job, EventType::Warning, "DeadlineExceeded", message).await;
            write_status(ctx, job, &st, &old).await?;
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
    }

    apply_children(job, ctx, pods.launcher.is_some()).await?;
    apply_network_policy(job, ctx, &mut st).await?;

    // The launcher's outcome decides the job (with a failed worker's cause when there is one);
    // a failed worker restarts the gang.
    if let Some(launcher) = &pods.launcher {
        if status::succeeded(launcher) {
            st.set_phase(JobPhase::Succeeded, "LauncherSucceeded", "mpirun finished: every rank exited 0".into());
            st.completion_time = Some(status::now());
            // Rank 0's endpoint closed with the run, after the last reading: every rank exiting
            // 0 means every step was taken, so the progress is completed rather than left at
            // the last poll (whose loss belonged to an earlier step, so it goes).
            if let Some(p) = st.progress.as_mut() {
                *p = progress::completed(p.total_steps);
            }
            st.launcher = Some("Succeeded".into());
            publish(ctx, job, EventType::Normal, "Succeeded", "training finished".into()).await;
            write_status(ctx, job, &st, &old).await?;
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
        match status::launcher_failure(launcher, &pods.workers, &status::now()) {
            Some(LauncherFailure::Cause(cause)) => {
                return restart_or_fail(job, ctx, &pods_api, &pods, st, &old, cause).await
            }
            Some(LauncherFailure::WaitForWorkers(seconds)) => return Ok(Action::requeue(Duration::from_secs(seconds))),
            None => {}
        }
    }
    // A pod on a lost node will not report again: the gang restarts without the node (whose
    // taints keep the scheduler from it).
    if let Some((pod, why)) = pods.on_lost_node() {
        let cause =
            FailureCause { pod: pod.name_any(), reason: "NodeLost".into(), message: why.clone(), ..Default::default() };
        return restart_or_fail(job, ctx, &pods_api, &pods, st, &old, cause).await;
    }
    for pod in &pods.workers {
        if let Some(cause) = status::failure(pod, true) {
            return restart_or_fail(job, ctx, &pods_api, &pods, st, &old, cause).await;
        }
    }
    // A worker that vanished while ranks run on it takes mpirun down with it; restart now
    // rather than wait for the launcher to notice.
    if pods.launcher.is_some() && pods.workers.len() < job.spec.workers as usize {
        let missing = (0..job.spec.workers).map(|i| names::worker(job, i)).find(|n| pods.worker(n).is_none());
        let cause = FailureCause {
            pod: missing.unwrap_or_default(),
            reason: "PodDeleted".into(),
            message: "a worker pod was deleted while training ran".into(),
            ..Default::default()
        };
        return restart_or_fail(job, ctx, &pods_api, &pods, st, &old, cause).await;
    }

    // Pods of an old attempt hold the names the new ones need.
    delete_pods(&pods_api, pods.stale.iter(), &pods.lost_nodes).await?;
    let waiting_for_stale = !pods.stale.is_empty();
    let mut created = 0;
    if !waiting_for_stale {
        for i in 0..job.spec.workers {
            if pods.worker(&names::worker(job, i)).is_none() {
                let pod = resources::pods::worker(job, i, st.restart_count);
                if let Err(e) = create_pod(&pods_api, pod).await {
                    return refused(job, ctx, st, &old, e).await;
                }
                created += 1;
            }
        }
    }

    let ready = pods.workers.iter().filter(|p| status::is_ready(p)).count() as i32;
    st.workers.active = pods.workers.len() as i32 + created;
    st.workers.ready = ready;
    st.workers.failed = 0;
    st.workers_summary = Some(format!("{ready}/{}", job.spec.workers));

    let policy = job.spec.mpi.launcher_creation_policy;
    let workers_ready = ready == job.spec.workers;
    if pods.launcher.is_none() && !waiting_for_stale && (workers_ready || policy == LauncherCreationPolicy::AtStartup) {
        if let Err(e) = create_pod(&pods_api, resources::pods::launcher(job, st.restart_count)).await {
            return refused(job, ctx, st, &old, e).await;
        }
        publish(ctx, job, EventType::Normal, "LauncherCreated", format!("{ready} workers ready: starting mpirun"))
            .await;
    }
    st.launcher = pods.launcher.as_ref().map(|p| status::phase(p).to_string());

    let running = pods.launcher.as_ref().is_some_and(|p| status::phase(p) == "Running");
    if running {
        if st.phase != Some(JobPhase::Running) {
            st.set_phase(JobPhase::Running, "LauncherRunning", format!("mpirun runs {} ranks", job.world_size()));
            publish(ctx, job, EventType::Normal, "Running", "mpirun started".into()).await;
        }
        st.start_time.get_or_insert_with(status::now);
        read_progress(job, &pods, &mut st).await;
    } else if st.phase == Some(JobPhase::Running) {
        // The launcher is gone without an outcome (deleted by hand): the gang starts over.
        st.set_phase(JobPhase::Created, "LauncherRecreated", "waiting for workers to start the launcher again".into());
    } else if let Some(problem) = pods.workers.iter().chain(pods.launcher.iter()).find_map(status::image_problem) {
        // The job waits, as the kubelet retries; its condition says for what, once.
        let phase = st.phase.unwrap_or(JobPhase::Created);
        if st.condition(phase).is_none_or(|c| c.message != problem) {
            publish(ctx, job, EventType::Warning, "ImageUnavailable", problem.clone()).await;
            st.set_phase(phase, "ImageUnavailable", problem);
        }
    }
    write_status(ctx, job, &st, &old).await?;

    if waiting_for_stale {
        return Ok(Action::requeue(TERMINATING_PERIOD));
    }
    let mut next = if running { PROGRESS_PERIOD } else { Duration::from_secs(60) };
    if let Some(left) = pods.next_node_check {
        next = next.min(Duration::from_secs(left + 1));
    }
    if let Some(deadline) = job.spec.run_policy.active_deadline_seconds {
        let active = status::now().0.duration_since(active_since.0).as_secs();
        next = next.min(Duration::from_secs_f64((deadline as f64 - active as f64).max(0.0) + 0.5));
    }
    Ok(Action::requeue(next))
}

/// Checks what the CRD's schema and CEL rules cannot: the world size when slotsPerWorker comes
/// from the GPU limit, and the training configuration's own rules.
fn check_spec(job: &TrainingJob) -> std::result::Result<(), String> {
    let p = &job.spec.training.parallelism;
    let ranks = (p.data * p.tensor * p.pipeline) as i64;
    let world = job.world_size() as i64;
    if ranks != world {
        return Err(format!(
            "spec.training.parallelism: data × tensor × pipeline = {ranks}, but spec.workers × slotsPerWorker = {world} ({} × {})",
            job.spec.workers,
            job.slots_per_worker()
        ));
    }
    job.spec.training.validate("spec.training").map_err(|e| e.to_string())
}

/// A rank failed: restart the gang from the newest checkpoint, or fail the job when the
/// worker said its input is bad or the training diverged (exit 2, 3 or 4) or the restarts are
/// used up.
async fn restart_or_fail(
    job: &TrainingJob,
    ctx: &Context,
    pods_api: &Api<Pod>,
    pods: &Pods,
    mut st: TrainingJobStatus,
    old: &TrainingJobStatus,
    cause: FailureCause,
) -> Result<Action> {
    let what = status::describe(&cause);
    let permanent = cause.exit_code.and_then(status::permanent_failure);
    st.failure = Some(cause.clone());
    if permanent.is_some() || st.restart_count >= job.spec.run_policy.backoff_limit {
        let reason = permanent.unwrap_or("BackoffLimitExceeded");
        let message = if permanent.is_some() {
            format!("{what}; not retried (exit code {})", cause.exit_code.unwrap_or_default())
        } else {
            format!("{what}; {} restarts used (spec.runPolicy.backoffLimit)", st.restart_count)
        };
        st.set_phase(JobPhase::Failed, reason, message.clone());
        st.completion_time = Some(status::now());
        st.launcher = pods.launcher.as_ref().map(|p| status::phase(p).to_string());
        publish(ctx, job, EventType::Warning, reason, message).await;
        write_status(ctx, job, &st, old).await?;
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    // Status first: once restartCount moves on, the old pods are stale whatever happens next.
    st.restart_count += 1;
    st.progress = None;
    st.launcher = None;
    let message = format!(
        "{what}; restart {} of {}, from the newest checkpoint",
        st.restart_count, job.spec.run_policy.backoff_limit
    );
    st.set_phase(JobPhase::Restarting, &cause.reason, message.clone());
    publish(ctx, job, EventType::Warning, "Restarting", message).await;
    write_status(ctx, job, &st, old).await?;
    ctx.metrics.restarted();
    delete_pods(pods_api, pods.all(), &pods.lost_nodes).await?;
    Ok(Action::requeue(TERMINATING_PERIOD))
}

/// The API server refused a pod (an admission rule, a missing PriorityClass, a quota): say so
/// in the job's status and events, and try again later; other errors go to error_policy.
async fn refused(
    job: &TrainingJob,
    ctx: &Context,
    mut st: TrainingJobStatus,
    old: &TrainingJobStatus,
    e: Error,
) -> Result<Action> {
    let Error::Kube(kube::Error::Api(status)) = &e else { return Err(e) };
    if !matches!(status.code, 400 | 403 | 422) {
        return Err(e);
    }
    let message = format!("the API server refused a pod: {}", status.message);
    st.set_phase(st.phase.unwrap_or(JobPhase::Created), "PodCreationRefused", message.clone());
    publish(ctx, job, EventType::Warning, "PodCreationRefused", message).await;
    write_status(ctx, job, &st, old).await?;
    Ok(Action::requeue(Duration::from_secs(15)))
}

/// A finished job: delete pods as cleanPodPolicy says, then the job itself after its TTL.
async fn finish(
    job: &TrainingJob,
    ctx: &Context,
    pods_api: &Api<Pod>,
    pods: &Pods,
    st: TrainingJobStatus,
    old: &TrainingJobStatus,
) -> Result<Action> {
    let doomed: Vec<&Pod> = match job.spec.run_policy.clean_pod_policy {
        CleanPodPolicy::None => Vec::new(),
        CleanPodPolicy::All => pods.all().collect(),
        CleanPodPolicy::Running => pods.all().filter(|p| matches!(status::phase(p), "Running" | "Pending")).collect(),
    };
    delete_pods(pods_api, doomed.into_iter(), &pods.lost_nodes).await?;
    if st != *old {
        write_status(ctx, job, &st, old).await?;
    }
    let (Some(ttl), Some(done)) = (job.spec.run_policy.ttl_seconds_after_finished, st.completion_time.as_ref()) else {
        return Ok(Action::await_change());
    };
    let elapsed = status::now().0.duration_since(done.0).as_secs_f64();
    if elapsed >= ttl as f64 {
        let jobs: Api<TrainingJob> = Api::namespaced(ctx.client.clone(), &names::namespace(job));
        let dp = DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..DeleteParams::default() };
        match jobs.delete(&job.name_any(), &dp).await {
            Ok(_) => {
                tracing::info!(job = %job.name_any(), "deleted {ttl} s after it finished (ttlSecondsAfterFinished)")
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(Action::await_change());
    }
    Ok(Action::requeue(Duration::from_secs_f64(ttl as f64 - elapsed + 0.5)))
}

/// Server-side applies the ConfigMap, Service, PodGroup; creates the Secret and the claim once.
async fn apply_children(job: &TrainingJob, ctx: &Context, launcher_exists: bool) -> Result<()> {
    let ns = names::namespace(job);
    let client = &ctx.client;
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    let config = resources::config::config_map(job).map_err(|e| Error::Build(format!("train.yaml: {e}")))?;
    Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .patch(&names::config_map(job), &pp, &Patch::Apply(&config))
        .await?;
    Api::<Service>::namespaced(client.clone(), &ns)
        .patch(&names::service(job), &pp, &Patch::Apply(&resources::service::service(job)))
        .await?;
    // Keys are made once: re-applying a fresh pair would lock running ranks out of each other.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    if secrets.get_opt(&names::ssh_secret(job)).await?.is_none() {
        let secret = resources::ssh::secret(job).map_err(|e| Error::Build(format!("ssh keys: {e}")))?;
        create_if_absent(&secrets, &secret).await?;
    }
    // Claims are immutable after binding; create once, never resize behind the user's back.
    if let Some(claim) = resources::storage::claim(job) {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
        if claims.get_opt(&names::claim(job)).await?.is_none() {
            create_if_absent(&claims, &claim).await?;
        }
    }
    let members = job.spec.workers + i32::from(launcher_exists);
    if let (Some(group), Some(ar)) =
        (resources::podgroup::pod_group(job, members), resources::podgroup::api_resource(job.spec.scheduling.gang))
    {
        let groups: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), &ns, &ar);
        groups.patch(&names::pod_group(job), &pp, &Patch::Apply(&group)).await.map_err(|e| match e {
            kube::Error::Api(s) if s.code == 404 => Error::Build(format!(
                "PodGroup {}/{} is not served by this cluster: install the gang scheduler or set spec.scheduling.gang: None",
                ar.group, ar.version
            )),
            e => Error::Kube(e),
        })?;
    }
    Ok(())
}

/// The job's NetworkPolicy, applied while spec.networkPolicy.enabled; deleted once it is turned
/// off, only if status says one was made (no call for the jobs that never had one).
async fn apply_network_policy(job: &TrainingJob, ctx: &Context, st: &mut TrainingJobStatus) -> Result<()> {
    let policies: Api<NetworkPolicy> = Api::namespaced(ctx.client.clone(), &names::namespace(job));
    let name = names::network_policy(job);
    match resources::network_policy::network_policy(job, ctx.operator_pods.as_ref()) {
        Some(policy) => {
            policies.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&policy)).await?;
            st.network_policy = Some(name);
        }
        None if st.network_policy.is_some() => {
            match policies.delete(&name, &DeleteParams::default()).await {
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                other => drop(other?),
            }
            st.network_policy = None;
        }
        None => {}
    }
    Ok(())
}

async fn create_if_absent<K>(api: &Api<K>, object: &K) -> Result<()>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let pp = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..PostParams::default() };
    match api.create(&pp, object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Pods are created, not applied: a pod of an old attempt that is still terminating must make
/// this fail (AlreadyExists) rather than be adopted and relabelled as the new one.
async fn create_pod(api: &Api<Pod>, pod: Pod) -> Result<()> {
    let pp = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..PostParams::default() };
    match api.create(&pp, &pod).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            tracing::debug!(pod = ?pod.metadata.name, "exists already (terminating or created by an earlier pass)");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

async fn delete_pods<'a>(
    api: &Api<Pod>,
    pods: impl Iterator<Item = &'a Pod>,
    lost_nodes: &BTreeMap<String, String>,
) -> Result<()> {
    for pod in pods {
        // A lost node's kubelet will never confirm a pod's end: such pods are removed at once
        // (what `kubectl delete --force --grace-period=0` does), so that their names are free.
        let on_lost_node = status::node_of(pod).is_some_and(|n| lost_nodes.contains_key(n));
        if pod.metadata.deletion_timestamp.is_some() && !on_lost_node {
            continue;
        }
        let dp = DeleteParams { grace_period_seconds: on_lost_node.then_some(0), ..DeleteParams::default() };
        match api.delete(&pod.name_any(), &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads rank 0's progress: rank 0 runs in the first worker pod (the hostfile's first line).
async fn read_progress(job: &TrainingJob, pods: &Pods, st: &mut TrainingJobStatus) {
    let Some(ip) = pods.worker(&names::worker(job, 0)).and_then(|p| p.status.as_ref()).and_then(|s| s.pod_ip.clone())
    else {
        return;
    };
    match progress::fetch(&ip, job.spec.progress_port as u16).await {
        Ok(report) => {
            st.progress = Some(report.progress());
            if report.latest_checkpoint.is_some() {
                st.latest_checkpoint = report.latest_checkpoint.clone();
            }
        }
        Err(e) => tracing::debug!(job = %job.name_any(), "no progress from rank 0: {e}"),
    }
}

/// Writes the status with server-side apply, preconditioned on the resourceVersion we read.
async fn write_status(ctx: &Context, job: &TrainingJob, st: &TrainingJobStatus, old: &TrainingJobStatus) -> Result<()> {
    if st == old {
        return Ok(());
    }
    let api: Api<TrainingJob> = Api::namespaced(ctx.client.clone(), &names::namespace(job));
    let patch = json!({
        "apiVersion": "tensorfleet.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": { "name": job.name_any(), "resourceVersion": job.resource_version() },
        "status": st,
    });
    api.patch_status(&job.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
    if st.phase != old.phase {
        let phase = st.phase.map_or("", JobPhase::as_str);
        tracing::info!(job = %job.name_any(), namespace = %names::namespace(job), phase, "phase changed");
    }
    Ok(())
}

async fn publish(ctx: &Context, job: &TrainingJob, type_: EventType, reason: &str, note: String) {
    let event = Event { type_, reason: reason.into(), note: Some(note), action: "Reconcile".into(), secondary: None };
    if let Err(e) = ctx.recorder.publish(&event, &job.object_ref(&())).await {
        tracing::debug!(job = %job.name_any(), "event not recorded: {e}");
    }
}
