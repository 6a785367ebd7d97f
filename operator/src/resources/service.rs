//! `<job>`: the headless Service whose DNS names (`<job>-worker-<i>.<job>.<ns>.svc`) the hostfile
//! uses. Only ready pods are published, so a name that resolves is a worker whose sshd answers.

use super::{child_meta, job_labels, labels, names};
use crate::crd::TrainingJob;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};

pub fn service(job: &TrainingJob) -> Service {
    let mut selector = job_labels(job);
    selector.insert(labels::ROLE.into(), labels::WORKER.into());
    Service {
        metadata: child_meta(job, names::service(job)),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(selector),
            publish_not_ready_addresses: Some(false),
            ports: Some(vec![
                ServicePort { name: Some("ssh".into()), port: job.spec.mpi.ssh_port, ..ServicePort::default() },
                ServicePort { name: Some("progress".into()), port: job.spec.progress_port, ..ServicePort::default() },
            ]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}
