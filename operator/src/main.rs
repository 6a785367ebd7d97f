//! `tensorfleet-operator`: watches TrainingJobs (in all namespaces or the listed ones) and
//! reconciles each into its Secret, ConfigMap, Service, claim, worker pods and launcher pod.

use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use kube::api::Api;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::{watcher, Controller};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tensorfleet_operator::controller::{self, Context};
use tensorfleet_operator::crd::TrainingJob;
use tensorfleet_operator::leader::LeaderElection;
use tensorfleet_operator::metrics::Metrics;
use tensorfleet_operator::resources::network_policy::OperatorPods;
use tensorfleet_operator::resources::{labels, FIELD_MANAGER};
use tensorfleet_operator::server::{self, Health};

/// The Kubernetes controller of tensorfleet: turns TrainingJob objects into MPI-launched
/// tensorfleet-worker pods.
#[derive(Parser, Debug)]
#[command(name = "tensorfleet-operator", version)]
struct Args {
    /// Namespaces to watch, comma-separated; empty watches all of them.
    #[arg(long, env = "TENSORFLEET_NAMESPACES", value_delimiter = ',', default_value = "")]
    namespaces: Vec<String>,
    /// Take part in leader election, so only one replica reconciles at a time.
    #[arg(long, env = "TENSORFLEET_LEADER_ELECT")]
    leader_elect: bool,
    /// The Lease that elects the leader.
    #[arg(long, default_value = "tensorfleet-operator")]
    lease_name: String,
    /// Namespace of the Lease (the operator's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Labels that select this operator's pods (key=value,…): the jobs' NetworkPolicies admit
    /// them, in the namespace above, to rank 0's progress port. Unset outside the cluster.
    #[arg(long, env = "TENSORFLEET_POD_SELECTOR")]
    pod_selector: Option<String>,
    /// This replica's name in the Lease.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds a Lease lasts without renewal.
    #[arg(long, default_value_t = 15)]
    lease_duration: u64,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "TENSORFLEET_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Log format: text or json.
    #[arg(long, env = "TENSORFLEET_LOG_FORMAT", default_value = "text")]
    log_format: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    init_tracing(&args.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tensorfleet-operator: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

async fn run(args: Args) -> Result<(), String> {
    let operator_pods = match &args.pod_selector {
        Some(selector) => Some(
            OperatorPods::parse(&args.lease_namespace, selector)
                .map_err(|e| format!("--pod-selector (TENSORFLEET_POD_SELECTOR): {e}"))?,
        ),
        None => None,
    };
    let metrics = Arc::new(Metrics::default());
    let config =
        kube::Config::infer().await.map_err(|e| format!("finding the API server (kubeconfig or in-cluster): {e}"))?;
    let counted = metrics.clone();
    let count_requests = tower::util::MapRequestLayer::new(move |request: http::Request<kube::client::Body>| {
        counted.api_request(request.method().as_str());
        request
    });
    let client = kube::client::ClientBuilder::try_from(config)
        .map_err(|e| format!("configuring the API client: {e}"))?
        .with_layer(&count_requests)
        .build();
    let health = Arc::new(Health::default());
    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|e| format!("listening on {} (--http-addr): {e}", args.http_addr))?;
    tracing::info!(addr = %args.http_addr, "serving /metrics, /healthz and /readyz");
    tokio::spawn(server::serve(listener, metrics.clone(), health.clone()));

    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "tensorfleet-operator".into());
        format!("{host}-{}", std::process::id())
    });
    let election = args.leader_elect.then(|| {
        LeaderElection::new(
            client.clone(),
            &args.lease_namespace,
            &args.lease_name,
            &identity,
            Duration::from_secs(args.lease_duration),
        )
    });
    if let Some(election) = &election {
        // A standby is healthy and ready: it is doing what it should.
        health.ready.store(true, Ordering::Relaxed);
        election.acquire().await;
    }

    let reporter = Reporter { controller: FIELD_MANAGER.into(), instance: Some(identity) };
    let ctx = Arc::new(Context {
        client: client.clone(),
        recorder: Recorder::new(client.clone(), reporter),
        metrics,
        operator_pods,
    });
    let namespaces: Vec<Option<String>> = if args.namespaces.iter().all(String::is_empty) {
        vec![None]
    } else {
        args.namespaces.iter().filter(|n| !n.is_empty()).map(|n| Some(n.clone())).collect()
    };
    tracing::info!(namespaces = ?namespaces, "watching TrainingJobs");
    let children = watcher::Config::default().labels(&format!("{}={FIELD_MANAGER}", labels::MANAGED_BY));
    let controllers = namespaces.into_iter().map(|ns| {
        let api = |c: &kube::Client| -> (Api<TrainingJob>, Api<Pod>, Api<Service>, Api<ConfigMap>) {
            match &ns {
                Some(ns) => (
                    Api::namespaced(c.clone(), ns),
                    Api::namespaced(c.clone(), ns),
                    Api::namespaced(c.clone(), ns),
                    Api::namespaced(c.clone(), ns),
                ),
                None => (Api::all(c.clone()), Api::all(c.clone()), Api::all(c.clone()), Api::all(c.clone())),
            }
        };
        let (jobs, pods, services, configs) = api(&client);
        Controller::new(jobs, watcher::Config::default())
            .owns_stream(controller::pod_triggers(pods, children.clone()))
            .owns(services, children.clone())
            .owns(configs, children.clone())
            .shutdown_on_signal()
            .run(controller::reconcile, controller::error_policy, ctx.clone())
            .for_each(|result| async move {
                if let Err(e) = result {
                    tracing::debug!("reconcile: {e}");
                }
            })
    });
    let all = futures::future::join_all(controllers);
    health.ready.store(true, Ordering::Relaxed);
    match &election {
        Some(election) => {
            tokio::select! {
                _ = all => tracing::info!("shutting down"),
                _ = election.hold() => {
                    // Another replica leads now; exiting is the only safe way to stop reconciling.
                    return Err("lost the leader Lease".into());
                }
            }
            election.release().await;
        }
        None => {
            all.await;
            tracing::info!("shutting down");
        }
    }
    Ok(())
}
