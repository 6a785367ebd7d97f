//! Images without a container runtime: an image is the host's filesystem with the image's own
//! programs in /usr/local/bin (where the Dockerfile puts them), plus its ENTRYPOINT and CMD.
//! The images file names each image the cluster may run (`e2e/cluster/images.yaml`):
//!
//! ```yaml
//! tensorfleet/worker:
//!   programs: [tensorfleet-worker]     # copied from --programs into the image's /usr/local/bin
//!   cmd: [tensorfleet-worker, --help]
//! ```

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where an image's programs are mounted in its containers.
pub const PROGRAM_DIR: &str = "/usr/local/bin";
/// The PATH of the images (Debian's), which a container's env may override.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ImageFile {
    #[serde(default)]
    programs: Vec<String>,
    #[serde(default)]
    entrypoint: Vec<String>,
    #[serde(default)]
    cmd: Vec<String>,
}

#[derive(Debug)]
pub struct Image {
    /// The directory mounted at PROGRAM_DIR.
    pub programs: PathBuf,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

pub struct Images {
    by_repository: BTreeMap<String, Image>,
    source: PathBuf,
}

impl Images {
    /// Reads the images file and copies each image's programs from `programs` under `state`
    /// (a copy, so a rebuild does not change what running pods execute).
    pub fn load(file: &Path, programs: &Path, state: &Path) -> Result<Images> {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading the images file {}", file.display()))?;
        let parsed: BTreeMap<String, ImageFile> =
            serde_yaml::from_str(&text).with_context(|| format!("parsing the images file {}", file.display()))?;
        let mut by_repository = BTreeMap::new();
        for (repository, spec) in parsed {
            let dir = state.join("images").join(repository.replace('/', "_")).join("bin");
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for program in &spec.programs {
                let from = programs.join(program);
                if !from.is_file() {
                    bail!("{}: image {repository} needs {}, which is not built", file.display(), from.display());
                }
                let to = dir.join(program);
                // A running pod may be executing the old copy: replace, don't overwrite.
                let tmp = dir.join(format!(".{program}.tmp"));
                std::fs::copy(&from, &tmp).with_context(|| format!("copying {}", from.display()))?;
                std::fs::rename(&tmp, &to).with_context(|| format!("installing {}", to.display()))?;
            }
            by_repository.insert(repository, Image { programs: dir, entrypoint: spec.entrypoint, cmd: spec.cmd });
        }
        Ok(Images { by_repository, source: file.to_path_buf() })
    }

    /// The image a pod names (`repo[:tag][@digest]`, optionally `docker.io/`-prefixed).
    pub fn resolve(&self, reference: &str) -> Result<&Image> {
        let repository = repository(reference);
        self.by_repository.get(repository).with_context(|| {
            let known: Vec<&str> = self.by_repository.keys().map(String::as_str).collect();
            format!(
                "image {reference:?} is not one this node can run (the images file {} lists {})",
                self.source.display(),
                known.join(", ")
            )
        })
    }
}

/// `docker.io/tensorfleet/worker:0.1.0@sha256:…` → `tensorfleet/worker`.
fn repository(reference: &str) -> &str {
    let without_digest = reference.split('@').next().unwrap_or(reference);
    let last_slash = without_digest.rfind('/').map_or(0, |i| i + 1);
    let without_tag = match without_digest[last_slash..].find(':') {
        Some(colon) => &without_digest[..last_slash + colon],
        None => without_digest,
    };
    without_tag.strip_prefix("docker.io/").unwrap_or(without_tag)
}

/// The container's argv, by Kubernetes' rules: `command` replaces the ENTRYPOINT, `args` the
/// CMD, and a `command` without `args` drops the CMD.
pub fn argv(image: &Image, command: &[String], args: Option<&[String]>) -> Vec<String> {
    let mut argv = if command.is_empty() { image.entrypoint.clone() } else { command.to_vec() };
    match args {
        Some(args) => argv.extend(args.iter().cloned()),
        None if command.is_empty() => argv.extend(image.cmd.iter().cloned()),
        None => {}
    }
    argv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_reduce_to_the_repository() {
        assert_eq!(repository("tensorfleet/worker:0.1.0"), "tensorfleet/worker");
        assert_eq!(repository("docker.io/tensorfleet/worker@sha256:abc"), "tensorfleet/worker");
        assert_eq!(repository("registry:5000/team/worker:1"), "registry:5000/team/worker");
        assert_eq!(repository("busybox"), "busybox");
    }

    #[test]
    fn command_and_args_follow_kubernetes() {
        let image = Image { programs: PathBuf::new(), entrypoint: vec!["/e".into()], cmd: vec!["c".into()] };
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(argv(&image, &[], None), s(&["/e", "c"]));
        assert_eq!(argv(&image, &[], Some(&s(&["a"]))), s(&["/e", "a"]));
        assert_eq!(argv(&image, &s(&["x"]), None), s(&["x"]));
        assert_eq!(argv(&image, &s(&["x"]), Some(&s(&["a"]))), s(&["x", "a"]));
    }
}
