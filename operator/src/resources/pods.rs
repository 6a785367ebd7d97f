//! The pods: `<job>-worker-<i>` run sshd and host the ranks; `<job>-launcher` runs mpirun over
//! them. Both carry the attempt they belong to, so a gang restart can tell old pods from new.

use super::{job_labels, labels, names, owner_reference, podgroup, ssh};
use crate::crd::{PodOverrides, TrainingJob};
use crate::mpi;
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EnvVar, PersistentVolumeClaimVolumeSource, Pod,
    PodSecurityContext, PodSpec, Probe, SeccompProfile, SecurityContext, TCPSocketAction, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use std::collections::BTreeMap;

pub fn worker(job: &TrainingJob, index: i32, attempt: i32) -> Pod {
    let ssh_port = job.spec.mpi.ssh_port;
    let overrides = &job.spec.worker;
    let mut env = vec![env("TENSORFLEET_JOB", format!("{}/{}", names::namespace(job), names::job(job)))];
    env.extend(overrides.env.iter().cloned());
    let container = Container {
        name: "worker".into(),
        image: Some(job.spec.image.clone()),
        image_pull_policy: job.spec.image_pull_policy.clone(),
        // sshd, which stops the container when the kernel OOM-kills any of its processes.
        command: Some(vec!["/bin/sh".into(), format!("{}/worker.sh", mpi::CONFIG_DIR)]),
        env: Some(env),
        ports: Some(vec![port("ssh", ssh_port), port("progress", job.spec.progress_port)]),
        readiness_probe: Some(Probe {
            tcp_socket: Some(TCPSocketAction { port: IntOrString::Int(ssh_port), host: None }),
            period_seconds: Some(2),
            ..Probe::default()
        }),
        resources: job.spec.resources.clone().or_else(|| overrides.resources.clone()),
        volume_mounts: Some(mounts(job, overrides, true)),
        security_context: Some(container_security(job)),
        ..Container::default()
    };
    let mut pod = pod(job, labels::WORKER, names::worker(job, index), attempt, overrides, container, true);
    pod.metadata.labels.get_or_insert_with(BTreeMap::new).insert(labels::INDEX.into(), index.to_string());
    let spec = pod.spec.as_mut().expect("pod() sets a spec");
    spec.hostname = Some(names::worker(job, index));
    spec.subdomain = Some(names::service(job));
    pod
}

pub fn launcher(job: &TrainingJob, attempt: i32) -> Pod {
    let overrides = &job.spec.launcher;
    let mut env: Vec<EnvVar> = mpi::launcher_env(job).into_iter().map(|(k, v)| env(&k, v)).collect();
    env.extend(overrides.env.iter().cloned());
    let container = Container {
        name: "launcher".into(),
        image: Some(job.spec.image.clone()),
        image_pull_policy: job.spec.image_pull_policy.clone(),
        command: Some(vec!["/bin/sh".into(), format!("{}/launch.sh", mpi::CONFIG_DIR)]),
        env: Some(env),
        resources: overrides.resources.clone(),
        volume_mounts: Some(mounts(job, overrides, false)),
        // The kubelet copies the tail of the log (the failed rank's error) into the
        // termination message, from where the operator puts it in status.failure.
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        security_context: Some(container_security(job)),
        ..Container::default()
    };
    pod(job, labels::LAUNCHER, names::launcher(job), attempt, overrides, container, false)
}

/// The pods' user (`spec.mpi.runAsUser`) and the default seccomp profile. Another user than root
/// also owns the pods' volumes as its group (fsGroup): the Secret's keys become readable to it
/// while staying root's files, which ssh and sshd accept.
fn pod_security(job: &TrainingJob) -> PodSecurityContext {
    let user = job.spec.mpi.run_as_user;
    let non_root = user != 0;
    PodSecurityContext {
        run_as_user: Some(user),
        run_as_group: non_root.then_some(user),
        fs_group: non_root.then_some(user),
        run_as_non_root: non_root.then_some(true),
        seccomp_profile: Some(SeccompProfile { type_: "RuntimeDefault".into(), localhost_profile: None }),
        ..PodSecurityContext::default()
    }
}

/// Not root: no capabilities and no way to gain privileges ("restricted"). Root keeps the
/// runtime's default capabilities, which its sshd needs to change to the logged-in user
/// ("baseline").
fn container_security(job: &TrainingJob) -> SecurityContext {
    let non_root = job.spec.mpi.run_as_user != 0;
    SecurityContext {
        allow_privilege_escalation: non_root.then_some(false),
        capabilities: non_root.then(|| Capabilities { drop: Some(vec!["ALL".into()]), add: None }),
        ..SecurityContext::default()
    }
}

/// What both pods share: metadata, volumes, scheduling, restart policy.
fn pod(
    job: &TrainingJob,
    role: &str,
    name: String,
    attempt: i32,
    overrides: &PodOverrides,
    container: Container,
    worker: bool,
) -> Pod {
    let mut pod_labels = job_labels(job);
    pod_labels.insert(labels::ROLE.into(), role.into());
    pod_labels.insert(labels::ATTEMPT.into(), attempt.to_string());
    pod_labels.extend(overrides.labels.clone());
    let mut annotations = overrides.annotations.clone();
    podgroup::mark_member(job, &mut pod_labels, &mut annotations);
    let scheduling = &job.spec.scheduling;
    let mut node_selector = scheduling.node_selector.clone();
    node_selector.extend(overrides.node_selector.clone());
    let mut volumes = vec![
        Volume {
            name: "config".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: names::config_map(job),
                default_mode: Some(0o644),
                ..ConfigMapVolumeSource::default()
            }),
            ..Volume::default()
        },
        ssh::volume(job),
    ];
    if worker {
        volumes.push(Volume {
            name: "storage".into(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: names::claim(job),
                read_only: None,
            }),
            ..Volume::default()
        });
        if let Some(data) = &job.spec.data {
            volumes.push(Volume { name: "data".into(), ..data.volume.clone() });
        }
    }
    volumes.extend(overrides.volumes.iter().cloned());
    Pod {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(names::namespace(job)),
            labels: Some(pod_labels),
            annotations: (!annotations.is_empty()).then_some(annotations),
            owner_references: Some(vec![owner_reference(job)]),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            containers: vec![container],
            volumes: Some(volumes),
            // A rank that dies fails its pod; the operator restarts the whole gang.
            restart_policy: Some("Never".into()),
            node_selector: (!node_selector.is_empty()).then_some(node_selector),
            tolerations: (!scheduling.tolerations.is_empty()).then(|| scheduling.tolerations.clone()),
            affinity: scheduling.affinity.clone(),
            priority_class_name: scheduling.priority_class_name.clone(),
            scheduler_name: podgroup::scheduler_name(job),
            service_account_name: overrides.service_account_name.clone(),
            image_pull_secrets: (!overrides.image_pull_secrets.is_empty())
                .then(|| overrides.image_pull_secrets.clone()),
            security_context: Some(pod_security(job)),
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

fn mounts(job: &TrainingJob, overrides: &PodOverrides, worker: bool) -> Vec<VolumeMount> {
    let mount = |name: &str, path: &str, read_only: bool| VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: Some(read_only),
        ..VolumeMount::default()
    };
    let mut mounts =
        vec![mount("config", mpi::CONFIG_DIR, true), mount("ssh", &job.spec.mpi.ssh_auth_mount_path, true)];
    if worker {
        mounts.push(mount("storage", &job.spec.storage.mount_path, false));
        if let Some(data) = &job.spec.data {
            mounts.push(mount("data", &data.mount_path, true));
        }
    }
    mounts.extend(overrides.volume_mounts.iter().cloned());
    mounts
}

fn env(name: &str, value: String) -> EnvVar {
    EnvVar { name: name.into(), value: Some(value), value_from: None }
}

fn port(name: &str, port: i32) -> ContainerPort {
    ContainerPort { name: Some(name.into()), container_port: port, ..ContainerPort::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::tests::job;

    #[test]
    fn worker_pod_has_stable_dns_identity_and_volumes() {
        let mut j = job("llm", 2);
        j.spec.scheduling.node_selector.insert("pool".into(), "gpu".into());
        j.spec.worker.node_selector.insert("zone".into(), "a".into());
        let p = worker(&j, 1, 3);
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("llm-worker-1"));
        assert_eq!(spec.hostname.as_deref(), Some("llm-worker-1"));
        assert_eq!(spec.subdomain.as_deref(), Some("llm"));
        assert_eq!(p.metadata.labels.as_ref().unwrap()[labels::ATTEMPT], "3");
        assert_eq!(spec.node_selector.as_ref().unwrap().len(), 2);
        let mounts = spec.containers[0].volume_mounts.as_ref().unwrap();
        let paths: Vec<&str> = mounts.iter().map(|m| m.mount_path.as_str()).collect();
        assert_eq!(paths, ["/etc/tensorfleet", "/etc/ssh/tensorfleet", "/var/lib/tensorfleet"]);
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    }

    /// The fields the "restricted" Pod Security Standard checks, on both pods by default; with
    /// runAsUser 0 the pods run as root with the runtime's default capabilities ("baseline").
    /// The API server's PodSecurity admission enforces them in the e2e namespaces.
    #[test]
    fn pods_run_as_the_image_user_without_privileges_unless_root_is_asked_for() {
        let mut j = job("llm", 2);
        for p in [worker(&j, 0, 0), launcher(&j, 0)] {
            let spec = p.spec.unwrap();
            let pod = spec.security_context.unwrap();
            assert_eq!((pod.run_as_user, pod.run_as_group, pod.fs_group), (Some(1000), Some(1000), Some(1000)));
            assert_eq!(pod.run_as_non_root, Some(true));
            assert_eq!(pod.seccomp_profile.unwrap().type_, "RuntimeDefault");
            let c = spec.containers[0].security_context.clone().unwrap();
            assert_eq!(c.allow_privilege_escalation, Some(false));
            assert_eq!(c.capabilities.unwrap().drop.unwrap(), ["ALL"]);
            assert!(c.privileged.is_none() && c.run_as_user.is_none());
        }
        j.spec.mpi.run_as_user = 0;
        for p in [worker(&j, 0, 0), launcher(&j, 0)] {
            let spec = p.spec.unwrap();
            let pod = spec.security_context.unwrap();
            assert_eq!((pod.run_as_user, pod.run_as_non_root, pod.fs_group), (Some(0), None, None));
            let c = spec.containers[0].security_context.clone().unwrap();
            assert!(c.capabilities.is_none() && c.allow_privilege_escalation.is_none() && c.privileged.is_none());
        }
    }

    #[test]
    fn launcher_runs_the_launch_script_and_keeps_the_error() {
        let j = job("llm", 2);
        let p = launcher(&j, 0);
        let c = &p.spec.as_ref().unwrap().containers[0];
        assert_eq!(c.command.as_ref().unwrap()[1], "/etc/tensorfleet/launch.sh");
        assert_eq!(c.termination_message_policy.as_deref(), Some("FallbackToLogsOnError"));
        assert!(c.env.as_ref().unwrap().iter().any(|e| e.name == "OMPI_MCA_plm_rsh_args"));
        let keep_fqdn = c.env.as_ref().unwrap().iter().find(|e| e.name == "OMPI_MCA_orte_keep_fqdn_hostnames");
        assert_eq!(keep_fqdn.and_then(|e| e.value.as_deref()), Some("true"));
    }
}
