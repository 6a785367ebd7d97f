//! Reads rank 0's `/progress` endpoint (`tensorfleet_worker::progress::Report` as JSON) for
//! status.progress. An HTTP/1.1 GET (hyper's client connection) with a short timeout: progress
//! is best-effort and must never hold up a reconcile.

use crate::crd::Progress;
use http::header::{ACCEPT, HOST};
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use std::time::Duration;
use tokio::net::TcpStream;

const TIMEOUT: Duration = Duration::from_secs(2);
/// Responses larger than this are not progress reports.
const MAX_RESPONSE: usize = 64 * 1024;

/// The report as the worker serves it: the worker's own type, so the contract has one home.
pub use tensorfleet_worker::progress::Report;

/// The report as status.progress, read at `observed_at`.
pub fn status(report: &Report, observed_at: Time) -> Progress {
    let (step, total_steps) = (report.step as i64, report.total_steps as i64);
    let percent = if total_steps > 0 { 100 * step / total_steps } else { 0 };
    let mut summary = format!("{step}/{total_steps} ({percent}%)");
    if let Some(loss) = report.loss {
        summary.push_str(&format!(" loss {loss:.4}"));
    }
    if let Some(eta) = report.eta_seconds {
        summary.push_str(&format!(" eta {}", human_duration(eta as i64)));
    }
    Progress {
        step,
        total_steps,
        loss: report.loss,
        eval_loss: report.eval_loss,
        tokens_per_second: report.tokens_per_second,
        eta_seconds: report.eta_seconds.map(|e| e as i64),
        summary,
        observed_at: Some(observed_at),
    }
}

/// The progress of a run that finished all `total_steps`, as known at `observed_at`.
pub fn completed(total_steps: i64, observed_at: Time) -> Progress {
    Progress {
        step: total_steps,
        total_steps,
        eta_seconds: Some(0),
        summary: format!("{total_steps}/{total_steps} (100%)"),
        observed_at: Some(observed_at),
        ..Progress::default()
    }
}

fn human_duration(seconds: i64) -> String {
    match seconds {
        s if s >= 3600 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        s if s >= 60 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{}s", s.max(0)),
    }
}

/// GETs `http://host:port/progress`; an error says what went wrong, for a debug log.
pub async fn fetch(host: &str, port: u16) -> Result<Report, String> {
    tokio::time::timeout(TIMEOUT, fetch_inner(host, port))
        .await
        .map_err(|_| format!("{host}:{port}: no answer within {TIMEOUT:?}"))?
}

async fn fetch_inner(host: &str, port: u16) -> Result<Report, String> {
    let at = |e: &dyn std::fmt::Display| format!("{host}:{port}: {e}");
    let stream = TcpStream::connect((host, port)).await.map_err(|e| at(&e))?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| at(&e))?;
    // The connection runs beside the request; it ends when the answer has been read (the
    // sender is dropped with this function), or with the timeout's cancellation.
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let request = http::Request::get("/progress")
        .header(HOST, host)
        .header(ACCEPT, "application/json")
        .body(Empty::<Bytes>::new())
        .map_err(|e| at(&e))?;
    let response = sender.send_request(request).await.map_err(|e| at(&e))?;
    if response.status() != http::StatusCode::OK {
        return Err(format!("{host}:{port}/progress: {}", response.status()));
    }
    let body = Limited::new(response.into_body(), MAX_RESPONSE).collect().await.map_err(|e| at(&e))?.to_bytes();
    serde_json::from_slice(&body).map_err(|e| format!("{host}:{port}/progress: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    #[tokio::test]
    async fn reads_a_report_from_a_real_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = socket.read(&mut buf).await.unwrap();
            let body = r#"{"step": 50, "totalSteps": 200, "loss": 3.25, "etaSeconds": 125.0}"#;
            let reply = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            socket.write_all(reply.as_bytes()).await.unwrap();
        });
        let report = fetch("127.0.0.1", port).await.unwrap();
        let p = status(&report, crate::status::now());
        assert_eq!((p.step, p.total_steps), (50, 200));
        assert_eq!(p.summary, "50/200 (25%) loss 3.2500 eta 2m05s");
        assert!(fetch("127.0.0.1", port).await.is_err(), "nothing listens any more");
    }
}
