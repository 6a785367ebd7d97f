//! The Nodes this agent plays the kubelet for: registered with their capacity (cpu, memory,
//! pods, `nvidia.com/gpu`), kept Ready by a heartbeat on their Lease in `kube-node-lease` and a
//! refresh of their Ready condition, so the node lifecycle controller never taints them.

use anyhow::{Context, Result};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeCondition, NodeSpec, NodeStatus, NodeSystemInfo};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::Client;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Duration;

/// The field manager of everything the agent writes.
pub const MANAGER: &str = "tensorfleet-node-agent";
/// How often the Lease is renewed (the kubelet's default) and the Ready condition refreshed.
const LEASE_RENEW: Duration = Duration::from_secs(10);
const LEASE_SECONDS: i32 = 40;

/// One node from `--node NAME[,cpu=N][,memory=Q][,gpu=N][,pods=N]`.
#[derive(Debug, Clone)]
pub struct NodeSpecArg {
    pub name: String,
    pub capacity: BTreeMap<String, String>,
}

impl std::str::FromStr for NodeSpecArg {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let mut parts = s.split(',');
        let name = parts.next().filter(|n| !n.is_empty()).ok_or("--node needs a name first")?.to_string();
        let mut capacity = BTreeMap::from([
            ("cpu".to_string(), "8".to_string()),
            ("memory".to_string(), "16Gi".to_string()),
            ("pods".to_string(), "110".to_string()),
            ("ephemeral-storage".to_string(), "100Gi".to_string()),
        ]);
        for part in parts {
            let (key, value) = part.split_once('=').ok_or_else(|| format!("--node {s}: {part:?} is not KEY=VALUE"))?;
            let key = match key {
                "cpu" | "memory" | "pods" => key,
                "gpu" => "nvidia.com/gpu",
                other => return Err(format!("--node {s}: unknown key {other:?} (cpu, memory, gpu, pods)")),
            };
            capacity.insert(key.to_string(), value.to_string());
        }
        Ok(NodeSpecArg { name, capacity })
    }
}

fn now() -> Time {
    Time(Timestamp::now())
}

fn ready_condition() -> NodeCondition {
    NodeCondition {
        type_: "Ready".into(),
        status: "True".into(),
        reason: Some("KubeletReady".into()),
        message: Some("tensorfleet-node-agent is posting ready status".into()),
        last_heartbeat_time: Some(now()),
        last_transition_time: Some(now()),
    }
}

fn node_object(spec: &NodeSpecArg, address: Ipv4Addr, kubelet_port: i32) -> Node {
    let capacity: BTreeMap<String, Quantity> =
        spec.capacity.iter().map(|(k, v)| (k.clone(), Quantity(v.clone()))).collect();
    let gpus = spec.capacity.get("nvidia.com/gpu").is_some_and(|g| g != "0");
    let mut labels = BTreeMap::from([
        ("kubernetes.io/hostname".to_string(), spec.name.clone()),
        ("kubernetes.io/os".to_string(), "linux".to_string()),
        ("kubernetes.io/arch".to_string(), "amd64".to_string()),
        ("tensorfleet.dev/node-agent".to_string(), "true".to_string()),
    ]);
    if gpus {
        labels.insert("nvidia.com/gpu.present".into(), "true".into());
    }
    Node {
        metadata: ObjectMeta { name: Some(spec.name.clone()), labels: Some(labels), ..ObjectMeta::default() },
        spec: Some(NodeSpec::default()),
        status: Some(NodeStatus {
            capacity: Some(capacity.clone()),
            allocatable: Some(capacity),
            conditions: Some(vec![ready_condition()]),
            addresses: Some(vec![
                NodeAddress { type_: "InternalIP".into(), address: address.to_string() },
                NodeAddress { type_: "Hostname".into(), address: spec.name.clone() },
            ]),
            daemon_endpoints: Some(k8s_openapi::api::core::v1::NodeDaemonEndpoints {
                kubelet_endpoint: Some(k8s_openapi::api::core::v1::DaemonEndpoint { port: kubelet_port }),
            }),
            node_info: Some(NodeSystemInfo {
                architecture: "amd64".into(),
                operating_system: "linux".into(),
                kubelet_version: "v1.34.4".into(),
                kube_proxy_version: String::new(),
                container_runtime_version: "tensorfleet-node-agent://0.1.0".into(),
                os_image: "Debian GNU/Linux (tensorfleet node agent)".into(),
                kernel_version: std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().into(),
                ..NodeSystemInfo::default()
            }),
            ..NodeStatus::default()
        }),
    }
}

/// Creates or updates the Nodes, then keeps them alive until the task is dropped.
pub async fn run(client: Client, nodes: Vec<NodeSpecArg>, address: Ipv4Addr, kubelet_port: i32) -> Result<()> {
    let api = Api::<Node>::all(client.clone());
    let pp = PatchParams::apply(MANAGER).force();
    for spec in &nodes {
        let node = node_object(spec, address, kubelet_port);
        let mut meta_and_spec = node.clone();
        meta_and_spec.status = None;
        api.patch(&spec.name, &pp, &Patch::Apply(&meta_and_spec))
            .await
            .with_context(|| format!("registering Node {}", spec.name))?;
        api.patch_status(&spec.name, &pp, &Patch::Apply(&node))
            .await
            .with_context(|| format!("Node {} status", spec.name))?;
    }
    let leases = Api::<Lease>::namespaced(client.clone(), "kube-node-lease");
    let mut tick = tokio::time::interval(LEASE_RENEW);
    loop {
        tick.tick().await;
        for spec in &nodes {
            // The whole status each time: with server-side apply, a field left out is given up.
            let node = node_object(spec, address, kubelet_port);
            if let Err(e) = heartbeat(&api, &leases, &node, spec, &pp).await {
                tracing::warn!(node = %spec.name, "heartbeat failed: {e:#}");
            }
        }
    }
}

async fn heartbeat(
    nodes: &Api<Node>,
    leases: &Api<Lease>,
    node: &Node,
    spec: &NodeSpecArg,
    pp: &PatchParams,
) -> Result<()> {
    let lease = Lease {
        metadata: ObjectMeta { name: Some(spec.name.clone()), ..ObjectMeta::default() },
        spec: Some(LeaseSpec {
            holder_identity: Some(spec.name.clone()),
            lease_duration_seconds: Some(LEASE_SECONDS),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..LeaseSpec::default()
        }),
    };
    leases.patch(&spec.name, pp, &Patch::Apply(&lease)).await.context("renewing the Lease")?;
    nodes.patch_status(&spec.name, pp, &Patch::Apply(node)).await.context("refreshing the Ready condition")?;
    Ok(())
}
