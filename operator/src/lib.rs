//! tensorfleet-operator: the `TrainingJob` CRD and the controller that turns each job into an
//! SSH Secret, a ConfigMap, a headless Service, a checkpoint claim, worker pods running sshd and
//! a launcher pod running `mpirun … tensorfleet-worker train`.

pub mod controller;
pub mod crd;
pub mod leader;
pub mod metrics;
pub mod mpi;
pub mod progress;
pub mod resources;
pub mod server;
pub mod status;

/// Everything a reconcile can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("building a child object: {0}")]
    Build(String),
}

impl Error {
    /// A 409 from the API server: our view was stale (or a create raced another pass).
    pub fn is_conflict(&self) -> bool {
        matches!(self, Error::Kube(kube::Error::Api(e)) if e.code == 409)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
