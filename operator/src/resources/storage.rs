//! `<job>-ckpt`: the claim for checkpoints, metrics, TensorBoard events and the exported model.
//! With reclaimPolicy Delete it carries an owner reference and goes with the job; with Retain
//! (the default) it has none and outlives the job. An existing claim is never created or touched.

use super::{child_meta, names};
use crate::crd::{ReclaimPolicy, TrainingJob};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use std::collections::BTreeMap;

/// The claim to create, or None when the job uses an existing one.
pub fn claim(job: &TrainingJob) -> Option<PersistentVolumeClaim> {
    if job.spec.storage.existing_claim.is_some() {
        return None;
    }
    let storage = &job.spec.storage;
    let mut metadata = child_meta(job, names::claim(job));
    if storage.reclaim_policy == ReclaimPolicy::Retain {
        metadata.owner_references = None;
    }
    Some(PersistentVolumeClaim {
        metadata,
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(storage.access_modes.clone()),
            storage_class_name: storage.storage_class_name.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".to_string(), Quantity(storage.size.clone()))])),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        ..PersistentVolumeClaim::default()
    })
}
