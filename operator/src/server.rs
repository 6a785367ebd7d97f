//! The operator's HTTP endpoints: /metrics (Prometheus), /healthz (the process answers) and
//! /readyz (this replica leads and its controller runs, or it is a standby waiting to lead).

use crate::metrics::Metrics;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[derive(Default)]
pub struct Health {
    /// Set once the controller's watches run (or the replica waits as a standby).
    pub ready: AtomicBool,
}

pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, health: Arc<Health>) {
    loop {
        let Ok((mut socket, _)) = listener.accept().await else { continue };
        let metrics = metrics.clone();
        let health = health.clone();
        tokio::spawn(async move {
            // The whole request head, so closing never resets a connection with bytes unread.
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                match tokio::time::timeout(std::time::Duration::from_secs(5), socket.read(&mut buf)).await {
                    Ok(Ok(n)) if n > 0 => head.extend_from_slice(&buf[..n]),
                    _ => break,
                }
            }
            let request = String::from_utf8_lossy(&head);
            let path = request.split_whitespace().nth(1).unwrap_or("/");
            let (code, content_type, body) = match path {
                "/metrics" => {
                    ("200 OK", "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.encode())
                }
                "/healthz" | "/livez" => ("200 OK", "text/plain", "ok\n".to_string()),
                "/readyz" if health.ready.load(Ordering::Relaxed) => ("200 OK", "text/plain", "ok\n".to_string()),
                "/readyz" => ("503 Service Unavailable", "text/plain", "not ready\n".to_string()),
                _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
            };
            let reply = format!(
                "HTTP/1.1 {code}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = socket.write_all(reply.as_bytes()).await;
        });
    }
}
