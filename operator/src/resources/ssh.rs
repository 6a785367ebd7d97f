//! `<job>-ssh`: a key pair made for this job alone, authorized_keys, a host key, and the ssh and
//! sshd configs that use them from wherever the Secret is mounted, so images need no ssh setup.

use super::{child_meta, names};
use crate::crd::TrainingJob;
use k8s_openapi::api::core::v1::{KeyToPath, Secret, SecretVolumeSource, Volume};
use k8s_openapi::ByteString;
use ssh_key::{Algorithm, LineEnding, PrivateKey};
use std::collections::BTreeMap;

/// The Secret's keys and the file modes they are mounted with: ssh refuses private keys that
/// others can read, sshd refuses host keys and authorized_keys that others can write.
pub const FILES: [(&str, i32); 6] = [
    ("id_ed25519", 0o600),
    ("id_ed25519.pub", 0o644),
    ("authorized_keys", 0o644),
    ("ssh_host_ed25519_key", 0o600),
    ("config", 0o644),
    ("sshd_config", 0o644),
];

/// Generates the Secret. Called only when it does not exist yet: keys are made once per job.
pub fn secret(job: &TrainingJob) -> Result<Secret, ssh_key::Error> {
    let mut rng = rand_core::OsRng;
    let user = PrivateKey::random(&mut rng, Algorithm::Ed25519)?;
    let host = PrivateKey::random(&mut rng, Algorithm::Ed25519)?;
    let public = user.public_key().to_openssh()?;
    let dir = &job.spec.mpi.ssh_auth_mount_path;
    let port = job.spec.mpi.ssh_port;
    let client_config = format!(
        "# ssh config of TrainingJob {job}; mpirun passes it with -F.\n\
         Host *\n  Port {port}\n  IdentityFile {dir}/id_ed25519\n  StrictHostKeyChecking no\n\
         \x20 UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  ConnectTimeout 20\n  ServerAliveInterval 15\n",
        job = names::job(job),
    );
    // StrictModes is off because Secret volumes are symlink trees the kubelet owns; the modes
    // of the files themselves are set by the volume's items.
    let sshd_config = format!(
        "# sshd config of the worker pods of TrainingJob {job}.\n\
         Port {port}\nHostKey {dir}/ssh_host_ed25519_key\nAuthorizedKeysFile {dir}/authorized_keys\n\
         PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n\
         StrictModes no\nUsePAM no\nPidFile none\nPermitUserEnvironment no\nAcceptEnv OMPI_* TENSORFLEET_*\n",
        job = names::job(job),
    );
    let files: BTreeMap<String, String> = BTreeMap::from([
        ("id_ed25519".to_string(), user.to_openssh(LineEnding::LF)?.to_string()),
        ("id_ed25519.pub".to_string(), format!("{public}\n")),
        ("authorized_keys".to_string(), format!("{public}\n")),
        ("ssh_host_ed25519_key".to_string(), host.to_openssh(LineEnding::LF)?.to_string()),
        ("config".to_string(), client_config),
        ("sshd_config".to_string(), sshd_config),
    ]);
    Ok(Secret {
        metadata: child_meta(job, names::ssh_secret(job)),
        type_: Some("Opaque".into()),
        data: Some(files.into_iter().map(|(k, v)| (k, ByteString(v.into_bytes()))).collect()),
        ..Secret::default()
    })
}

/// The volume that mounts the Secret with each file's mode.
pub fn volume(job: &TrainingJob) -> Volume {
    Volume {
        name: "ssh".into(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(names::ssh_secret(job)),
            default_mode: Some(0o600),
            items: Some(
                FILES
                    .iter()
                    .map(|(key, mode)| KeyToPath { key: key.to_string(), path: key.to_string(), mode: Some(*mode) })
                    .collect(),
            ),
            optional: None,
        }),
        ..Volume::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::tests::job;

    #[test]
    fn keys_parse_and_authorize_each_other() {
        let j = job("llm", 2);
        let s = secret(&j).unwrap();
        let data = s.data.unwrap();
        let text = |k: &str| String::from_utf8(data[k].0.clone()).unwrap();
        let user = PrivateKey::from_openssh(text("id_ed25519")).unwrap();
        assert_eq!(format!("{}\n", user.public_key().to_openssh().unwrap()), text("authorized_keys"));
        PrivateKey::from_openssh(text("ssh_host_ed25519_key")).unwrap();
        assert!(text("config").contains("IdentityFile /etc/ssh/tensorfleet/id_ed25519"));
        assert!(text("sshd_config").contains("Port 2222"));
        for (key, _) in FILES {
            assert!(data.contains_key(key), "{key}");
        }
        // A second call makes a different pair: the controller must never regenerate.
        let again = secret(&j).unwrap().data.unwrap();
        assert_ne!(again["id_ed25519"], data["id_ed25519"]);
    }
}
