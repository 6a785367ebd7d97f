//! The pod network: one Linux bridge on the host, and per pod a network namespace joined to it by
//! a veth pair, with an address from the pod range. The bridge also carries the node's address
//! (the gateway) and the `kubernetes` Service's ClusterIP, where the API proxy listens.
//! Everything is done with iproute2's `ip`, the tool an operator would use by hand.

use anyhow::{bail, Context, Result};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use tokio::process::Command;

/// The bridge's fixed, locally administered MAC address ("tf" in its second and third bytes).
const BRIDGE_MAC: &str = "02:74:66:00:00:01";

pub struct Network {
    pub bridge: String,
    /// The bridge's address: the pods' default gateway and the node's InternalIP.
    pub gateway: Ipv4Addr,
    pub prefix_len: u8,
    /// The next address to try; addresses are handed out in a cycle so a pod's old address is
    /// not given to a new pod while names may still point at it.
    next: u32,
    in_use: std::collections::HashSet<Ipv4Addr>,
    /// Counter for veth names (interface names are limited to 15 bytes).
    next_link: u32,
}

/// A pod's network namespace and address.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub netns: String,
    pub ip: Ipv4Addr,
}

impl Sandbox {
    pub fn netns_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.netns)
    }
}

async fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().await.context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

async fn link_exists(name: &str) -> bool {
    Command::new("ip").args(["link", "show", name]).output().await.is_ok_and(|o| o.status.success())
}

impl Network {
    /// Creates the bridge (or takes the one there) with the gateway and the service address.
    pub async fn ensure(bridge: &str, cidr: &str, service_ip: Ipv4Addr) -> Result<Network> {
        let (addr, prefix) = cidr.split_once('/').with_context(|| format!("--pod-cidr {cidr}: not ADDRESS/PREFIX"))?;
        let base: Ipv4Addr = addr.parse().with_context(|| format!("--pod-cidr {cidr}"))?;
        let prefix_len: u8 = prefix.parse().with_context(|| format!("--pod-cidr {cidr}"))?;
        if !(8..=30).contains(&prefix_len) {
            bail!("--pod-cidr {cidr}: the prefix must be between 8 and 30");
        }
        let gateway = Ipv4Addr::from(u32::from(base) + 1);
        if !link_exists(bridge).await {
            ip(&["link", "add", bridge, "type", "bridge"]).await?;
        }
        // A bridge without an address of its own takes the lowest of its ports', so it would
        // change as pods come and go, and every pod's ARP entry for the gateway (and the API
        // proxy behind it) would point nowhere for half a minute. Found when the operator lost
        // its Lease each time a job's pods were deleted.
        ip(&["link", "set", bridge, "address", BRIDGE_MAC]).await?;
        ip(&["addr", "replace", &format!("{gateway}/{prefix_len}"), "dev", bridge]).await?;
        ip(&["addr", "replace", &format!("{service_ip}/32"), "dev", bridge]).await?;
        ip(&["link", "set", bridge, "up"]).await?;
        Ok(Network {
            bridge: bridge.to_string(),
            gateway,
            prefix_len,
            next: u32::from(gateway) + 1,
            in_use: Default::default(),
            next_link: 0,
        })
    }

    fn allocate(&mut self) -> Result<Ipv4Addr> {
        let mask = u32::MAX << (32 - self.prefix_len);
        let network = u32::from(self.gateway) & mask;
        let size = !mask;
        for _ in 0..size {
            let candidate = self.next;
            self.next = if (self.next + 1) & !mask >= size { network + 2 } else { self.next + 1 };
            let ip = Ipv4Addr::from(candidate);
            if candidate != u32::from(self.gateway) && self.in_use.insert(ip) {
                return Ok(ip);
            }
        }
        bail!("the pod range {}/{} is full", Ipv4Addr::from(network), self.prefix_len)
    }

    /// A new namespace `netns` with lo and eth0 up, eth0 on the bridge with a fresh address.
    pub async fn create(&mut self, netns: &str) -> Result<Sandbox> {
        let ip_addr = self.allocate()?;
        let sandbox = Sandbox { netns: netns.to_string(), ip: ip_addr };
        let result = self.plumb(&sandbox).await;
        if let Err(e) = result {
            self.delete(&sandbox).await;
            return Err(e.context(format!("creating the network namespace {netns}")));
        }
        Ok(sandbox)
    }

    async fn plumb(&mut self, s: &Sandbox) -> Result<()> {
        self.next_link += 1;
        let host_end = format!("tfh{}", self.next_link);
        let pod_end = format!("tfp{}", self.next_link);
        ip(&["netns", "add", &s.netns]).await?;
        ip(&["link", "add", &host_end, "type", "veth", "peer", "name", &pod_end]).await?;
        ip(&["link", "set", &pod_end, "netns", &s.netns]).await?;
        ip(&["-n", &s.netns, "link", "set", &pod_end, "name", "eth0"]).await?;
        ip(&["-n", &s.netns, "addr", "add", &format!("{}/{}", s.ip, self.prefix_len), "dev", "eth0"]).await?;
        ip(&["-n", &s.netns, "link", "set", "lo", "up"]).await?;
        ip(&["-n", &s.netns, "link", "set", "eth0", "up"]).await?;
        ip(&["link", "set", &host_end, "master", &self.bridge, "up"]).await?;
        ip(&["-n", &s.netns, "route", "add", "default", "via", &self.gateway.to_string()]).await?;
        Ok(())
    }

    /// Deletes the namespace (which takes its veth pair along) and frees the address.
    pub async fn delete(&mut self, s: &Sandbox) {
        if let Err(e) = ip(&["netns", "delete", &s.netns]).await {
            tracing::debug!("{e:#}");
        }
        self.in_use.remove(&s.ip);
    }
}

/// Deletes the namespaces a previous agent left behind (their names start with `prefix`).
pub async fn delete_leftovers(prefix: &str) {
    let Ok(entries) = std::fs::read_dir("/run/netns") else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(prefix) {
            let _ = ip(&["netns", "delete", &name]).await;
        }
    }
}
