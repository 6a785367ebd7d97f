//! Rank 0's HTTP endpoint: `/progress` (JSON, read by the operator for a TrainingJob's status)
//! and `/metrics` (OpenMetrics text, which Prometheus scrapes), served by tiny_http from a
//! thread of its own: the training loop only swaps a snapshot under a mutex, so serving never
//! slows a step, and the worker needs no async runtime for it (the operator's endpoints are on
//! hyper, under its tokio).

use crate::error::{Error, Result};
use crate::progress::Report;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

pub struct Endpoint {
    report: Arc<Mutex<Report>>,
    pub addr: SocketAddr,
}

impl Endpoint {
    /// Listens on `addr` (port 0 picks a free one) and serves from a background thread.
    pub fn serve(addr: SocketAddr, total_steps: u64) -> Result<Endpoint> {
        let server = tiny_http::Server::http(addr)
            .map_err(|e| Error::Runtime(format!("logging.port: cannot listen on {addr}: {e}")))?;
        let addr = server.server_addr().to_ip().ok_or_else(|| Error::Runtime(format!("logging.port: {addr}")))?;
        let report = Arc::new(Mutex::new(Report { total_steps, ..Report::default() }));
        let shared = report.clone();
        std::thread::Builder::new()
            .name("progress-endpoint".into())
            .spawn(move || {
                // tiny_http reads each connection's request on a thread of its own, so a slow
                // client holds no other up.
                for request in server.incoming_requests() {
                    let snapshot = shared.lock().map(|r| r.clone()).unwrap_or_default();
                    let path = request.url().split('?').next().unwrap_or("/").to_string();
                    let _ = request.respond(answer(&path, &snapshot));
                }
            })
            .map_err(|e| Error::Runtime(format!("starting the progress endpoint: {e}")))?;
        Ok(Endpoint { report, addr })
    }

    pub fn update(&self, f: impl FnOnce(&mut Report)) {
        if let Ok(mut r) = self.report.lock() {
            f(&mut r);
        }
    }
}

fn answer(path: &str, report: &Report) -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    let (status, content_type, body) = match path {
        "/progress" => (200, "application/json", serde_json::to_string(report).unwrap_or_default()),
        "/metrics" => (200, "application/openmetrics-text; version=1.0.0; charset=utf-8", prometheus(report)),
        _ => (404, "text/plain; charset=utf-8", "try /progress or /metrics\n".to_string()),
    };
    let header = tiny_http::Header::from_bytes("Content-Type", content_type).expect("a valid header");
    tiny_http::Response::from_string(body).with_status_code(status).with_header(header)
}

/// The report as OpenMetrics text (prometheus-client's encoder, as the operator's /metrics):
/// a gauge per value the report has, none for the ones it lacks yet.
fn prometheus(r: &Report) -> String {
    let mut registry = Registry::with_prefix("tensorfleet");
    let mut gauge = |name: &str, help: &str, value: Option<f64>| {
        if let Some(v) = value {
            let g = Gauge::<f64, AtomicU64>::default();
            g.set(v);
            registry.register(name, help, g);
        }
    };
    gauge("step", "Weight updates done", Some(r.step as f64));
    gauge("total_steps", "Weight updates in the run", Some(r.total_steps as f64));
    gauge("loss", "Training loss of the latest logged step", r.loss);
    gauge("eval_loss", "Latest evaluation loss", r.eval_loss);
    gauge("learning_rate", "Learning rate of the latest logged step", r.learning_rate);
    gauge("grad_norm", "Global gradient norm of the latest logged step", r.grad_norm);
    gauge("tokens_per_second", "Training throughput (samples per second for sample data)", r.tokens_per_second);
    gauge("flops_per_second", "Model FLOPs per second of training", r.flops_per_second);
    gauge("mfu", "Model FLOPs utilization (0..1) against the device's peak", r.mfu);
    gauge("eta_seconds", "Estimated seconds to the last step", r.eta_seconds);
    let mut out = String::new();
    encode(&mut out, &registry).expect("writing to a String does not fail");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        // Two writes, as a client may send them: the server must wait for the whole head.
        s.write_all(format!("GET {path} HTTP/1.1\r\n").as_bytes()).unwrap();
        s.write_all(b"Host: x\r\nConnection: close\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text
    }

    #[test]
    fn serves_progress_and_metrics() {
        let ep = Endpoint::serve("127.0.0.1:0".parse().unwrap(), 200).unwrap();
        ep.update(|r| {
            r.step = 50;
            r.loss = Some(3.5);
            r.latest_checkpoint = Some("checkpoint_50".into());
        });
        let progress = get(ep.addr, "/progress");
        assert!(progress.starts_with("HTTP/1.1 200"), "{progress}");
        let body: serde_json::Value = serde_json::from_str(progress.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body["step"], 50);
        assert_eq!(body["totalSteps"], 200);
        assert_eq!(body["latestCheckpoint"], "checkpoint_50");
        let metrics = get(ep.addr, "/metrics");
        assert!(metrics.contains("# TYPE tensorfleet_loss gauge\ntensorfleet_loss 3.5\n"), "{metrics}");
        assert!(metrics.contains("tensorfleet_step 50.0\n") && metrics.ends_with("# EOF\n"), "{metrics}");
        assert!(!metrics.contains("tensorfleet_eval_loss"), "absent values are not exported");
        assert!(get(ep.addr, "/nope").starts_with("HTTP/1.1 404"));
    }
}
