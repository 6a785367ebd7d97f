//! The reconciler's decisions, apart from the API: from the job, what was observed and the
//! time, the plan of one pass. No I/O here, so every phase transition is a unit test.
//!
//! One pass: finished jobs are cleaned up (cleanPodPolicy, ttlSecondsAfterFinished); suspended
//! jobs lose their pods; a job past its deadline fails; otherwise the children are applied, the
//! pods of the current attempt are checked for failure (a failed rank restarts the whole gang,
//! exit code 2, 3 or 4 fails the job), missing workers are created, and the launcher is created
//! once every worker is ready.

use super::observe::{Observed, Pods};
use crate::crd::{CleanPodPolicy, FailureCause, JobPhase, LauncherCreationPolicy, TrainingJob, TrainingJobStatus};
use crate::progress;
use crate::resources::names;
use crate::status::{self, LauncherFailure};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use std::time::Duration;

/// How often a running job's progress is read.
const PROGRESS_PERIOD: Duration = Duration::from_secs(10);
/// How soon to look again while pods of an old attempt are still terminating.
const TERMINATING_PERIOD: Duration = Duration::from_secs(2);
/// How soon to look again after a refused pod.
const REFUSED_PERIOD: Duration = Duration::from_secs(15);

/// One pass's work: the steps in order, the status they lead to, and when to look again.
#[derive(Debug)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// What `Step::WriteStatus` writes (nothing when it equals the status read).
    pub status: TrainingJobStatus,
    pub next: Next,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Server-side apply of the ConfigMap, Service and PodGroup (its members count the launcher
    /// when it exists); the Secret and the claim are created once.
    ApplyChildren {
        launcher_exists: bool,
    },
    /// Apply the job's NetworkPolicy (spec.networkPolicy.enabled).
    ApplyNetworkPolicy,
    /// Delete the NetworkPolicy status names (turned off since).
    DeleteNetworkPolicy,
    DeletePods(Vec<Deletion>),
    /// Create these workers (by index) of the current attempt.
    CreateWorkers(Vec<i32>),
    CreateLauncher,
    /// Record an event on the job.
    Publish(Note),
    /// Write `Plan::status`, preconditioned on the job's resourceVersion that was read, so that a
    /// pass that acted on a stale view fails with a conflict and runs again instead of counting
    /// a restart twice.
    WriteStatus,
    /// Count a gang restart in the operator's metrics.
    CountRestart,
    /// Delete the job itself (ttlSecondsAfterFinished has passed).
    DeleteJob,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Deletion {
    pub pod: String,
    /// At once, without a grace period: the pod's node is lost, so its kubelet will never confirm
    /// the pod's end (what `kubectl delete --force --grace-period=0` does), and its name must free.
    pub force: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Note {
    pub warning: bool,
    pub reason: String,
    pub message: String,
}

/// When the job is looked at again without a change to wake it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Next {
    Requeue(Duration),
    AwaitChange,
}

impl Plan {
    fn new(status: TrainingJobStatus) -> Plan {
        Plan { steps: Vec::new(), status, next: Next::AwaitChange }
    }

    fn publish(&mut self, warning: bool, reason: &str, message: String) {
        self.steps.push(Step::Publish(Note { warning, reason: reason.into(), message }));
    }

    /// Enters `phase` (Failed or Restarting) and records a warning `event` with the message.
    fn enter_warning(&mut self, phase: JobPhase, reason: &str, event: &str, message: String, now: &Time) {
        self.publish(true, event, message.clone());
        self.status.set_phase(phase, reason, message, now);
    }

    /// Deletes these pods, if any.
    fn delete(&mut self, deletions: Vec<Deletion>) {
        if !deletions.is_empty() {
            self.steps.push(Step::DeletePods(deletions));
        }
    }

    /// Ends the pass: the status written, then a look again after `next`.
    fn written(mut self, next: Next) -> Plan {
        self.steps.push(Step::WriteStatus);
        self.next = next;
        self
    }

    /// Fails the job for good.
    fn fail(mut self, reason: &str, message: String, now: &Time) -> Plan {
        self.enter_warning(JobPhase::Failed, reason, reason, message, now);
        self.status.completion_time = Some(now.clone());
        self.written(Next::Requeue(Duration::from_secs(1)))
    }
}

/// The plan for `job`, given what was observed at `now`.
pub fn decide(job: &TrainingJob, observed: &Observed, now: &Time) -> Plan {
    let old = job.status.clone().unwrap_or_default();
    let pods = &observed.pods;
    let mut plan = Plan::new(old);
    if job.metadata.deletion_timestamp.is_some() {
        // Owner references hand the children to the garbage collector.
        return plan;
    }
    plan.status.observed_generation = job.metadata.generation;
    if plan.status.is_finished() {
        return finish(job, pods, plan, now);
    }
    if plan.status.phase.is_none() {
        plan.status.set_phase(JobPhase::Created, "JobCreated", "the operator accepted the job".into(), now);
        plan.publish(false, "Created", "creating children".into());
    }
    if let Err(message) = check_spec(job) {
        return plan.fail("InvalidSpec", message, now);
    }
    if job.spec.run_policy.suspend {
        return suspend(job, pods, plan, now);
    }
    if plan.status.phase == Some(JobPhase::Suspended) {
        let message = "spec.runPolicy.suspend is false: pods come back".to_string();
        plan.status.set_phase(JobPhase::Created, "JobResumed", message, now);
        plan.publish(false, "Resumed", "recreating pods".into());
    }
    let active_since = plan.status.active_since.get_or_insert_with(|| now.clone()).clone();
    let active = now.0.duration_since(active_since.0).as_secs();
    if let Some(deadline) = job.spec.run_policy.active_deadline_seconds.filter(|d| active >= *d) {
        let message = format!("active for {active} s, longer than spec.runPolicy.activeDeadlineSeconds ({deadline})");
        let cause = FailureCause { reason: "DeadlineExceeded".into(), message: message.clone(), ..Default::default() };
        plan.status.failure = Some(cause);
        return plan.fail("DeadlineExceeded", message, now);
    }

    plan.steps.push(Step::ApplyChildren { launcher_exists: pods.launcher.is_some() });
    network_policy(job, &mut plan);
    if let Some(launcher) = &pods.launcher {
        if status::succeeded(launcher) {
            return succeeded(plan, now);
        }
        match status::launcher_failure(launcher, &pods.workers, now) {
            Some(LauncherFailure::Cause(cause)) => return restart_or_fail(job, pods, plan, cause, now),
            // What the pass changed so far waits for that look too.
            Some(LauncherFailure::WaitForWorkers(seconds)) => {
                plan.next = Next::Requeue(Duration::from_secs(seconds));
                return plan;
            }
            None => {}
        }
    }
    if let Some(cause) = gang_failure(job, pods) {
        return restart_or_fail(job, pods, plan, cause, now);
    }
    run(job, observed, plan, active, now)
}

/// Checks what the CRD's schema and CEL rules cannot: the world size when slotsPerWorker comes
/// from the GPU limit, and the training configuration's own rules.
fn check_spec(job: &TrainingJob) -> Result<(), String> {
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

/// spec.runPolicy.suspend: every pod goes; the deadline counts active time only, so its clock
/// starts again on resume.
fn suspend(job: &TrainingJob, pods: &Pods, mut plan: Plan, now: &Time) -> Plan {
    plan.delete(deletions(pods.all(), pods));
    if plan.status.phase != Some(JobPhase::Suspended) {
        let message = "spec.runPolicy.suspend is true: pods deleted".to_string();
        plan.status.set_phase(JobPhase::Suspended, "JobSuspended", message, now);
        plan.publish(false, "Suspended", "pods deleted".into());
    }
    let st = &mut plan.status;
    st.active_since = None;
    st.workers = Default::default();
    st.workers_summary = Some(format!("0/{}", job.spec.workers));
    st.launcher = None;
    plan.written(Next::AwaitChange)
}

/// The job's NetworkPolicy while spec.networkPolicy.enabled; deleted once it is turned off, only
/// if status says one was made (no call for the jobs that never had one).
fn network_policy(job: &TrainingJob, plan: &mut Plan) {
    if job.spec.network_policy.enabled {
        plan.steps.push(Step::ApplyNetworkPolicy);
        plan.status.network_policy = Some(names::network_policy(job));
    } else if plan.status.network_policy.is_some() {
        plan.steps.push(Step::DeleteNetworkPolicy);
        plan.status.network_policy = None;
    }
}

/// mpirun finished with every rank exiting 0.
fn succeeded(mut plan: Plan, now: &Time) -> Plan {
    let message = "mpirun finished: every rank exited 0".to_string();
    plan.status.set_phase(JobPhase::Succeeded, "LauncherSucceeded", message, now);
    plan.status.completion_time = Some(now.clone());
    // Rank 0's endpoint closed with the run, after the last reading: every rank exiting 0 means
    // every step was taken, so the progress is completed rather than left at the last poll
    // (whose loss belonged to an earlier step, so it goes).
    if let Some(p) = plan.status.progress.as_mut() {
        *p = progress::completed(p.total_steps, now.clone());
    }
    plan.status.launcher = Some("Succeeded".into());
    plan.publish(false, "Succeeded", "training finished".into());
    plan.written(Next::Requeue(Duration::from_secs(1)))
}

/// Why the gang must restart though the launcher has not failed: a pod on a lost node (it will
/// not report again; the node's taints keep the scheduler from it), a failed worker, or a worker
/// that vanished while ranks ran on it (it takes mpirun down; restart rather than wait for the
/// launcher to notice).
fn gang_failure(job: &TrainingJob, pods: &Pods) -> Option<FailureCause> {
    if let Some((pod, why)) = pods.on_lost_node() {
        return Some(FailureCause {
            pod: pod.name_any(),
            reason: "NodeLost".into(),
            message: why.clone(),
            ..Default::default()
        });
    }
    if let Some(cause) = pods.workers.iter().find_map(|pod| status::failure(pod, true)) {
        return Some(cause);
    }
    if pods.launcher.is_some() && pods.workers.len() < job.spec.workers as usize {
        let missing = (0..job.spec.workers).map(|i| names::worker(job, i)).find(|n| pods.worker(n).is_none());
        return Some(FailureCause {
            pod: missing.unwrap_or_default(),
            reason: "PodDeleted".into(),
            message: "a worker pod was deleted while training ran".into(),
            ..Default::default()
        });
    }
    None
}

/// A rank failed: restart the gang from the newest checkpoint, or fail the job when the worker
/// said its input is bad or the training diverged (exit 2, 3 or 4) or the restarts are used up.
fn restart_or_fail(job: &TrainingJob, pods: &Pods, mut plan: Plan, cause: FailureCause, now: &Time) -> Plan {
    let what = status::describe(&cause);
    let permanent = cause.exit_code.and_then(status::permanent_failure);
    let code = cause.exit_code.unwrap_or_default();
    let st = &mut plan.status;
    st.failure = Some(cause.clone());
    if let Some(reason) = permanent {
        st.launcher = pods.launcher.as_ref().map(|p| status::phase(p).to_string());
        return plan.fail(reason, format!("{what}; not retried (exit code {code})"), now);
    }
    if st.restart_count >= job.spec.run_policy.backoff_limit {
        st.launcher = pods.launcher.as_ref().map(|p| status::phase(p).to_string());
        let message = format!("{what}; {} restarts used (spec.runPolicy.backoffLimit)", st.restart_count);
        return plan.fail("BackoffLimitExceeded", message, now);
    }
    // Status first: once restartCount moves on, the old pods are stale whatever happens next.
    st.restart_count += 1;
    st.progress = None;
    st.launcher = None;
    let message = format!(
        "{what}; restart {} of {}, from the newest checkpoint",
        st.restart_count, job.spec.run_policy.backoff_limit
    );
    plan.enter_warning(JobPhase::Restarting, &cause.reason, "Restarting", message, now);
    let mut plan = plan.written(Next::Requeue(TERMINATING_PERIOD));
    plan.steps.push(Step::CountRestart);
    plan.delete(deletions(pods.all(), pods));
    plan
}

/// A healthy attempt: stale pods go, missing workers come, the launcher once the workers are
/// ready (or at once, by spec.mpi.launcherCreationPolicy), progress while it runs.
fn run(job: &TrainingJob, observed: &Observed, mut plan: Plan, active: i64, now: &Time) -> Plan {
    let pods = &observed.pods;
    // Pods of an old attempt hold the names the new ones need.
    let waiting_for_stale = !pods.stale.is_empty();
    plan.delete(deletions(pods.stale.iter(), pods));
    let missing: Vec<i32> = if waiting_for_stale {
        Vec::new()
    } else {
        (0..job.spec.workers).filter(|i| pods.worker(&names::worker(job, *i)).is_none()).collect()
    };
    if !missing.is_empty() {
        plan.steps.push(Step::CreateWorkers(missing.clone()));
    }
    let ready = pods.workers.iter().filter(|p| status::is_ready(p)).count() as i32;
    let st = &mut plan.status;
    st.workers.active = pods.workers.len() as i32 + missing.len() as i32;
    st.workers.ready = ready;
    st.workers.failed = 0;
    st.workers_summary = Some(format!("{ready}/{}", job.spec.workers));

    let at_startup = job.spec.mpi.launcher_creation_policy == LauncherCreationPolicy::AtStartup;
    if pods.launcher.is_none() && !waiting_for_stale && (ready == job.spec.workers || at_startup) {
        plan.steps.push(Step::CreateLauncher);
        plan.publish(false, "LauncherCreated", format!("{ready} workers ready: starting mpirun"));
    }
    plan.status.launcher = pods.launcher.as_ref().map(|p| status::phase(p).to_string());

    let running = pods.launcher.as_ref().is_some_and(|p| status::phase(p) == "Running");
    if running {
        if plan.status.phase != Some(JobPhase::Running) {
            let message = format!("mpirun runs {} ranks", job.world_size());
            plan.status.set_phase(JobPhase::Running, "LauncherRunning", message, now);
            plan.publish(false, "Running", "mpirun started".into());
        }
        plan.status.start_time.get_or_insert_with(|| now.clone());
        if let Some(report) = &observed.progress {
            plan.status.progress = Some(progress::status(report, now.clone()));
            if report.latest_checkpoint.is_some() {
                plan.status.latest_checkpoint = report.latest_checkpoint.clone();
            }
        }
    } else if plan.status.phase == Some(JobPhase::Running) {
        // The launcher is gone without an outcome (deleted by hand): the gang starts over.
        let message = "waiting for workers to start the launcher again".to_string();
        plan.status.set_phase(JobPhase::Created, "LauncherRecreated", message, now);
    } else if let Some(problem) = pods.workers.iter().chain(pods.launcher.iter()).find_map(status::image_problem) {
        // The job waits, as the kubelet retries; its condition says for what, once.
        let phase = plan.status.phase.unwrap_or(JobPhase::Created);
        if plan.status.condition(phase).is_none_or(|c| c.message != problem) {
            plan.publish(true, "ImageUnavailable", problem.clone());
            plan.status.set_phase(phase, "ImageUnavailable", problem, now);
        }
    }

    let mut next = if running { PROGRESS_PERIOD } else { Duration::from_secs(60) };
    if waiting_for_stale {
        next = TERMINATING_PERIOD;
    } else {
        if let Some(left) = pods.next_node_check {
            next = next.min(Duration::from_secs(left + 1));
        }
        if let Some(deadline) = job.spec.run_policy.active_deadline_seconds {
            next = next.min(Duration::from_secs_f64((deadline as f64 - active as f64).max(0.0) + 0.5));
        }
    }
    plan.written(Next::Requeue(next))
}

/// A finished job: pods deleted as cleanPodPolicy says, then the job itself after its TTL.
fn finish(job: &TrainingJob, pods: &Pods, mut plan: Plan, now: &Time) -> Plan {
    let doomed: Vec<&Pod> = match job.spec.run_policy.clean_pod_policy {
        CleanPodPolicy::None => Vec::new(),
        CleanPodPolicy::All => pods.all().collect(),
        CleanPodPolicy::Running => pods.all().filter(|p| matches!(status::phase(p), "Running" | "Pending")).collect(),
    };
    plan.delete(deletions(doomed.into_iter(), pods));
    plan.steps.push(Step::WriteStatus);
    let (Some(ttl), Some(done)) =
        (job.spec.run_policy.ttl_seconds_after_finished, plan.status.completion_time.as_ref())
    else {
        return plan;
    };
    let elapsed = now.0.duration_since(done.0).as_secs_f64();
    if elapsed >= ttl as f64 {
        plan.steps.push(Step::DeleteJob);
    } else {
        plan.next = Next::Requeue(Duration::from_secs_f64(ttl as f64 - elapsed + 0.5));
    }
    plan
}

/// The API server refused a pod of `plan` (an admission rule, a missing PriorityClass, a quota):
/// the job says so in its status and events, and tries again later. `not_created` pods of those
/// the plan counted as active were not made.
pub fn refused(mut plan: Plan, message: String, not_created: i32, now: &Time) -> Plan {
    let message = format!("the API server refused a pod: {message}");
    plan.steps.clear();
    plan.status.workers.active -= not_created;
    let phase = plan.status.phase.unwrap_or(JobPhase::Created);
    plan.publish(true, "PodCreationRefused", message.clone());
    plan.status.set_phase(phase, "PodCreationRefused", message, now);
    plan.written(Next::Requeue(REFUSED_PERIOD))
}

/// The deletions of `doomed` pods: those already terminating are left to it, unless their node
/// is lost.
fn deletions<'a>(doomed: impl Iterator<Item = &'a Pod>, pods: &Pods) -> Vec<Deletion> {
    doomed
        .filter_map(|pod| {
            let force = status::node_of(pod).is_some_and(|n| pods.lost_nodes.contains_key(n));
            (pod.metadata.deletion_timestamp.is_none() || force).then(|| Deletion { pod: pod.name_any(), force })
        })
        .collect()
}

#[cfg(test)]
mod tests;
