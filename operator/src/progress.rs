//! Reads rank 0's `/progress` endpoint (`tensorfleet_worker::progress::Report` as JSON) for
//! status.progress. A plain HTTP/1.1 GET with a short timeout: progress is best-effort and
//! must never hold up a reconcile.

use crate::crd::Progress;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TIMEOUT: Duration = Duration::from_secs(2);
/// Responses larger than this are not progress reports.
const MAX_RESPONSE: u64 = 64 * 1024;

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
    let mut stream = TcpStream::connect((host, port)).await.map_err(|e| format!("{host}:{port}: {e}"))?;
    let request =
        format!("GET /progress HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nAccept: application/json\r\n\r\n");
    stream.write_all(request.as_bytes()).await.map_err(|e| format!("{host}:{port}: {e}"))?;
    let mut response = Vec::new();
    stream.take(MAX_RESPONSE).read_to_end(&mut response).await.map_err(|e| format!("{host}:{port}: {e}"))?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| format!("{host}:{port}: not an HTTP response"))?;
    let status_line = head.lines().next().unwrap_or("");
    if status_line.split_whitespace().nth(1) != Some("200") {
        return Err(format!("{host}:{port}/progress: {status_line}"));
    }
    serde_json::from_str(body.trim()).map_err(|e| format!("{host}:{port}/progress: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
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
