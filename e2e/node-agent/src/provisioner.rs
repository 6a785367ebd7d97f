//! A local-path provisioner: the cluster's default StorageClass, whose volumes are directories
//! under the agent's state directory, so checkpoints on a claim outlive the pods that wrote them.
//! A claim of the class gets a hostPath PersistentVolume made for it (the controller-manager's
//! binder then binds the two); a released volume with reclaimPolicy Delete is removed with its
//! directory, one with Retain is left for a person to look at.

use crate::node::MANAGER;
use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    HostPathVolumeSource, ObjectReference, PersistentVolume, PersistentVolumeClaim, PersistentVolumeSpec,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, ResourceExt};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

pub const STORAGE_CLASS: &str = "tensorfleet-local";
pub const PROVISIONER: &str = "tensorfleet.dev/local-path";
const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
/// Set on a claim by the controller-manager when an external provisioner should act on it.
const STORAGE_PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";

/// Makes the StorageClass (the default one), then provisions and reclaims until dropped.
pub async fn run(client: Client, root: PathBuf) -> Result<()> {
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let class = StorageClass {
        metadata: ObjectMeta {
            name: Some(STORAGE_CLASS.into()),
            annotations: Some(BTreeMap::from([(
                "storageclass.kubernetes.io/is-default-class".to_string(),
                "true".to_string(),
            )])),
            ..ObjectMeta::default()
        },
        provisioner: PROVISIONER.into(),
        reclaim_policy: Some("Delete".into()),
        volume_binding_mode: Some("Immediate".into()),
        ..StorageClass::default()
    };
    Api::<StorageClass>::all(client.clone())
        .patch(STORAGE_CLASS, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&class))
        .await
        .context("creating the StorageClass tensorfleet-local")?;

    let claims = watcher(Api::<PersistentVolumeClaim>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .map(|r| r.map(|c| Item::Claim(Box::new(c))));
    let volumes = watcher(Api::<PersistentVolume>::all(client.clone()), watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .map(|r| r.map(|v| Item::Volume(Box::new(v))));
    let mut items = futures::stream::select(claims.boxed(), volumes.boxed());
    while let Some(item) = items.next().await {
        let result = match item {
            Ok(Item::Claim(c)) => provision(&client, &root, &c).await,
            Ok(Item::Volume(v)) => reclaim(&client, &v).await,
            Err(e) => {
                tracing::warn!("provisioner watch: {e}");
                continue;
            }
        };
        if let Err(e) = result {
            tracing::warn!("provisioner: {e:#}");
        }
    }
    Ok(())
}

enum Item {
    Claim(Box<PersistentVolumeClaim>),
    Volume(Box<PersistentVolume>),
}

fn volume_name(claim: &PersistentVolumeClaim) -> String {
    format!("pvc-{}", claim.uid().unwrap_or_default())
}

async fn provision(client: &Client, root: &Path, claim: &PersistentVolumeClaim) -> Result<()> {
    let ours = claim.annotations().get(STORAGE_PROVISIONER).is_some_and(|p| p == PROVISIONER);
    let pending = claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending");
    let spec = claim.spec.clone().unwrap_or_default();
    if !ours || !pending || spec.volume_name.is_some() || claim.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    let volumes = Api::<PersistentVolume>::all(client.clone());
    let name = volume_name(claim);
    if volumes.get_opt(&name).await?.is_some() {
        return Ok(());
    }
    let ns = claim.namespace().unwrap_or_default();
    let dir = root.join(format!("{ns}_{}_{}", claim.name_any(), claim.uid().unwrap_or_default()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Pods of any user may write to it, as with a fresh filesystem's root.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))
        .with_context(|| format!("opening up {}", dir.display()))?;
    let capacity = spec.resources.as_ref().and_then(|r| r.requests.as_ref()).and_then(|r| r.get("storage")).cloned();
    let reclaim = Api::<StorageClass>::all(client.clone())
        .get_opt(spec.storage_class_name.as_deref().unwrap_or(STORAGE_CLASS))
        .await?
        .and_then(|c| c.reclaim_policy)
        .unwrap_or_else(|| "Delete".into());
    let pv = PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            annotations: Some(BTreeMap::from([(PROVISIONED_BY.to_string(), PROVISIONER.to_string())])),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: capacity.map(|c| BTreeMap::from([("storage".to_string(), c)])),
            access_modes: spec.access_modes.clone(),
            persistent_volume_reclaim_policy: Some(reclaim),
            storage_class_name: spec.storage_class_name.clone(),
            volume_mode: spec.volume_mode.clone(),
            host_path: Some(HostPathVolumeSource {
                path: dir.to_string_lossy().into_owned(),
                type_: Some("DirectoryOrCreate".into()),
            }),
            claim_ref: Some(ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("PersistentVolumeClaim".into()),
                namespace: Some(ns.clone()),
                name: Some(claim.name_any()),
                uid: claim.uid(),
                ..ObjectReference::default()
            }),
            ..PersistentVolumeSpec::default()
        }),
        ..PersistentVolume::default()
    };
    volumes.create(&PostParams::default(), &pv).await.with_context(|| format!("creating PersistentVolume {name}"))?;
    tracing::info!("provisioned {name} at {} for {ns}/{}", dir.display(), claim.name_any());
    Ok(())
}

async fn reclaim(client: &Client, pv: &PersistentVolume) -> Result<()> {
    let ours = pv.annotations().get(PROVISIONED_BY).is_some_and(|p| p == PROVISIONER);
    let released = pv.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Released");
    let spec = pv.spec.as_ref();
    let delete = spec.and_then(|s| s.persistent_volume_reclaim_policy.as_deref()) == Some("Delete");
    if !ours || !released || !delete || pv.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    if let Some(path) = spec.and_then(|s| s.host_path.as_ref()).map(|h| PathBuf::from(&h.path)) {
        if let Err(e) = std::fs::remove_dir_all(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                return Err(e).with_context(|| format!("removing {}", path.display()));
            }
        }
    }
    Api::<PersistentVolume>::all(client.clone())
        .delete(&pv.name_any(), &DeleteParams::default())
        .await
        .with_context(|| format!("deleting PersistentVolume {}", pv.name_any()))?;
    tracing::info!("reclaimed {}", pv.name_any());
    Ok(())
}
