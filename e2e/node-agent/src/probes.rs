//! Readiness and liveness probes, run from the host against the pod's address (the host is on
//! the pod bridge): tcpSocket connects, httpGet expects a 2xx or 3xx status. Exec probes would
//! need to enter the container's namespaces and are not supported; a container that has one is
//! reported with a message saying so.

use k8s_openapi::api::core::v1::{Container, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The running count of one probe of one container.
#[derive(Debug, Default, Clone)]
pub struct ProbeState {
    last_run: Option<Instant>,
    successes: i32,
    failures: i32,
}

pub enum Verdict {
    /// Nothing changed (not due, or within the thresholds).
    Unchanged,
    Passed,
    Failed(String),
}

impl ProbeState {
    /// Runs `probe` if it is due; reports when the result crosses a threshold.
    pub async fn run(&mut self, probe: &Probe, container: &Container, ip: Ipv4Addr, started: Instant) -> Verdict {
        let now = Instant::now();
        let delay = Duration::from_secs(probe.initial_delay_seconds.unwrap_or(0).max(0) as u64);
        let period = Duration::from_secs(probe.period_seconds.unwrap_or(10).max(1) as u64);
        if now < started + delay || self.last_run.is_some_and(|t| now < t + period) {
            return Verdict::Unchanged;
        }
        self.last_run = Some(now);
        let timeout = Duration::from_secs(probe.timeout_seconds.unwrap_or(1).max(1) as u64);
        match tokio::time::timeout(timeout, check(probe, container, ip))
            .await
            .unwrap_or_else(|_| Err("timed out".into()))
        {
            Ok(()) => {
                self.failures = 0;
                self.successes += 1;
                if self.successes >= probe.success_threshold.unwrap_or(1) {
                    Verdict::Passed
                } else {
                    Verdict::Unchanged
                }
            }
            Err(e) => {
                self.successes = 0;
                self.failures += 1;
                if self.failures >= probe.failure_threshold.unwrap_or(3) {
                    Verdict::Failed(e)
                } else {
                    Verdict::Unchanged
                }
            }
        }
    }
}

/// A named port (`ports[].name`) or a number.
fn port(p: &IntOrString, container: &Container) -> Result<u16, String> {
    match p {
        IntOrString::Int(n) => u16::try_from(*n).map_err(|_| format!("port {n} is out of range")),
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|cp| cp.name.as_deref() == Some(name))
            .and_then(|cp| u16::try_from(cp.container_port).ok())
            .ok_or_else(|| format!("the container has no port named {name:?}")),
    }
}

async fn check(probe: &Probe, container: &Container, ip: Ipv4Addr) -> Result<(), String> {
    if let Some(tcp) = &probe.tcp_socket {
        let p = port(&tcp.port, container)?;
        TcpStream::connect((ip, p)).await.map_err(|e| format!("dial tcp {ip}:{p}: {e}"))?;
        return Ok(());
    }
    if let Some(http) = &probe.http_get {
        let p = port(&http.port, container)?;
        let path = http.path.as_deref().unwrap_or("/");
        let mut stream = TcpStream::connect((ip, p)).await.map_err(|e| format!("Get http://{ip}:{p}{path}: {e}"))?;
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {ip}:{p}\r\nUser-Agent: kube-probe/1.34\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
        let mut head = vec![0u8; 64];
        let n = stream.read(&mut head).await.map_err(|e| e.to_string())?;
        let line = String::from_utf8_lossy(&head[..n]);
        let code: u16 = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or("not an HTTP response")?;
        return if (200..400).contains(&code) {
            Ok(())
        } else {
            Err(format!("HTTP probe failed with statuscode: {code}"))
        };
    }
    if probe.exec.is_some() || probe.grpc.is_some() {
        return Err("exec and grpc probes are not supported by the node agent".into());
    }
    Ok(())
}
