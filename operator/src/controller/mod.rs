//! The reconciler, in three parts: `observe` reads the job's pods (their nodes, rank 0's
//! progress), `decide` turns the job, what was observed and the time into a plan with no I/O,
//! and `apply` carries the plan out through the API. The status is written with the job's
//! resourceVersion as a precondition, so a pass that acted on a stale view fails with a
//! conflict and runs again.

mod apply;
pub mod decide;
pub mod observe;

use crate::crd::TrainingJob;
use crate::metrics::Metrics;
use crate::resources::labels;
use crate::resources::network_policy::OperatorPods;
use crate::status;
use crate::{Error, Result};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::Recorder;
use kube::ResourceExt;
use std::sync::Arc;
use std::time::Duration;

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

/// One pass: observe, decide, apply.
async fn reconcile_job(job: &TrainingJob, ctx: &Context) -> Result<Action> {
    let observed = observe::observe(job, ctx).await?;
    let plan = decide::decide(job, &observed, &status::now());
    apply::apply(job, ctx, plan).await
}
