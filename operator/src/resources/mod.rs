//! One builder per child object of a TrainingJob. Each returns the full desired object; the
//! controller server-side applies it, so building is pure and testable without a cluster.

pub mod config;
pub mod network_policy;
pub mod podgroup;
pub mod pods;
pub mod service;
pub mod ssh;
pub mod storage;

use crate::crd::TrainingJob;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use std::collections::BTreeMap;

/// The field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "tensorfleet-operator";

/// Label keys on every child.
pub mod labels {
    pub const JOB: &str = "tensorfleet.dev/job-name";
    pub const ROLE: &str = "tensorfleet.dev/role";
    /// The worker's index: its pod name and its place in the hostfile.
    pub const INDEX: &str = "tensorfleet.dev/worker-index";
    /// Which gang attempt a pod belongs to (status.restartCount when it was created).
    pub const ATTEMPT: &str = "tensorfleet.dev/attempt";
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    pub const WORKER: &str = "worker";
    pub const LAUNCHER: &str = "launcher";
}

/// Object names, derived from the job's name so they are stable across operator restarts.
pub mod names {
    use crate::crd::TrainingJob;
    use kube::ResourceExt;

    pub fn job(job: &TrainingJob) -> String {
        job.name_any()
    }
    pub fn namespace(job: &TrainingJob) -> String {
        job.namespace().unwrap_or_else(|| "default".into())
    }
    pub fn config_map(job: &TrainingJob) -> String {
        format!("{}-config", job.name_any())
    }
    pub fn ssh_secret(job: &TrainingJob) -> String {
        format!("{}-ssh", job.name_any())
    }
    /// The headless Service; also the pods' subdomain.
    pub fn service(job: &TrainingJob) -> String {
        job.name_any()
    }
    pub fn claim(job: &TrainingJob) -> String {
        match &job.spec.storage.existing_claim {
            Some(c) => c.clone(),
            None => format!("{}-ckpt", job.name_any()),
        }
    }
    pub fn pod_group(job: &TrainingJob) -> String {
        job.name_any()
    }
    pub fn worker(job: &TrainingJob, index: i32) -> String {
        format!("{}-worker-{index}", job.name_any())
    }
    pub fn launcher(job: &TrainingJob) -> String {
        format!("{}-launcher", job.name_any())
    }
    pub fn network_policy(job: &TrainingJob) -> String {
        format!("{}-isolation", job.name_any())
    }
    /// The DNS name of a worker pod through the headless Service (hostname.subdomain.namespace.svc).
    pub fn worker_host(job: &TrainingJob, index: i32) -> String {
        format!("{}.{}.{}.svc", worker(job, index), service(job), namespace(job))
    }
}

/// Labels that select every child of the job, plus the managed-by label.
pub fn job_labels(job: &TrainingJob) -> BTreeMap<String, String> {
    BTreeMap::from([
        (labels::JOB.to_string(), job.name_any()),
        (labels::MANAGED_BY.to_string(), FIELD_MANAGER.to_string()),
    ])
}

/// The owner reference that makes the garbage collector delete a child with its job.
pub fn owner_reference(job: &TrainingJob) -> OwnerReference {
    job.controller_owner_ref(&()).expect("a TrainingJob read from the API server has a uid")
}

/// Metadata of a child: name, namespace, job labels, owner reference.
pub fn child_meta(job: &TrainingJob, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(names::namespace(job)),
        labels: Some(job_labels(job)),
        owner_references: Some(vec![owner_reference(job)]),
        ..ObjectMeta::default()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use crate::crd::{TrainingJob, TrainingJobSpec};
    use tensorfleet_worker::config::TrainingConfig;

    /// A job as the API server would return it: named, namespaced, with a uid.
    pub fn job(name: &str, workers: i32) -> TrainingJob {
        let training = TrainingConfig::parse(
            "model: {gpt2: {layers: 2, heads: 2, embed: 64, seqLen: 64}}\n\
             data: {train: {path: train, format: tokens}, eval: {path: val, format: tokens}}\n\
             batchSize: 4\nsteps: 20\nparallelism: {data: 2}\n",
            "test",
            &[],
        )
        .expect("test config parses");
        let spec: TrainingJobSpec = serde_json::from_value(serde_json::json!({
            "image": "tensorfleet/worker:test",
            "workers": workers,
            "training": training,
        }))
        .expect("test spec parses");
        let mut job = TrainingJob::new(name, spec);
        job.metadata.namespace = Some("team-a".into());
        job.metadata.uid = Some("0b7e2c1a-0000-4000-8000-000000000001".into());
        job
    }
}
