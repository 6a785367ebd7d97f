//! Reading pods into facts (ready, failed and why) and writing them into the job's status:
//! the phase, one condition per phase, and the root cause of a failure.

use crate::crd::{Condition, FailureCause, JobPhase, TrainingJobStatus};
use k8s_openapi::api::core::v1::{ContainerStateTerminated, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

/// The reason a job fails with at once, for the worker exit codes that mean "do not retry"
/// (DESIGN.md: 2 bad configuration or unsupported model, 3 corrupt input, 4 diverged: a restart
/// from the same checkpoint on the same data would diverge again); `None` for the others.
pub fn permanent_failure(exit_code: i32) -> Option<&'static str> {
    match exit_code {
        2 => Some("InvalidConfiguration"),
        3 => Some("CorruptInput"),
        4 => Some("Diverged"),
        _ => None,
    }
}

pub fn now() -> Time {
    Time(Timestamp::now())
}

/// Whether the pod's Ready condition is True.
pub fn is_ready(pod: &Pod) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub fn phase(pod: &Pod) -> &str {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("Pending")
}

/// The first terminated container of the pod, if any container has terminated.
fn terminated(pod: &Pod) -> Option<(String, ContainerStateTerminated)> {
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    statuses.iter().find_map(|cs| {
        let t = cs.state.as_ref()?.terminated.clone()?;
        Some((cs.name.clone(), t))
    })
}

/// Why a pod failed, if it did: its phase is Failed, it was evicted, or a container exited
/// non-zero. A worker container that exits at all has lost its sshd, so any exit fails a worker.
pub fn failure(pod: &Pod, any_exit_fails: bool) -> Option<FailureCause> {
    let status = pod.status.as_ref()?;
    let pod_reason = status.reason.clone().unwrap_or_default();
    let pod_message = status.message.clone().unwrap_or_default();
    let container = terminated(pod);
    let container_failed = container.as_ref().is_some_and(|(_, t)| t.exit_code != 0 || any_exit_fails);
    if phase(pod) != "Failed" && !container_failed && pod_reason != "Evicted" {
        return None;
    }
    let mut cause = FailureCause { pod: pod.name_any(), reason: "Error".into(), ..FailureCause::default() };
    if let Some((name, t)) = container {
        cause.container = Some(name);
        cause.exit_code = Some(t.exit_code);
        cause.reason = t.reason.clone().unwrap_or_else(|| "Error".into());
        cause.message = t.message.clone().unwrap_or_default().trim().to_string();
    }
    // Eviction and node loss are the pod's reason, not the container's.
    if !pod_reason.is_empty() {
        cause.reason = pod_reason;
        if cause.message.is_empty() {
            cause.message = pod_message;
        }
    }
    Some(cause)
}

/// Seconds a retryable launcher failure waits for the workers' statuses (see launcher_failure).
pub const WORKER_SETTLE_SECONDS: i64 = 5;

/// What a failed launcher means for the gang (launcher_failure).
#[derive(Debug, PartialEq)]
pub enum LauncherFailure {
    /// Restart or fail for this cause.
    Cause(FailureCause),
    /// Look again in this many seconds: a worker may yet say why.
    WaitForWorkers(u64),
}

/// Why the gang failed, once the launcher has: mpirun's failure is mostly the echo of a rank
/// that died on a worker, whose pod says why (its container OOM-killed, say) a moment after the
/// launcher's exit is reported. So a failed worker's cause is the root cause and wins, and a
/// launcher failure that would be retried waits until WORKER_SETTLE_SECONDS after the launcher
/// finished for one, so that the restart names it (never longer: `finished_at` is the launcher
/// node's clock, `now` the operator's). `None` while the launcher has not failed.
pub fn launcher_failure(launcher: &Pod, workers: &[Pod], now: &Time) -> Option<LauncherFailure> {
    let cause = failure(launcher, false)?;
    if let Some(worker) = workers.iter().find_map(|w| failure(w, true)) {
        return Some(LauncherFailure::Cause(worker));
    }
    let retried = cause.exit_code.and_then(permanent_failure).is_none();
    let finished = terminated(launcher).and_then(|(_, t)| t.finished_at);
    if let (true, Some(finished)) = (retried, finished) {
        let since = now.0.duration_since(finished.0).as_secs().max(0);
        if since < WORKER_SETTLE_SECONDS {
            return Some(LauncherFailure::WaitForWorkers((WORKER_SETTLE_SECONDS - since) as u64));
        }
    }
    Some(LauncherFailure::Cause(cause))
}

/// The kubelet's reasons for a container that waits because its image cannot be had. It keeps
/// trying (a missing image may be loaded later, a registry may come back), so these do not
/// fail the job; they are what its status says it waits for.
const IMAGE_REASONS: [&str; 4] = ["ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "InvalidImageName"];

/// Why the pod's containers cannot start, if the kubelet says it is their image: the pod, the
/// image, the kubelet's reason and message.
pub fn image_problem(pod: &Pod) -> Option<String> {
    let statuses = pod.status.as_ref()?.container_statuses.as_ref()?;
    statuses.iter().find_map(|cs| {
        let waiting = cs.state.as_ref()?.waiting.as_ref()?;
        let reason = waiting.reason.as_deref().filter(|r| IMAGE_REASONS.contains(r))?;
        let message = waiting.message.as_deref().unwrap_or("").trim();
        Some(format!("pod {} cannot start: image {} ({reason}): {message}", pod.name_any(), cs.image))
    })
}

/// The node a pod was scheduled to.
pub fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_name.as_deref()
}

/// Whether node `name` (as the API has it, `None` when it has none) is lost: gone, or not Ready
/// for at least `after` seconds by `now`; with why. A node not Ready for less is `Err` with the
/// seconds left, so that the caller looks again then.
pub fn node_lost(name: &str, node: Option<&Node>, after: i64, now: &Time) -> Result<Option<String>, u64> {
    let Some(node) = node else { return Ok(Some(format!("node {name} is gone from the API"))) };
    let conditions = node.status.as_ref().and_then(|s| s.conditions.as_ref());
    let ready = conditions.and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    let Some(ready) = ready.filter(|c| c.status != "True") else { return Ok(None) };
    let since = ready.last_transition_time.as_ref().map_or(now.0, |t| t.0);
    let down = now.0.duration_since(since).as_secs();
    if down < after {
        return Err((after - down) as u64);
    }
    let why = ready.message.as_deref().or(ready.reason.as_deref()).unwrap_or("");
    Ok(Some(format!("node {name} not Ready ({}) for {down} s: {why}", ready.status)))
}

/// Whether the launcher finished successfully.
pub fn succeeded(pod: &Pod) -> bool {
    phase(pod) == "Succeeded"
}

/// A one-line description of a cause, for condition messages and events.
pub fn describe(cause: &FailureCause) -> String {
    let mut s = format!("pod {}", cause.pod);
    if let Some(c) = &cause.container {
        s.push_str(&format!(" container {c}"));
    }
    if let Some(code) = cause.exit_code {
        s.push_str(&format!(" exited with code {code}"));
    }
    s.push_str(&format!(" ({})", cause.reason));
    if !cause.message.is_empty() {
        // The termination message is the log's tail; its last line is the worker's error.
        let last = cause.message.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
        s.push_str(&format!(": {}", last.trim()));
    }
    s
}

impl TrainingJobStatus {
    /// Enters `phase`: its condition becomes True with the reason and message, every other
    /// phase condition False. Transition times (`now`) change only when a condition's status does.
    pub fn set_phase(&mut self, phase: JobPhase, reason: &str, message: String, now: &Time) {
        self.phase = Some(phase);
        for p in JobPhase::ALL {
            let status = if p == phase { "True" } else { "False" };
            let existing = self.conditions.iter_mut().find(|c| c.type_ == p.as_str());
            match existing {
                Some(c) => {
                    if c.status != status {
                        c.last_transition_time = Some(now.clone());
                    }
                    c.status = status.into();
                    if p == phase {
                        c.reason = reason.into();
                        c.message = message.clone();
                    }
                }
                // Conditions appear as the job reaches them; Created is there from the start.
                None if p == phase => self.conditions.push(Condition {
                    type_: p.as_str().into(),
                    status: status.into(),
                    reason: reason.into(),
                    message: message.clone(),
                    last_transition_time: Some(now.clone()),
                }),
                None => {}
            }
        }
    }

    pub fn is_finished(&self) -> bool {
        self.phase.is_some_and(JobPhase::is_finished)
    }

    /// The condition of `phase`, once the job has reached it.
    pub fn condition(&self, phase: JobPhase) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == phase.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStatus, PodStatus};

    fn pod_with(phase: &str, exit: Option<(i32, &str)>, reason: Option<&str>) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.name = Some("llm-launcher".into());
        pod.status = Some(PodStatus {
            phase: Some(phase.into()),
            reason: reason.map(Into::into),
            container_statuses: exit.map(|(code, why)| {
                vec![ContainerStatus {
                    name: "launcher".into(),
                    state: Some(ContainerState {
                        terminated: Some(ContainerStateTerminated {
                            exit_code: code,
                            reason: Some(why.into()),
                            message: Some("step 3\nerror: model.onnx: not an ONNX model\n".into()),
                            ..ContainerStateTerminated::default()
                        }),
                        ..ContainerState::default()
                    }),
                    ..ContainerStatus::default()
                }]
            }),
            ..PodStatus::default()
        });
        pod
    }

    #[test]
    fn failure_names_pod_container_code_and_message() {
        let cause = failure(&pod_with("Failed", Some((3, "Error")), None), false).unwrap();
        assert_eq!(cause.exit_code, Some(3));
        assert_eq!(
            describe(&cause),
            "pod llm-launcher container launcher exited with code 3 (Error): error: model.onnx: not an ONNX model"
        );
        let oom = failure(&pod_with("Failed", Some((137, "OOMKilled")), None), false).unwrap();
        assert_eq!(oom.reason, "OOMKilled");
        let evicted = failure(&pod_with("Failed", None, Some("Evicted")), false).unwrap();
        assert_eq!(evicted.reason, "Evicted");
        assert!(failure(&pod_with("Running", None, None), false).is_none());
        assert!(failure(&pod_with("Succeeded", Some((0, "Completed")), None), false).is_none());
        assert!(failure(&pod_with("Running", Some((0, "Completed")), None), true).is_some());
    }

    /// The launcher's pod, failed with `code` at `finished`.
    fn launcher_exited(code: i32, finished: Timestamp) -> Pod {
        let mut pod = pod_with("Failed", Some((code, "Error")), None);
        let statuses = pod.status.as_mut().and_then(|s| s.container_statuses.as_mut()).unwrap();
        statuses[0].state.as_mut().unwrap().terminated.as_mut().unwrap().finished_at = Some(Time(finished));
        pod
    }

    #[test]
    fn a_failed_workers_cause_wins_over_the_launchers_echo_of_it() {
        let finished = Timestamp::from_second(1_000_000).unwrap();
        let at = |s: i64| Time(Timestamp::from_second(1_000_000 + s).unwrap());
        let launcher = launcher_exited(137, finished);
        let mut worker = pod_with("Running", Some((137, "OOMKilled")), None);
        worker.metadata.name = Some("llm-worker-1".into());
        let running = [pod_with("Running", None, None)];

        // Both reported: the worker's cause, at once.
        let cause = |f: Option<LauncherFailure>| match f {
            Some(LauncherFailure::Cause(c)) => c,
            other => panic!("no cause: {other:?}"),
        };
        let first = cause(launcher_failure(&launcher, &[running[0].clone(), worker.clone()], &at(0)));
        assert_eq!((first.pod.as_str(), first.reason.as_str()), ("llm-worker-1", "OOMKilled"));
        // Only the launcher so far: wait for the workers, then take the launcher's.
        assert_eq!(launcher_failure(&launcher, &running, &at(2)), Some(LauncherFailure::WaitForWorkers(3)));
        assert_eq!(cause(launcher_failure(&launcher, &running, &at(WORKER_SETTLE_SECONDS))).pod, "llm-launcher");
        // An operator whose clock is behind the node's waits no longer than the settle time.
        assert_eq!(launcher_failure(&launcher, &running, &at(-60)), Some(LauncherFailure::WaitForWorkers(5)));
        // A failure that is not retried decides at once: the restart it would wait for never comes.
        let permanent = launcher_exited(2, finished);
        assert_eq!(cause(launcher_failure(&permanent, &running, &at(0))).exit_code, Some(2));
        assert!(launcher_failure(&pod_with("Running", None, None), &[worker], &at(0)).is_none());
    }

    #[test]
    fn a_container_waiting_for_its_image_names_the_image_and_the_kubelets_reason() {
        use k8s_openapi::api::core::v1::ContainerStateWaiting;
        let waiting = |reason: &str| {
            let mut pod = pod_with("Pending", None, None);
            pod.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
                name: "launcher".into(),
                image: "tensorfleet/worker:nope".into(),
                state: Some(ContainerState {
                    waiting: Some(ContainerStateWaiting {
                        reason: Some(reason.into()),
                        message: Some("Container image \"tensorfleet/worker:nope\" is not present".into()),
                    }),
                    ..ContainerState::default()
                }),
                ..ContainerStatus::default()
            }]);
            pod
        };
        assert_eq!(
            image_problem(&waiting("ErrImageNeverPull")).unwrap(),
            "pod llm-launcher cannot start: image tensorfleet/worker:nope (ErrImageNeverPull): \
             Container image \"tensorfleet/worker:nope\" is not present"
        );
        assert!(image_problem(&waiting("ImagePullBackOff")).is_some());
        assert!(image_problem(&waiting("ContainerCreating")).is_none());
        assert!(image_problem(&pod_with("Running", None, None)).is_none());
    }

    #[test]
    fn a_node_is_lost_when_gone_or_not_ready_for_the_jobs_seconds() {
        use k8s_openapi::api::core::v1::{NodeCondition, NodeStatus};
        let at = |s: i64| Time(Timestamp::from_second(1_800_000_000 + s).unwrap());
        let node = |status: &str| Node {
            status: Some(NodeStatus {
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: status.into(),
                    reason: Some("NodeStatusUnknown".into()),
                    message: Some("Kubelet stopped posting node status.".into()),
                    last_transition_time: Some(at(0)),
                    ..NodeCondition::default()
                }]),
                ..NodeStatus::default()
            }),
            ..Node::default()
        };
        assert_eq!(node_lost("n", Some(&node("True")), 60, &at(600)), Ok(None));
        assert_eq!(node_lost("n", Some(&node("Unknown")), 60, &at(45)), Err(15));
        assert_eq!(
            node_lost("n", Some(&node("Unknown")), 60, &at(61)),
            Ok(Some("node n not Ready (Unknown) for 61 s: Kubelet stopped posting node status.".into()))
        );
        assert_eq!(node_lost("n", None, 60, &at(0)), Ok(Some("node n is gone from the API".into())));
    }

    #[test]
    fn exit_codes_2_3_and_4_are_not_retried() {
        assert_eq!(permanent_failure(2), Some("InvalidConfiguration"));
        assert_eq!(permanent_failure(3), Some("CorruptInput"));
        assert_eq!(permanent_failure(4), Some("Diverged"));
        for retried in [1, 137, 143, 0] {
            assert_eq!(permanent_failure(retried), None);
        }
    }

    #[test]
    fn set_phase_keeps_one_true_condition() {
        let mut s = TrainingJobStatus::default();
        s.set_phase(JobPhase::Created, "ChildrenCreated", "made".into(), &now());
        s.set_phase(JobPhase::Running, "LauncherRunning", "go".into(), &now());
        assert_eq!(s.condition(JobPhase::Created).unwrap().status, "False");
        assert_eq!(s.condition(JobPhase::Running).unwrap().status, "True");
        assert!(s.condition(JobPhase::Failed).is_none());
        s.set_phase(JobPhase::Failed, "BackoffLimitExceeded", "x".into(), &now());
        assert_eq!(s.conditions.iter().filter(|c| c.status == "True").count(), 1);
    }
}
