//! What one pass reads before deciding: the job's pods split by role and attempt, the lost
//! nodes under them, and rank 0's progress while mpirun runs.

use super::Context;
use crate::crd::TrainingJob;
use crate::progress;
use crate::resources::{labels, names};
use crate::status;
use crate::Result;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::ResourceExt;
use std::collections::{BTreeMap, BTreeSet};

/// Everything `decide` needs besides the job and the time.
pub struct Observed {
    pub pods: Pods,
    /// Rank 0's report, read only while the launcher runs (and `None` when it did not answer).
    pub progress: Option<progress::Report>,
}

/// The pods of one job, split by role and attempt, and the lost nodes under them.
#[derive(Default)]
pub struct Pods {
    pub workers: Vec<Pod>,
    pub launcher: Option<Pod>,
    /// Pods of earlier attempts (or marked for deletion): they must be gone before new pods
    /// with the same names are created.
    pub stale: Vec<Pod>,
    /// The pods' nodes that are lost (status::node_lost), with why: their pods will not report
    /// again, nor end when deleted.
    pub lost_nodes: BTreeMap<String, String>,
    /// Seconds until a node of the pods that is not Ready now would count as lost.
    pub next_node_check: Option<u64>,
}

/// Reads the job's pods, their nodes and, while the launcher runs, rank 0's progress.
pub async fn observe(job: &TrainingJob, ctx: &Context) -> Result<Observed> {
    let pods_api: Api<Pod> = Api::namespaced(ctx.client.clone(), &names::namespace(job));
    let selector = format!("{}={}", labels::JOB, job.name_any());
    let all = pods_api.list(&ListParams::default().labels(&selector)).await?.items;
    let attempt = job.status.as_ref().map_or(0, |s| s.restart_count);
    let mut pods = Pods::split(all, attempt);
    pods.check_nodes(job, ctx).await;
    let running = pods.launcher.as_ref().is_some_and(|p| status::phase(p) == "Running");
    let progress = if running { read_progress(job, &pods).await } else { None };
    Ok(Observed { pods, progress })
}

impl Pods {
    pub fn split(all: Vec<Pod>, attempt: i32) -> Pods {
        let mut pods = Pods::default();
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

    pub fn worker(&self, name: &str) -> Option<&Pod> {
        self.workers.iter().find(|p| p.name_any() == name)
    }

    pub fn all(&self) -> impl Iterator<Item = &Pod> {
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
    pub fn on_lost_node(&self) -> Option<(&Pod, &String)> {
        self.workers
            .iter()
            .chain(self.launcher.iter())
            .find_map(|p| Some((p, self.lost_nodes.get(status::node_of(p)?)?)))
    }
}

/// Reads rank 0's progress: rank 0 runs in the first worker pod (the hostfile's first line).
async fn read_progress(job: &TrainingJob, pods: &Pods) -> Option<progress::Report> {
    let pod = pods.worker(&names::worker(job, 0))?;
    let ip = pod.status.as_ref()?.pod_ip.as_deref()?;
    match progress::fetch(ip, job.spec.progress_port as u16).await {
        Ok(report) => Some(report),
        Err(e) => {
            tracing::debug!(job = %job.name_any(), "no progress from rank 0: {e}");
            None
        }
    }
}
