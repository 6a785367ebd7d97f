//! The `TrainingJob` custom resource (`tensorfleet.dev/v1alpha1`): what a user writes and what
//! the operator reports back. The CRD YAML in `crds/` is generated from these types (`crdgen`);
//! `spec.training` is the worker's own configuration type, so the API server validates it with
//! the schema the worker parses.

use k8s_openapi::api::core::v1::{Affinity, EnvVar, LocalObjectReference, ResourceRequirements, Toleration};
use k8s_openapi::api::core::v1::{Volume, VolumeMount};
use k8s_openapi::api::networking::v1::NetworkPolicyIngressRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tensorfleet_worker::config::TrainingConfig;

/// Where a job is (the printer column); of the conditions, the one of this name is True.
#[derive(JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum JobPhase {
    /// Accepted; its children are being made, or it waits for its workers.
    Created,
    /// mpirun runs on the launcher.
    Running,
    /// A pod failed; the gang is being recreated and resumes from the newest checkpoint.
    Restarting,
    /// spec.runPolicy.suspend is true: no pods.
    Suspended,
    /// mpirun finished with every rank exiting 0.
    Succeeded,
    /// Finished without success; status.failure says why.
    Failed,
}

impl JobPhase {
    pub const ALL: [JobPhase; 6] = [
        JobPhase::Created,
        JobPhase::Running,
        JobPhase::Restarting,
        JobPhase::Suspended,
        JobPhase::Succeeded,
        JobPhase::Failed,
    ];

    /// The phase's name: its condition's type, the printer column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            JobPhase::Created => "Created",
            JobPhase::Running => "Running",
            JobPhase::Restarting => "Restarting",
            JobPhase::Suspended => "Suspended",
            JobPhase::Succeeded => "Succeeded",
            JobPhase::Failed => "Failed",
        }
    }

    pub fn is_finished(self) -> bool {
        matches!(self, JobPhase::Succeeded | JobPhase::Failed)
    }
}

impl std::fmt::Display for JobPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A distributed training run: `workers` pods running sshd, and a launcher pod that starts
/// `mpirun … tensorfleet-worker train` over them once they are ready.
#[derive(CustomResource, KubeSchema, Clone, Debug, Serialize, Deserialize, PartialEq)]
#[kube(
    group = "tensorfleet.dev",
    version = "v1alpha1",
    kind = "TrainingJob",
    namespaced,
    shortname = "tj",
    category = "all",
    status = "TrainingJobStatus",
    doc = "A distributed training run of tensorfleet-worker over MPI-launched pods.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase", description = "Where the job is"),
    printcolumn(name = "Workers", type_ = "string", json_path = ".status.workersSummary",
        description = "Ready worker pods / workers"),
    printcolumn(name = "Progress", type_ = "string", json_path = ".status.progress.summary",
        description = "Step / steps, loss and time left, as rank 0 reports them"),
    printcolumn(name = "Restarts", type_ = "integer", json_path = ".status.restartCount", priority = 1,
        description = "Whole-gang restarts so far"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new(
        "!has(oldSelf.status) || !has(oldSelf.status.phase) || !(oldSelf.status.phase in ['Created', 'Running', 'Restarting']) || (self.spec.workers == oldSelf.spec.workers && self.spec.image == oldSelf.spec.image && self.spec.training == oldSelf.spec.training)"
    ).message("spec.workers, spec.image and spec.training cannot change while the job runs; suspend it first (spec.runPolicy.suspend: true)")
        .reason(Reason::FieldValueForbidden),
)]
#[x_kube(validation = Rule::new(
    "!has(self.slotsPerWorker) || self.training.parallelism.data * self.training.parallelism.tensor * self.training.parallelism.pipeline == self.workers * self.slotsPerWorker"
).message("spec.training.parallelism: data × tensor × pipeline must equal spec.workers × spec.slotsPerWorker (the MPI world size)"))]
#[serde(rename_all = "camelCase")]
pub struct TrainingJobSpec {
    /// The worker image: tensorfleet-worker, OpenMPI (or the chosen MPI) and openssh-server.
    pub image: String,
    /// When to pull the image (Always, IfNotPresent, Never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Worker pods; each runs sshd and hosts slotsPerWorker MPI ranks.
    #[x_kube(validation = Rule::new("self >= 1").message("spec.workers must be at least 1"))]
    pub workers: i32,
    /// MPI ranks per worker pod. Default: the pod's nvidia.com/gpu limit, else 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("spec.slotsPerWorker must be at least 1"))]
    pub slots_per_worker: Option<i32>,
    /// CPU, memory and GPU requests and limits of every worker pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// How ranks are launched.
    #[serde(default)]
    pub mpi: MpiSpec,
    /// The worker's training configuration, exactly as `tensorfleet-worker train --config` reads it.
    /// Relative paths in data.* resolve under spec.data.mountPath, output.dir under spec.storage.mountPath.
    pub training: TrainingConfig,
    /// The PersistentVolumeClaim that holds checkpoints, metrics, TensorBoard events and the exported model.
    #[serde(default)]
    pub storage: StorageSpec,
    /// A volume with the training data, mounted read-only in every worker pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DataVolumeSpec>,
    /// Restarts, deadlines, suspension and clean-up.
    #[serde(default)]
    pub run_policy: RunPolicy,
    /// Gang scheduling, queue, priority and placement of the pods.
    #[serde(default)]
    pub scheduling: SchedulingSpec,
    /// Network isolation of the job's pods by a NetworkPolicy.
    #[serde(default)]
    pub network_policy: NetworkPolicySpec,
    /// Additions to the launcher pod.
    #[serde(default)]
    pub launcher: PodOverrides,
    /// Additions to every worker pod.
    #[serde(default)]
    pub worker: PodOverrides,
    /// The port of rank 0's progress and metrics endpoint (/progress, /metrics), which the
    /// operator reads for status.progress.
    #[serde(default = "d_progress_port")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("spec.progressPort must be a TCP port"))]
    pub progress_port: i32,
}

fn d_progress_port() -> i32 {
    9400
}

/// The MPI implementation and how the launcher reaches the workers.
#[derive(KubeSchema, Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MpiSpec {
    /// OpenMPI, Intel or MPICH: decides the hostfile format and the mpirun flags.
    #[serde(default)]
    pub implementation: MpiImplementation,
    /// WaitForWorkersReady (default): the launcher is created once every worker is ready and its
    /// name resolves; AtStartup: together with the workers (the launcher then waits itself).
    #[serde(default)]
    pub launcher_creation_policy: LauncherCreationPolicy,
    /// Where the per-job SSH Secret is mounted in every pod (key pair, authorized_keys, ssh config).
    #[serde(default = "d_ssh_path")]
    pub ssh_auth_mount_path: String,
    /// The port sshd listens on in worker pods.
    #[serde(default = "d_ssh_port")]
    pub ssh_port: i32,
    /// The user id sshd, mpirun and the ranks run as in the launcher and worker pods: 1000 (the
    /// worker image's `mpiuser`) by default, which meets the "restricted" Pod Security Standard;
    /// 0 runs them as root, which meets "baseline". The image needs a user of this id: ssh logs
    /// in by its name.
    #[serde(default = "d_run_as_user")]
    #[x_kube(validation = Rule::new("self >= 0").message("spec.mpi.runAsUser must not be negative"))]
    pub run_as_user: i64,
    /// Extra mpirun arguments, placed before the program.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra_args: Vec<String>,
}

/// Outside any home directory, so that root and other users alike reach it (ssh and sshd are
/// given its files by path, never by ~/.ssh).
fn d_ssh_path() -> String {
    "/etc/ssh/tensorfleet".into()
}

fn d_run_as_user() -> i64 {
    1000
}

fn d_ssh_port() -> i32 {
    2222
}

impl Default for MpiSpec {
    fn default() -> Self {
        MpiSpec {
            implementation: MpiImplementation::default(),
            launcher_creation_policy: LauncherCreationPolicy::default(),
            ssh_auth_mount_path: d_ssh_path(),
            ssh_port: d_ssh_port(),
            run_as_user: d_run_as_user(),
            extra_args: Vec::new(),
        }
    }
}

#[derive(JsonSchema, Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum MpiImplementation {
    #[default]
    OpenMPI,
    Intel,
    #[serde(rename = "MPICH")]
    Mpich,
}

#[derive(JsonSchema, Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum LauncherCreationPolicy {
    #[default]
    WaitForWorkersReady,
    AtStartup,
}

/// Checkpoint storage: a claim the operator creates, or one that exists.
#[derive(KubeSchema, Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StorageSpec {
    /// Use this existing PersistentVolumeClaim instead of creating `<job>-ckpt`; never deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub existing_claim: Option<String>,
    /// Size of the claim the operator creates.
    #[serde(default = "d_size")]
    pub size: String,
    /// Storage class of the created claim (the cluster default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
    /// Access modes of the created claim; ReadWriteMany lets workers on several nodes share it.
    #[serde(default = "d_access_modes")]
    pub access_modes: Vec<String>,
    /// Where the claim is mounted in worker and launcher pods.
    #[serde(default = "d_storage_mount")]
    pub mount_path: String,
    /// Delete: the created claim goes with the job (owner reference); Retain: it stays.
    #[serde(default)]
    pub reclaim_policy: ReclaimPolicy,
}

fn d_size() -> String {
    "10Gi".into()
}
fn d_access_modes() -> Vec<String> {
    vec!["ReadWriteOnce".into()]
}
fn d_storage_mount() -> String {
    "/var/lib/tensorfleet".into()
}

impl Default for StorageSpec {
    fn default() -> Self {
        StorageSpec {
            existing_claim: None,
            size: d_size(),
            storage_class_name: None,
            access_modes: d_access_modes(),
            mount_path: d_storage_mount(),
            reclaim_policy: ReclaimPolicy::default(),
        }
    }
}

#[derive(JsonSchema, Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum ReclaimPolicy {
    #[default]
    Retain,
    Delete,
}

/// The training data volume.
#[derive(KubeSchema, Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeSpec {
    /// Any volume source (persistentVolumeClaim, hostPath, nfs, …); its name is ignored.
    #[schemars(schema_with = "volume_schema")]
    pub volume: Volume,
    /// Where it is mounted (read-only).
    #[serde(default = "d_data_mount")]
    pub mount_path: String,
}

fn d_data_mount() -> String {
    "/data".into()
}

/// The Volume schema with `name` optional: the operator names the data volume itself.
fn volume_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut schema = generator.subschema_for::<Volume>();
    if let Some(obj) = schema.as_object_mut() {
        obj.remove("required");
    }
    schema
}

/// Restarts, deadlines, suspension and clean-up, as in Kubeflow's RunPolicy.
#[derive(KubeSchema, Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RunPolicy {
    /// Whole-gang restarts allowed after a failed or evicted rank; each resumes from the newest
    /// checkpoint. Worker exit codes 2 (bad configuration, unsupported model) and 3 (corrupt
    /// input) never restart.
    #[serde(default = "d_backoff")]
    #[x_kube(validation = Rule::new("self >= 0").message("spec.runPolicy.backoffLimit must not be negative"))]
    pub backoff_limit: i32,
    /// Seconds the job may be active before it fails with DeadlineExceeded; suspension resets the timer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1").message("spec.runPolicy.activeDeadlineSeconds must be at least 1"))]
    pub active_deadline_seconds: Option<i64>,
    /// Seconds after Succeeded or Failed when the job and its children are deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 0").message("spec.runPolicy.ttlSecondsAfterFinished must not be negative"))]
    pub ttl_seconds_after_finished: Option<i64>,
    /// Which pods to delete when the job finishes: Running (default: those still running), All, None.
    #[serde(default)]
    pub clean_pod_policy: CleanPodPolicy,
    /// True deletes the pods and keeps everything else; false brings them back, resuming from
    /// the newest checkpoint.
    #[serde(default)]
    pub suspend: bool,
    /// Seconds a pod's node may be not Ready (its kubelet silent: the control plane says Unknown
    /// after its node-monitor grace period) before the node counts as lost: the gang restarts
    /// without it from the newest checkpoint, its pods there removed at once (as `kubectl delete
    /// --force` would: a node that was only cut off may still run them).
    #[serde(default = "d_node_lost_after")]
    #[x_kube(validation = Rule::new("self >= 0").message("spec.runPolicy.nodeLostAfterSeconds must not be negative"))]
    pub node_lost_after_seconds: i64,
}

fn d_backoff() -> i32 {
    3
}

fn d_node_lost_after() -> i64 {
    60
}

impl Default for RunPolicy {
    fn default() -> Self {
        RunPolicy {
            backoff_limit: d_backoff(),
            active_deadline_seconds: None,
            ttl_seconds_after_finished: None,
            clean_pod_policy: CleanPodPolicy::default(),
            suspend: false,
            node_lost_after_seconds: d_node_lost_after(),
        }
    }
}

#[derive(JsonSchema, Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum CleanPodPolicy {
    #[default]
    Running,
    All,
    None,
}

/// Network isolation of the job's pods (resources/network_policy.rs).
#[derive(KubeSchema, Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicySpec {
    /// Makes the NetworkPolicy `<job>-isolation`, which admits to the job's pods only the job's
    /// own pods and the operator's (on the progress port), plus `ingress`. The cluster's network
    /// plugin enforces it; one that does not implement NetworkPolicy ignores it.
    #[serde(default)]
    pub enabled: bool,
    /// More ingress rules, e.g. a Prometheus in another namespace that scrapes the progress port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<NetworkPolicyIngressRule>,
}

/// Scheduling of the pods: gang scheduling, queue, priority, placement.
#[derive(KubeSchema, Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SchedulingSpec {
    /// None, Volcano or SchedulerPlugins: with a gang scheduler the pods are placed all or none,
    /// through a PodGroup the operator keeps sized to the pods that exist.
    #[serde(default)]
    pub gang: GangScheduler,
    /// The gang scheduler's queue (Volcano).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// PriorityClass of every pod and of the PodGroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// The scheduler's name; defaults to the gang scheduler's (volcano, scheduler-plugins-scheduler).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_name: Option<String>,
    /// Node labels every pod must match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints every pod tolerates.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Affinity of every pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Seconds a gang may wait to be scheduled (scheduler-plugins' scheduleTimeoutSeconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule_timeout_seconds: Option<i32>,
}

#[derive(JsonSchema, Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub enum GangScheduler {
    #[default]
    None,
    Volcano,
    SchedulerPlugins,
}

/// What a user may add to the launcher or the worker pods.
#[derive(KubeSchema, Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodOverrides {
    /// Extra labels on the pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Extra annotations on the pod.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Extra environment variables of the main container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Extra volumes of the pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
    /// Extra mounts of the main container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
    /// Requests and limits of the main container (for workers, spec.resources wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// The pod's ServiceAccount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Secrets for pulling the image.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// Node labels this pod must match, on top of spec.scheduling.nodeSelector.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
}

/// What the operator observed.
#[derive(KubeSchema, Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TrainingJobStatus {
    /// Created, Running, Restarting, Suspended, Succeeded or Failed; absent until the operator
    /// first sees the job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<JobPhase>,
    /// The latest observation of each condition type (Created, Running, Restarting, Suspended,
    /// Succeeded, Failed), with a reason and a message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Worker pods by state.
    #[serde(default)]
    pub workers: ReplicaCounts,
    /// "ready/total" worker pods, for the printer column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers_summary: Option<String>,
    /// The launcher pod's phase (Pending, Running, Succeeded, Failed), when it exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launcher: Option<String>,
    /// Training progress as rank 0 reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// The newest complete checkpoint rank 0 reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest_checkpoint: Option<String>,
    /// Whole-gang restarts so far.
    #[serde(default)]
    pub restart_count: i32,
    /// What made the job fail or restart last: pod, container, exit code, reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureCause>,
    /// When the job first started running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When the current active period began (reset by suspension); activeDeadlineSeconds counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_since: Option<Time>,
    /// When the job succeeded or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// The NetworkPolicy the operator made for the job (spec.networkPolicy), while it exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<String>,
}

/// A condition in the Kubernetes convention.
#[derive(KubeSchema, Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Created, Running, Restarting, Suspended, Succeeded or Failed.
    #[serde(rename = "type")]
    pub type_: String,
    /// True, False or Unknown.
    pub status: String,
    /// A CamelCase word for machines.
    #[serde(default)]
    pub reason: String,
    /// A sentence for people.
    #[serde(default)]
    pub message: String,
    /// When status last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
}

/// Pod counts by state.
#[derive(KubeSchema, Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaCounts {
    /// Worker pods that exist.
    #[serde(default)]
    pub active: i32,
    /// Worker pods that are ready (sshd up, name resolvable).
    #[serde(default)]
    pub ready: i32,
    /// Worker pods that failed.
    #[serde(default)]
    pub failed: i32,
}

/// Rank 0's view of the run.
#[derive(KubeSchema, Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Weight updates done.
    pub step: i64,
    /// Weight updates in the run.
    pub total_steps: i64,
    /// Loss of the latest logged step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Latest evaluation loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Training throughput.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    /// Estimated seconds to the last step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_seconds: Option<i64>,
    /// "step/total (percent%)", for the printer column.
    #[serde(default)]
    pub summary: String,
    /// When the operator read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_at: Option<Time>,
}

/// The root cause of a failure or a restart.
#[derive(KubeSchema, Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FailureCause {
    /// The pod that failed.
    pub pod: String,
    /// The container that failed, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// Its exit code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// OOMKilled, Evicted, Error, DeadlineExceeded, …
    pub reason: String,
    /// The container's termination message (the worker's error) or the pod's status message.
    #[serde(default)]
    pub message: String,
}

impl TrainingJob {
    /// MPI ranks per worker pod: spec.slotsPerWorker, else the nvidia.com/gpu limit, else 1.
    pub fn slots_per_worker(&self) -> i32 {
        if let Some(s) = self.spec.slots_per_worker {
            return s;
        }
        let gpus = self
            .spec
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("nvidia.com/gpu"))
            .and_then(|q| q.0.parse::<i32>().ok());
        gpus.filter(|g| *g > 0).unwrap_or(1)
    }

    /// The MPI world size.
    pub fn world_size(&self) -> i32 {
        self.spec.workers * self.slots_per_worker()
    }
}

/// Where `make crds` writes the CRD, relative to the workspace: `crds/` for `kubectl apply`, and
/// the chart's copy that `helm install` applies.
pub const CRD_FILES: [&str; 2] =
    ["crds/trainingjobs.tensorfleet.dev.yaml", "charts/tensorfleet/crds/trainingjobs.tensorfleet.dev.yaml"];

/// The CRD as the YAML file `crdgen` prints and `CRD_FILES` hold.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    use kube::CustomResourceExt;
    let yaml = serde_yaml::to_string(&TrainingJob::crd())?;
    Ok(format!("# Generated by `make crds` from operator/src/crd.rs; do not edit.\n{yaml}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed CRD files are what the Rust types generate: a field added to the spec and not
    /// to the files would be pruned by the API server from every job that sets it.
    #[test]
    fn the_committed_crd_files_are_what_the_types_generate() {
        let generated = crd_yaml().expect("the CRD serializes");
        let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for file in CRD_FILES {
            let committed = std::fs::read_to_string(workspace.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
            let line = committed.lines().zip(generated.lines()).take_while(|(a, b)| a == b).count() + 1;
            assert!(
                committed == generated,
                "{file} is out of date with operator/src/crd.rs from line {line}: run `make crds` and commit the result"
            );
        }
    }
}
