//! Every phase transition of `decide`, from pods as the API server returns them.

use super::*;
use crate::resources::{pods as children, tests::job};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, PodCondition, PodStatus,
};
use k8s_openapi::jiff::Timestamp;

/// `seconds` after a fixed instant, so that durations in the tests are exact.
fn at(seconds: i64) -> Time {
    Time(Timestamp::from_second(1_800_000_000 + seconds).expect("a valid instant"))
}

fn with_status(pod: &mut Pod, phase: &str, ready: bool) {
    let status = pod.status.get_or_insert_with(PodStatus::default);
    status.phase = Some(phase.into());
    status.pod_ip = Some("10.244.0.7".into());
    status.conditions = Some(vec![PodCondition {
        type_: "Ready".into(),
        status: if ready { "True" } else { "False" }.into(),
        ..PodCondition::default()
    }]);
    pod.spec.as_mut().unwrap().node_name = Some("node-a".into());
}

fn container(pod: &mut Pod, state: ContainerState) {
    let name = pod.spec.as_ref().unwrap().containers[0].name.clone();
    let status =
        ContainerStatus { name, image: "tensorfleet/worker:test".into(), state: Some(state), ..Default::default() };
    pod.status.get_or_insert_with(PodStatus::default).container_statuses = Some(vec![status]);
}

/// Worker `i` of `attempt`, Running and Ready.
fn ready_worker(job: &TrainingJob, i: i32, attempt: i32) -> Pod {
    let mut pod = children::worker(job, i, attempt);
    with_status(&mut pod, "Running", true);
    pod
}

fn running_launcher(job: &TrainingJob, attempt: i32) -> Pod {
    let mut pod = children::launcher(job, attempt);
    with_status(&mut pod, "Running", false);
    pod
}

/// A pod whose container exited with `code` at `finished`.
fn exited(mut pod: Pod, code: i32, reason: &str, finished: Time) -> Pod {
    with_status(&mut pod, if code == 0 { "Succeeded" } else { "Failed" }, false);
    let terminated = ContainerStateTerminated {
        exit_code: code,
        reason: Some(reason.into()),
        finished_at: Some(finished),
        ..Default::default()
    };
    container(&mut pod, ContainerState { terminated: Some(terminated), ..Default::default() });
    pod
}

fn observed(job: &TrainingJob, pods: Vec<Pod>) -> Observed {
    let attempt = job.status.as_ref().map_or(0, |s| s.restart_count);
    Observed { pods: Pods::split(pods, attempt), progress: None }
}

/// The job after `plan`'s status was written.
fn after(mut job: TrainingJob, plan: &Plan) -> TrainingJob {
    job.status = Some(plan.status.clone());
    job
}

/// A job with both workers ready and mpirun running, as the first pass left it.
fn running_job() -> (TrainingJob, Vec<Pod>) {
    let job = job("gpt", 2);
    let pods = vec![ready_worker(&job, 0, 0), ready_worker(&job, 1, 0), running_launcher(&job, 0)];
    let plan = decide(&job, &observed(&job, pods.clone()), &at(0));
    assert_eq!(plan.status.phase, Some(JobPhase::Running));
    (after(job, &plan), pods)
}

fn reason(plan: &Plan) -> &str {
    let phase = plan.status.phase.expect("a phase");
    &plan.status.condition(phase).expect("the phase's condition").reason
}

fn events(plan: &Plan) -> Vec<&str> {
    plan.steps
        .iter()
        .filter_map(|s| match s {
            Step::Publish(note) => Some(note.reason.as_str()),
            _ => None,
        })
        .collect()
}

fn deleted(plan: &Plan) -> Vec<(String, bool)> {
    plan.steps
        .iter()
        .flat_map(|s| match s {
            Step::DeletePods(d) => d.iter().map(|d| (d.pod.clone(), d.force)).collect(),
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn a_new_job_is_created_with_its_children_and_workers() {
    let job = job("gpt", 2);
    let plan = decide(&job, &observed(&job, Vec::new()), &at(0));
    assert_eq!(plan.status.phase, Some(JobPhase::Created));
    assert_eq!(reason(&plan), "JobCreated");
    assert_eq!(
        plan.steps[1..],
        [Step::ApplyChildren { launcher_exists: false }, Step::CreateWorkers(vec![0, 1]), Step::WriteStatus]
    );
    assert_eq!(events(&plan), ["Created"]);
    assert_eq!((plan.status.workers.active, plan.status.workers.ready), (2, 0));
    assert_eq!(plan.status.active_since, Some(at(0)));
    assert_eq!(plan.next, Next::Requeue(Duration::from_secs(60)));
}

#[test]
fn a_world_size_that_the_parallelism_does_not_fill_fails_the_job() {
    let job = job("gpt", 3);
    let plan = decide(&job, &observed(&job, Vec::new()), &at(0));
    assert_eq!(plan.status.phase, Some(JobPhase::Failed));
    assert_eq!(reason(&plan), "InvalidSpec");
    let message = &plan.status.condition(JobPhase::Failed).unwrap().message;
    assert!(message.contains("spec.training.parallelism") && message.contains("= 3"), "{message}");
    assert!(!plan.steps.iter().any(|s| matches!(s, Step::ApplyChildren { .. } | Step::CreateWorkers(_))));
    assert_eq!(plan.status.completion_time, Some(at(0)));
}

#[test]
fn workers_ready_start_the_launcher_and_its_running_makes_the_job_running() {
    let job = after(job("gpt", 2), &decide(&job("gpt", 2), &observed(&job("gpt", 2), Vec::new()), &at(0)));
    let mut waiting = vec![ready_worker(&job, 0, 0), children::worker(&job, 1, 0)];
    with_status(&mut waiting[1], "Running", false);
    let plan = decide(&job, &observed(&job, waiting.clone()), &at(1));
    assert!(!plan.steps.contains(&Step::CreateLauncher), "one worker is not ready");
    assert_eq!(plan.status.workers_summary.as_deref(), Some("1/2"));

    let mut at_startup = job.clone();
    at_startup.spec.mpi.launcher_creation_policy = LauncherCreationPolicy::AtStartup;
    assert!(decide(&at_startup, &observed(&job, waiting), &at(1)).steps.contains(&Step::CreateLauncher));

    let ready = vec![ready_worker(&job, 0, 0), ready_worker(&job, 1, 0)];
    let plan = decide(&job, &observed(&job, ready.clone()), &at(2));
    assert!(plan.steps.contains(&Step::CreateLauncher));
    assert_eq!(events(&plan), ["LauncherCreated"]);
    assert_eq!(plan.status.phase, Some(JobPhase::Created));

    let job = after(job, &plan);
    let mut pods = ready;
    pods.push(running_launcher(&job, 0));
    let mut seen = observed(&job, pods);
    seen.progress = Some(progress::Report {
        step: 50,
        total_steps: 200,
        loss: Some(3.25),
        latest_checkpoint: Some("/ckpt/step-40".into()),
        ..Default::default()
    });
    let plan = decide(&job, &seen, &at(3));
    assert_eq!(plan.status.phase, Some(JobPhase::Running));
    assert_eq!(reason(&plan), "LauncherRunning");
    assert_eq!(events(&plan), ["Running"]);
    assert_eq!(plan.status.start_time, Some(at(3)));
    let progress = plan.status.progress.as_ref().unwrap();
    assert_eq!((progress.step, progress.observed_at.clone()), (50, Some(at(3))));
    assert_eq!(plan.status.latest_checkpoint.as_deref(), Some("/ckpt/step-40"));
    assert_eq!(plan.status.launcher.as_deref(), Some("Running"));
    assert_eq!(plan.next, Next::Requeue(PROGRESS_PERIOD));
}

#[test]
fn a_pass_over_an_unchanged_job_changes_nothing() {
    let (job, pods) = running_job();
    let plan = decide(&job, &observed(&job, pods), &at(5));
    assert_eq!(Some(&plan.status), job.status.as_ref());
    assert!(events(&plan).is_empty());
    assert!(!plan
        .steps
        .iter()
        .any(|s| matches!(s, Step::CreateWorkers(_) | Step::CreateLauncher | Step::DeletePods(_))));
}

#[test]
fn mpirun_exiting_0_succeeds_the_job_with_its_progress_completed() {
    let (mut job, mut pods) = running_job();
    job.status.as_mut().unwrap().progress = Some(progress::completed(200, at(1)));
    job.status.as_mut().unwrap().progress.as_mut().unwrap().step = 190;
    pods[2] = exited(pods[2].clone(), 0, "Completed", at(8));
    let plan = decide(&job, &observed(&job, pods), &at(9));
    assert_eq!(plan.status.phase, Some(JobPhase::Succeeded));
    assert_eq!(plan.status.completion_time, Some(at(9)));
    assert_eq!(plan.status.progress.as_ref().map(|p| p.step), Some(200));
    assert_eq!(plan.status.launcher.as_deref(), Some("Succeeded"));
    assert_eq!(events(&plan), ["Succeeded"]);
}

#[test]
fn a_failed_launcher_waits_for_the_workers_then_restarts_the_gang() {
    let (job, mut pods) = running_job();
    pods[2] = exited(pods[2].clone(), 1, "Error", at(10));
    let plan = decide(&job, &observed(&job, pods.clone()), &at(12));
    assert_eq!(plan.next, Next::Requeue(Duration::from_secs(3)));
    assert!(!plan.steps.contains(&Step::WriteStatus), "nothing decided yet");

    let plan = decide(&job, &observed(&job, pods), &at(15));
    assert_eq!(plan.status.phase, Some(JobPhase::Restarting));
    assert_eq!(plan.status.restart_count, 1);
    assert_eq!(plan.status.failure.as_ref().unwrap().pod, "gpt-launcher");
    assert_eq!((plan.status.progress.clone(), plan.status.launcher.clone()), (None, None));
    assert_eq!(events(&plan), ["Restarting"]);
    let write = plan.steps.iter().position(|s| *s == Step::WriteStatus).unwrap();
    let delete = plan.steps.iter().position(|s| matches!(s, Step::DeletePods(_))).unwrap();
    assert!(write < delete, "restartCount moves on before the old pods go");
    assert!(plan.steps.contains(&Step::CountRestart));
    let gone: Vec<String> = deleted(&plan).into_iter().map(|(pod, _)| pod).collect();
    assert_eq!(gone, ["gpt-worker-0", "gpt-worker-1", "gpt-launcher"]);
    assert_eq!(plan.next, Next::Requeue(TERMINATING_PERIOD));
}

#[test]
fn a_failed_worker_is_the_root_cause_of_a_launcher_failure() {
    let (job, mut pods) = running_job();
    pods[1] = exited(pods[1].clone(), 137, "OOMKilled", at(9));
    pods[2] = exited(pods[2].clone(), 1, "Error", at(10));
    let plan = decide(&job, &observed(&job, pods), &at(10));
    let failure = plan.status.failure.as_ref().unwrap();
    assert_eq!((failure.pod.as_str(), failure.reason.as_str()), ("gpt-worker-1", "OOMKilled"));
    assert_eq!(plan.status.phase, Some(JobPhase::Restarting));
}

#[test]
fn a_failed_worker_restarts_the_gang_while_mpirun_still_runs() {
    let (job, mut pods) = running_job();
    pods[0] = exited(pods[0].clone(), 1, "Error", at(9));
    let plan = decide(&job, &observed(&job, pods), &at(10));
    assert_eq!(plan.status.phase, Some(JobPhase::Restarting));
    assert_eq!(plan.status.failure.as_ref().unwrap().pod, "gpt-worker-0");
}

#[test]
fn exit_codes_2_3_and_4_fail_the_job_without_a_restart() {
    for (code, why) in [(2, "InvalidConfiguration"), (3, "CorruptInput"), (4, "Diverged")] {
        let (job, mut pods) = running_job();
        pods[2] = exited(pods[2].clone(), code, "Error", at(10));
        let plan = decide(&job, &observed(&job, pods), &at(10));
        assert_eq!(plan.status.phase, Some(JobPhase::Failed), "exit {code}");
        assert_eq!(reason(&plan), why);
        assert_eq!(plan.status.restart_count, 0);
        assert!(deleted(&plan).is_empty(), "cleanPodPolicy deletes them once the job is finished");
        assert_eq!(plan.status.launcher.as_deref(), Some("Failed"));
    }
}

#[test]
fn restarts_past_the_backoff_limit_fail_the_job() {
    let (mut job, mut pods) = running_job();
    job.status.as_mut().unwrap().restart_count = 3;
    pods = pods
        .into_iter()
        .map(|mut p| {
            p.metadata.labels.as_mut().unwrap().insert(crate::resources::labels::ATTEMPT.into(), "3".into());
            p
        })
        .collect();
    pods[2] = exited(pods[2].clone(), 1, "Error", at(0));
    let plan = decide(&job, &observed(&job, pods), &at(60));
    assert_eq!(plan.status.phase, Some(JobPhase::Failed));
    assert_eq!(reason(&plan), "BackoffLimitExceeded");
    assert_eq!(plan.status.restart_count, 3);
}

#[test]
fn a_lost_node_restarts_the_gang_and_its_pods_are_deleted_by_force() {
    let (job, pods) = running_job();
    let mut seen = observed(&job, pods);
    seen.pods.lost_nodes.insert("node-a".into(), "node node-a is gone from the API".into());
    let plan = decide(&job, &seen, &at(10));
    assert_eq!(plan.status.failure.as_ref().unwrap().reason, "NodeLost");
    assert!(deleted(&plan).iter().all(|(_, force)| *force));
    assert_eq!(deleted(&plan).len(), 3);
}

#[test]
fn a_worker_deleted_while_mpirun_runs_restarts_the_gang() {
    let (job, mut pods) = running_job();
    pods.remove(1);
    let plan = decide(&job, &observed(&job, pods), &at(10));
    let failure = plan.status.failure.as_ref().unwrap();
    assert_eq!((failure.pod.as_str(), failure.reason.as_str()), ("gpt-worker-1", "PodDeleted"));
}

#[test]
fn a_launcher_deleted_by_hand_sends_the_job_back_to_created() {
    let (job, mut pods) = running_job();
    pods.pop();
    let plan = decide(&job, &observed(&job, pods), &at(10));
    assert_eq!(plan.status.phase, Some(JobPhase::Created));
    assert_eq!(reason(&plan), "LauncherRecreated");
    assert!(plan.steps.contains(&Step::CreateLauncher));
}

#[test]
fn pods_of_the_old_attempt_must_be_gone_before_new_ones_come() {
    let (mut job, pods) = running_job();
    job.status.as_mut().unwrap().restart_count = 1;
    job.status.as_mut().unwrap().set_phase(JobPhase::Restarting, "Error", "restart 1".into(), &at(10));
    let mut terminating = pods[0].clone();
    terminating.metadata.deletion_timestamp = Some(at(10));
    let plan = decide(&job, &observed(&job, vec![terminating, pods[1].clone()]), &at(11));
    assert_eq!(deleted(&plan), [("gpt-worker-1".to_string(), false)], "the terminating pod is left to end");
    assert!(!plan.steps.iter().any(|s| matches!(s, Step::CreateWorkers(_) | Step::CreateLauncher)));
    assert_eq!(plan.next, Next::Requeue(TERMINATING_PERIOD));

    let plan = decide(&job, &observed(&job, Vec::new()), &at(12));
    assert!(plan.steps.contains(&Step::CreateWorkers(vec![0, 1])));
}

#[test]
fn a_missing_image_is_said_once_and_the_job_waits() {
    let job = job("gpt", 2);
    let job = after(job.clone(), &decide(&job, &observed(&job, Vec::new()), &at(0)));
    let mut pod = children::worker(&job, 0, 0);
    with_status(&mut pod, "Pending", false);
    let waiting = ContainerStateWaiting { reason: Some("ErrImageNeverPull".into()), message: Some("not here".into()) };
    container(&mut pod, ContainerState { waiting: Some(waiting), ..Default::default() });
    let pods = vec![pod, children::worker(&job, 1, 0)];
    let plan = decide(&job, &observed(&job, pods.clone()), &at(1));
    assert_eq!(events(&plan), ["ImageUnavailable"]);
    assert_eq!(reason(&plan), "ImageUnavailable");
    assert_eq!(plan.status.phase, Some(JobPhase::Created));
    let job = after(job, &plan);
    let again = decide(&job, &observed(&job, pods), &at(2));
    assert!(events(&again).is_empty(), "said once");
}

#[test]
fn suspending_deletes_the_pods_and_resuming_brings_them_back() {
    let (mut job, pods) = running_job();
    job.spec.run_policy.suspend = true;
    let plan = decide(&job, &observed(&job, pods), &at(10));
    assert_eq!(plan.status.phase, Some(JobPhase::Suspended));
    assert_eq!(deleted(&plan).len(), 3);
    assert_eq!((plan.status.active_since.clone(), plan.status.launcher.clone()), (None, None));
    assert_eq!(plan.next, Next::AwaitChange);

    let mut job = after(job, &plan);
    job.spec.run_policy.suspend = false;
    let plan = decide(&job, &observed(&job, Vec::new()), &at(100));
    assert_eq!(plan.status.phase, Some(JobPhase::Created));
    assert_eq!(reason(&plan), "JobResumed");
    assert_eq!(plan.status.active_since, Some(at(100)), "the deadline counts active time only");
    assert!(plan.steps.contains(&Step::CreateWorkers(vec![0, 1])));
}

#[test]
fn the_active_deadline_fails_the_job_and_is_looked_at_in_time() {
    let (mut job, pods) = running_job();
    job.spec.run_policy.active_deadline_seconds = Some(30);
    let plan = decide(&job, &observed(&job, pods.clone()), &at(25));
    assert_eq!(plan.next, Next::Requeue(Duration::from_secs_f64(5.5)));
    let plan = decide(&job, &observed(&job, pods), &at(30));
    assert_eq!(plan.status.phase, Some(JobPhase::Failed));
    assert_eq!(reason(&plan), "DeadlineExceeded");
    assert_eq!(plan.status.failure.as_ref().unwrap().reason, "DeadlineExceeded");
}

#[test]
fn a_finished_job_cleans_its_pods_and_goes_after_its_ttl() {
    let (job, mut pods) = running_job();
    pods[2] = exited(pods[2].clone(), 0, "Completed", at(8));
    let mut job = after(job.clone(), &decide(&job, &observed(&job, pods.clone()), &at(10)));
    job.spec.run_policy.ttl_seconds_after_finished = Some(30);
    let plan = decide(&job, &observed(&job, pods.clone()), &at(20));
    let gone: Vec<String> = deleted(&plan).into_iter().map(|(pod, _)| pod).collect();
    assert_eq!(gone, ["gpt-worker-0", "gpt-worker-1"], "cleanPodPolicy Running keeps the finished launcher");
    assert_eq!(plan.next, Next::Requeue(Duration::from_secs_f64(20.5)));
    assert!(!plan.steps.contains(&Step::DeleteJob));

    job.spec.run_policy.clean_pod_policy = CleanPodPolicy::None;
    let plan = decide(&job, &observed(&job, pods), &at(40));
    assert!(deleted(&plan).is_empty());
    assert_eq!(plan.steps.last(), Some(&Step::DeleteJob));
}

#[test]
fn a_refused_pod_is_said_and_tried_again_later() {
    let job = job("gpt", 2);
    let plan = decide(&job, &observed(&job, Vec::new()), &at(0));
    let plan = refused(plan, "pods \"gpt-worker-0\" is forbidden: exceeded quota".into(), 2, &at(0));
    assert_eq!(plan.status.workers.active, 0);
    assert_eq!(reason(&plan), "PodCreationRefused");
    assert_eq!(
        plan.steps,
        [
            Step::Publish(Note {
                warning: true,
                reason: "PodCreationRefused".into(),
                message: "the API server refused a pod: pods \"gpt-worker-0\" is forbidden: exceeded quota".into()
            }),
            Step::WriteStatus
        ]
    );
    assert_eq!(plan.next, Next::Requeue(REFUSED_PERIOD));
}

#[test]
fn the_network_policy_follows_the_spec() {
    let (mut job, pods) = running_job();
    job.spec.network_policy.enabled = true;
    let plan = decide(&job, &observed(&job, pods.clone()), &at(5));
    assert!(plan.steps.contains(&Step::ApplyNetworkPolicy));
    assert_eq!(plan.status.network_policy, Some(names::network_policy(&job)));

    let mut job = after(job, &plan);
    job.spec.network_policy.enabled = false;
    let plan = decide(&job, &observed(&job, pods), &at(6));
    assert!(plan.steps.contains(&Step::DeleteNetworkPolicy));
    assert_eq!(plan.status.network_policy, None);
}

#[test]
fn a_job_being_deleted_is_left_to_the_garbage_collector() {
    let (mut job, pods) = running_job();
    job.metadata.deletion_timestamp = Some(at(5));
    let plan = decide(&job, &observed(&job, pods), &at(5));
    assert!(plan.steps.is_empty());
    assert_eq!(plan.next, Next::AwaitChange);
}
