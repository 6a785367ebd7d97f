//! Cluster DNS without a DNS server: each pod's /etc/hosts holds its own name (as the kubelet
//! writes it) and the names of every headless Service's ready endpoints, read from the
//! EndpointSlices the controller-manager maintains. So `<pod>.<service>.<ns>.svc` resolves in a
//! pod exactly while the pod is ready, as with CoreDNS, and stops resolving when it goes.
//!
//! The files are bind-mounted into running containers, so they are rewritten in place. A reader
//! must never see half of an update: each write is one `pwrite` from offset 0, and content shorter
//! than the file is padded with a comment instead of truncating.

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::Api;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The cluster domain of every name.
pub const CLUSTER_DOMAIN: &str = "cluster.local";

/// One hosts line: an address and its names.
type Record = (String, Vec<String>);

#[derive(Default)]
pub struct Dns {
    /// By EndpointSlice (`ns/name`).
    slices: BTreeMap<String, Vec<Record>>,
    /// The hosts file of each running pod (by uid) and the pod's own lines.
    pods: HashMap<String, (PathBuf, String)>,
}

pub type SharedDns = Arc<Mutex<Dns>>;

impl Dns {
    /// Starts keeping `path` up to date for pod `uid`, whose own lines are `own`.
    pub fn add_pod(&mut self, uid: &str, path: PathBuf, own: String) -> Result<()> {
        write_padded(&path, &self.render(&own))?;
        self.pods.insert(uid.to_string(), (path, own));
        Ok(())
    }

    pub fn remove_pod(&mut self, uid: &str) {
        self.pods.remove(uid);
    }

    fn set_slice(&mut self, key: String, records: Vec<Record>) {
        let changed = if records.is_empty() {
            self.slices.remove(&key).is_some()
        } else {
            self.slices.insert(key, records.clone()).as_ref() != Some(&records)
        };
        if changed {
            self.rewrite();
        }
    }

    fn rewrite(&self) {
        for (path, own) in self.pods.values() {
            if let Err(e) = write_padded(path, &self.render(own)) {
                tracing::warn!("{e:#}");
            }
        }
    }

    fn render(&self, own: &str) -> String {
        let mut text =
            String::from("# Written by tensorfleet-node-agent: this pod and the cluster's headless Services.\n");
        text.push_str("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n");
        text.push_str(own);
        for records in self.slices.values() {
            for (ip, names) in records {
                text.push_str(&format!("{ip}\t{}\n", names.join(" ")));
            }
        }
        text
    }
}

/// The lines the kubelet writes for the pod itself.
pub fn own_lines(ip: &str, hostname: &str, subdomain: Option<&str>, namespace: &str) -> String {
    match subdomain {
        Some(sub) => format!(
            "{ip}\t{hostname}.{sub}.{namespace}.svc.{CLUSTER_DOMAIN} {hostname}.{sub}.{namespace}.svc {hostname}\n"
        ),
        None => format!("{ip}\t{hostname}\n"),
    }
}

fn write_padded(path: &PathBuf, content: &str) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let old_len = file.metadata().map(|m| m.len() as usize).unwrap_or(0);
    let mut bytes = content.as_bytes().to_vec();
    if bytes.len() < old_len {
        // "#" + spaces + "\n": a comment line as long as what it covers.
        let pad = old_len - bytes.len();
        bytes.push(b'#');
        bytes.extend(std::iter::repeat_n(b' ', pad.saturating_sub(2)));
        if pad >= 2 {
            bytes.push(b'\n');
        }
    }
    file.write_all_at(&bytes, 0).with_context(|| format!("writing {}", path.display()))
}

/// The hosts lines of one headless Service's slice: each ready endpoint with a hostname gets
/// `<hostname>.<service>.<ns>.svc[.cluster.local]`, and the Service's name resolves to them all.
fn records(slice: &EndpointSlice) -> Vec<Record> {
    let ns = slice.namespace().unwrap_or_default();
    let Some(service) = slice.labels().get("kubernetes.io/service-name").cloned() else { return vec![] };
    let mut out = Vec::new();
    for endpoint in &slice.endpoints {
        let ready = endpoint.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
        if !ready {
            continue;
        }
        for ip in &endpoint.addresses {
            let mut names = Vec::new();
            if let Some(host) = &endpoint.hostname {
                names.push(format!("{host}.{service}.{ns}.svc.{CLUSTER_DOMAIN}"));
                names.push(format!("{host}.{service}.{ns}.svc"));
            }
            names.push(format!("{service}.{ns}.svc.{CLUSTER_DOMAIN}"));
            names.push(format!("{service}.{ns}.svc"));
            out.push((ip.clone(), names));
        }
    }
    out
}

/// Follows the headless Services' EndpointSlices in all namespaces.
pub async fn run(client: Client, dns: SharedDns) -> Result<()> {
    use kube::runtime::WatchStreamExt;
    let slices = Api::<EndpointSlice>::all(client);
    let config = watcher::Config::default().labels("service.kubernetes.io/headless");
    let mut events = watcher(slices, config).default_backoff().boxed();
    let mut seen_in_resync: Option<Vec<String>> = None;
    while let Some(event) = events.next().await {
        let key = |s: &EndpointSlice| format!("{}/{}", s.namespace().unwrap_or_default(), s.name_any());
        match event {
            Ok(watcher::Event::Apply(s)) => dns.lock().unwrap().set_slice(key(&s), records(&s)),
            Ok(watcher::Event::Delete(s)) => dns.lock().unwrap().set_slice(key(&s), vec![]),
            Ok(watcher::Event::Init) => seen_in_resync = Some(vec![]),
            Ok(watcher::Event::InitApply(s)) => {
                seen_in_resync.get_or_insert_with(Vec::new).push(key(&s));
                dns.lock().unwrap().set_slice(key(&s), records(&s));
            }
            Ok(watcher::Event::InitDone) => {
                // Slices deleted while the watch was down.
                let seen = seen_in_resync.take().unwrap_or_default();
                let mut d = dns.lock().unwrap();
                let gone: Vec<String> = d.slices.keys().filter(|k| !seen.contains(k)).cloned().collect();
                for k in gone {
                    d.set_slice(k, vec![]);
                }
            }
            Err(e) => tracing::warn!("watching EndpointSlices: {e}"),
        }
    }
    Ok(())
}
