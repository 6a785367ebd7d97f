//! `tensorfleet-node-agent`: the kubelet (and a local-path provisioner) of the local end-to-end
//! cluster. It registers Nodes, runs the pods bound to them as isolated processes on this
//! machine, and reports them, so the real operator, sshd, mpirun and worker can take a
//! TrainingJob from `kubectl apply` to Succeeded without a container runtime. Runs as root
//! (network namespaces, mounts). See e2e/README.md.
//!
//!   tensorfleet-node-agent --kubeconfig KC --state DIR --images e2e/cluster/images.yaml \
//!       --programs target/release --node tf-node-0,cpu=8,memory=16Gi --node tf-gpu-0,gpu=2
//!   tensorfleet-node-agent container SPEC.json     # the container shim (internal)

mod apiproxy;
mod container;
mod dns;
mod images;
mod network;
mod node;
mod pods;
mod probes;
mod provisioner;
mod volumes;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kube::config::{KubeConfigOptions, Kubeconfig};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(name = "tensorfleet-node-agent", version, about = "Plays the kubelet for the local end-to-end cluster")]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// The admin kubeconfig of the control plane.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Where pods, volumes, logs and image copies live.
    #[arg(long)]
    state: Option<PathBuf>,
    /// The images this node can run (YAML; see e2e/cluster/images.yaml).
    #[arg(long)]
    images: Option<PathBuf>,
    /// Where the images' programs are built (target/release).
    #[arg(long)]
    programs: Option<PathBuf>,
    /// A node to register: NAME[,cpu=N][,memory=Q][,gpu=N][,pods=N]; repeat for more.
    #[arg(long = "node", required = false)]
    nodes: Vec<node::NodeSpecArg>,
    /// The bridge the pods are attached to.
    #[arg(long, default_value = "tf0")]
    bridge: String,
    /// The pods' addresses; the first is the bridge's (the gateway and the nodes' InternalIP).
    #[arg(long, default_value = "10.244.0.0/16")]
    pod_cidr: String,
    /// The `kubernetes` Service's ClusterIP (the first of the API server's service range).
    #[arg(long, default_value = "10.0.0.1")]
    service_ip: Ipv4Addr,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run one container (the agent starts this; not for people).
    Container { spec: PathBuf },
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Command::Container { spec }) = &args.command {
        return match container::main(spec) {
            Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
            Err(e) => {
                eprintln!("tensorfleet-node-agent container: {e:#}");
                ExitCode::from(128)
            }
        };
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    // One thread: the containers' shims die with the thread that started them (PDEATHSIG), so
    // every spawn must come from a thread that lives as long as the agent.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime");
    match runtime.block_on(agent(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::from(1)
        }
    }
}

async fn agent(args: Args) -> Result<()> {
    let need = |v: Option<PathBuf>, flag: &str| v.with_context(|| format!("--{flag} is required"));
    let kubeconfig_path = need(args.kubeconfig, "kubeconfig")?;
    let state = need(args.state, "state")?;
    let images_file = need(args.images, "images")?;
    let programs = need(args.programs, "programs")?;
    anyhow::ensure!(!args.nodes.is_empty(), "at least one --node is required");

    let kubeconfig =
        Kubeconfig::read_from(&kubeconfig_path).with_context(|| format!("reading {}", kubeconfig_path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    let upstream = format!(
        "{}:{}",
        config.cluster_url.host().context("the kubeconfig's server has no host")?,
        config.cluster_url.port_u16().unwrap_or(443)
    );
    let client = kube::Client::try_from(config)?;

    std::fs::create_dir_all(&state).with_context(|| format!("creating {}", state.display()))?;
    let state = state.canonicalize()?;
    let images = images::Images::load(&images_file, &programs, &state)?;
    network::delete_leftovers(pods::NETNS_PREFIX).await;
    let network = network::Network::ensure(&args.bridge, &args.pod_cidr, args.service_ip).await?;
    let gateway = network.gateway;
    let dns = dns::SharedDns::default();
    let shim = std::env::current_exe().context("the agent's own path")?;
    let node_names = args.nodes.iter().map(|n| n.name.clone()).collect();
    tracing::info!(
        "nodes {:?} on bridge {} ({}), pods in {}",
        args.nodes.iter().map(|n| &n.name).collect::<Vec<_>>(),
        args.bridge,
        args.pod_cidr,
        state.display()
    );

    let pod_config = pods::Config {
        client: client.clone(),
        nodes: node_names,
        state: state.join("pods"),
        images,
        network,
        dns: dns.clone(),
        shim,
        service_ip: args.service_ip,
    };
    let api_proxy = SocketAddr::from((args.service_ip, 443));
    tokio::select! {
        r = node::run(client.clone(), args.nodes, gateway, 10250) => r.context("nodes"),
        r = provisioner::run(client.clone(), state.join("volumes")) => r.context("provisioner"),
        r = dns::run(client.clone(), dns) => r.context("dns"),
        r = apiproxy::run(api_proxy, upstream) => r.context("API proxy"),
        r = pods::run(pod_config) => r.context("pods"),
        _ = shutdown() => Ok(()),
    }
}

async fn shutdown() {
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down: the containers go with the agent");
}
