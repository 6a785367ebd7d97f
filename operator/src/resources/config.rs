//! `<job>-config`: the hostfile, `discover_hosts.sh`, the launcher's `launch.sh`, the workers'
//! `worker.sh` and the ranks' `train.yaml` (spec.training with its paths placed on the data
//! volume and the claim).

use super::{child_meta, names};
use crate::crd::TrainingJob;
use crate::mpi;
use k8s_openapi::api::core::v1::ConfigMap;
use std::collections::BTreeMap;
use std::path::Path;
use tensorfleet_worker::config::TrainingConfig;

/// The worker configuration as the ranks will read it: relative data and model paths under
/// spec.data.mountPath, the output directory under spec.storage.mountPath.
pub fn train_config(job: &TrainingJob) -> TrainingConfig {
    let mut training = job.spec.training.clone();
    let inputs = job.spec.data.as_ref().map(|d| d.mount_path.as_str()).unwrap_or("/data");
    training.resolve_paths(Path::new(inputs), Path::new(&job.spec.storage.mount_path));
    // Rank 0 serves its progress where the operator looks for it.
    training.logging.port = job.spec.progress_port as u16;
    training
}

pub fn config_map(job: &TrainingJob) -> Result<ConfigMap, serde_yaml::Error> {
    let train = serde_yaml::to_string(&train_config(job))?;
    Ok(ConfigMap {
        metadata: child_meta(job, names::config_map(job)),
        data: Some(BTreeMap::from([
            ("hostfile".to_string(), mpi::hostfile(job)),
            ("discover_hosts.sh".to_string(), mpi::discover_hosts(job)),
            ("launch.sh".to_string(), mpi::launch_script(job)),
            ("worker.sh".to_string(), mpi::worker_script(job)),
            ("train.yaml".to_string(), train),
        ])),
        ..ConfigMap::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::tests::job;

    #[test]
    fn train_yaml_round_trips_with_paths_on_the_volumes() {
        let j = job("llm", 2);
        let cm = config_map(&j).unwrap();
        let data = cm.data.unwrap();
        let parsed = TrainingConfig::parse(&data["train.yaml"], "train.yaml", &[]).unwrap();
        assert_eq!(parsed.data.train.path, Path::new("/data/train"));
        assert_eq!(parsed.output.dir, Path::new("/var/lib/tensorfleet/out"));
        assert_eq!(parsed.batch_size, j.spec.training.batch_size);
        assert_eq!(parsed.logging.port, 9400);
        assert!(data["hostfile"].starts_with("llm-worker-0.llm.team-a.svc slots=1\n"));
    }
}
