//! A pod's volumes, made ready on the host before its containers start: ConfigMaps, Secrets,
//! downward API and projected volumes (service-account tokens included) are written out as files
//! with their modes; emptyDirs are directories of the pod; a PVC is the directory of the
//! PersistentVolume it is bound to (see `provisioner`); hostPath is itself. Containers get each
//! as a bind mount at its mountPath (`container`).
//!
//! An error leaves the pod in ContainerCreating with the error as the message, and the agent tries
//! again (a ConfigMap may be created later, a claim bound later), as the kubelet does.

use anyhow::{bail, Context, Result};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, DownwardAPIVolumeFile, KeyToPath, PersistentVolume, PersistentVolumeClaim, Pod, Secret, ServiceAccount,
    Volume,
};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

/// A volume as it exists on the host.
#[derive(Debug, Clone)]
pub struct HostVolume {
    pub path: PathBuf,
    /// Read-only whatever the mount says (a claim mounted readOnly, ConfigMaps and Secrets).
    pub read_only: bool,
}

/// Makes every volume of `pod` ready under `dir` (the pod's volume directory).
pub async fn prepare(client: &Client, pod: &Pod, dir: &Path) -> Result<BTreeMap<String, HostVolume>> {
    let mut out = BTreeMap::new();
    let volumes = pod.spec.as_ref().and_then(|s| s.volumes.as_ref());
    for volume in volumes.into_iter().flatten() {
        let host = prepare_one(client, pod, volume, &dir.join(&volume.name))
            .await
            .with_context(|| format!("volume {:?}", volume.name))?;
        out.insert(volume.name.clone(), host);
    }
    Ok(out)
}

async fn prepare_one(client: &Client, pod: &Pod, v: &Volume, dir: &Path) -> Result<HostVolume> {
    let ns = pod.namespace().unwrap_or_default();
    let files = |read_only| HostVolume { path: dir.to_path_buf(), read_only };
    if v.empty_dir.is_some() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        return Ok(files(false));
    }
    if let Some(host_path) = &v.host_path {
        return Ok(HostVolume { path: PathBuf::from(&host_path.path), read_only: false });
    }
    if let Some(claim) = &v.persistent_volume_claim {
        let path = claim_path(client, &ns, &claim.claim_name).await?;
        return Ok(HostVolume { path, read_only: claim.read_only.unwrap_or(false) });
    }
    let mut written = Files::default();
    if let Some(cm) = &v.config_map {
        let mode = cm.default_mode.unwrap_or(0o644);
        config_map_files(client, &ns, &cm.name, cm.items.as_deref(), mode, cm.optional, &mut written).await?;
    } else if let Some(secret) = &v.secret {
        let name = secret.secret_name.as_deref().context("secret.secretName is empty")?;
        let mode = secret.default_mode.unwrap_or(0o644);
        secret_files(client, &ns, name, secret.items.as_deref(), mode, secret.optional, &mut written).await?;
    } else if let Some(downward) = &v.downward_api {
        let mode = downward.default_mode.unwrap_or(0o644);
        for item in downward.items.iter().flatten() {
            downward_file(pod, item, mode, &mut written)?;
        }
    } else if let Some(projected) = &v.projected {
        let mode = projected.default_mode.unwrap_or(0o644);
        for source in projected.sources.iter().flatten() {
            if let Some(cm) = &source.config_map {
                config_map_files(client, &ns, &cm.name, cm.items.as_deref(), mode, cm.optional, &mut written).await?;
            }
            if let Some(secret) = &source.secret {
                secret_files(client, &ns, &secret.name, secret.items.as_deref(), mode, secret.optional, &mut written)
                    .await?;
            }
            if let Some(downward) = &source.downward_api {
                for item in downward.items.iter().flatten() {
                    downward_file(pod, item, mode, &mut written)?;
                }
            }
            if let Some(token) = &source.service_account_token {
                let jwt = service_account_token(client, pod, token.audience.clone(), token.expiration_seconds).await?;
                written.add(&token.path, jwt.into_bytes(), mode)?;
            }
            if source.cluster_trust_bundle.is_some() || source.pod_certificate.is_some() {
                bail!("projected clusterTrustBundle and podCertificate sources are not supported by the node agent");
            }
        }
    } else {
        bail!("this kind of volume is not supported by the node agent (it runs emptyDir, hostPath, persistentVolumeClaim, configMap, secret, downwardAPI and projected)");
    }
    written.write(dir)?;
    Ok(files(true))
}

/// The files of a ConfigMap, Secret, downward API or projected volume, before writing.
#[derive(Default)]
struct Files(BTreeMap<PathBuf, (Vec<u8>, i32)>);

impl Files {
    fn add(&mut self, path: &str, data: Vec<u8>, mode: i32) -> Result<()> {
        // The API server validates these paths; check again, since they are joined to a host path.
        let p = Path::new(path);
        if p.components().any(|c| !matches!(c, Component::Normal(_))) || path.is_empty() {
            bail!("the file path {path:?} must be relative and stay inside the volume");
        }
        self.0.insert(p.to_path_buf(), (data, mode));
        Ok(())
    }

    /// Writes the files, replacing what the directory held (updates land whole: each file is
    /// written aside and renamed, so a reader sees the old content or the new).
    fn write(self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (rel, (data, mode)) in &self.0 {
            let path = dir.join(rel);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
            }
            let tmp = path.with_extension("tensorfleet-tmp");
            std::fs::write(&tmp, data).with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(*mode as u32 & 0o7777))
                .with_context(|| format!("setting the mode of {}", tmp.display()))?;
            std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

/// Adds `data`'s keys (all, or `items` with their paths and modes) to `out`.
fn add_keys(
    what: &str,
    data: BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
    mode: i32,
    out: &mut Files,
) -> Result<()> {
    match items {
        None => {
            for (key, value) in data {
                out.add(&key, value, mode)?;
            }
        }
        Some(items) => {
            for item in items {
                let value = data.get(&item.key).with_context(|| format!("{what} has no key {:?}", item.key))?;
                out.add(&item.path, value.clone(), item.mode.unwrap_or(mode))?;
            }
        }
    }
    Ok(())
}

async fn config_map_files(
    client: &Client,
    ns: &str,
    name: &str,
    items: Option<&[KeyToPath]>,
    mode: i32,
    optional: Option<bool>,
    out: &mut Files,
) -> Result<()> {
    let what = format!("ConfigMap {ns}/{name}");
    let Some(cm) = Api::<ConfigMap>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .with_context(|| format!("reading {what}"))?
    else {
        if optional == Some(true) {
            return Ok(());
        }
        bail!("{what} does not exist");
    };
    let mut data: BTreeMap<String, Vec<u8>> =
        cm.data.unwrap_or_default().into_iter().map(|(k, v)| (k, v.into_bytes())).collect();
    data.extend(cm.binary_data.unwrap_or_default().into_iter().map(|(k, v)| (k, v.0)));
    add_keys(&what, data, items, mode, out)
}

async fn secret_files(
    client: &Client,
    ns: &str,
    name: &str,
    items: Option<&[KeyToPath]>,
    mode: i32,
    optional: Option<bool>,
    out: &mut Files,
) -> Result<()> {
    let what = format!("Secret {ns}/{name}");
    let Some(secret) =
        Api::<Secret>::namespaced(client.clone(), ns).get_opt(name).await.with_context(|| format!("reading {what}"))?
    else {
        if optional == Some(true) {
            return Ok(());
        }
        bail!("{what} does not exist");
    };
    let mut data: BTreeMap<String, Vec<u8>> =
        secret.data.unwrap_or_default().into_iter().map(|(k, v)| (k, v.0)).collect();
    data.extend(secret.string_data.unwrap_or_default().into_iter().map(|(k, v)| (k, v.into_bytes())));
    add_keys(&what, data, items, mode, out)
}

fn downward_file(pod: &Pod, item: &DownwardAPIVolumeFile, mode: i32, out: &mut Files) -> Result<()> {
    let field = item.field_ref.as_ref().with_context(|| {
        format!("downward API file {:?}: only fieldRef is supported (resourceFieldRef is not)", item.path)
    })?;
    let value = crate::pods::field_value(pod, &field.field_path)?;
    out.add(&item.path, value.into_bytes(), item.mode.unwrap_or(mode))
}

/// A token for the pod's service account, bound to the pod (TokenRequest, as the kubelet asks).
async fn service_account_token(
    client: &Client,
    pod: &Pod,
    audience: Option<String>,
    expiration_seconds: Option<i64>,
) -> Result<String> {
    let ns = pod.namespace().unwrap_or_default();
    let sa = pod.spec.as_ref().and_then(|s| s.service_account_name.clone()).unwrap_or_else(|| "default".into());
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: audience.into_iter().collect(),
            expiration_seconds,
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.name_any()),
                uid: pod.uid(),
            }),
        },
        ..TokenRequest::default()
    };
    let api = Api::<ServiceAccount>::namespaced(client.clone(), &ns);
    let granted: TokenRequest = api
        .create_subresource("token", &sa, &PostParams::default(), &request)
        .await
        .with_context(|| format!("requesting a token for ServiceAccount {ns}/{sa}"))?;
    granted.status.map(|s| s.token).context("the TokenRequest came back without a token")
}

/// The host directory of the PersistentVolume bound to claim `ns/name`.
async fn claim_path(client: &Client, ns: &str, name: &str) -> Result<PathBuf> {
    let claim = Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .with_context(|| format!("reading PersistentVolumeClaim {ns}/{name}"))?
        .with_context(|| format!("PersistentVolumeClaim {ns}/{name} does not exist"))?;
    let volume = claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|_| claim.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
        .with_context(|| format!("PersistentVolumeClaim {ns}/{name} is not bound yet"))?;
    let pv = Api::<PersistentVolume>::all(client.clone())
        .get(&volume)
        .await
        .with_context(|| format!("reading PersistentVolume {volume}"))?;
    let spec = pv.spec.as_ref().with_context(|| format!("PersistentVolume {volume} has no spec"))?;
    let path = spec
        .host_path
        .as_ref()
        .map(|h| h.path.clone())
        .or_else(|| spec.local.as_ref().map(|l| l.path.clone()))
        .with_context(|| {
            format!("PersistentVolume {volume} is neither hostPath nor local: this node cannot mount it")
        })?;
    Ok(PathBuf::from(path))
}
