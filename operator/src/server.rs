//! The operator's HTTP endpoints: /metrics (Prometheus), /healthz (the process answers) and
//! /readyz (this replica leads and its controller runs, or it is a standby waiting to lead),
//! served by hyper (which kube brings).

use crate::metrics::Metrics;
use http::header::CONTENT_TYPE;
use http::{Response, StatusCode};
use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

#[derive(Default)]
pub struct Health {
    /// Set once the controller's watches run (or the replica waits as a standby).
    pub ready: AtomicBool,
}

pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, health: Arc<Health>) {
    loop {
        let Ok((socket, _)) = listener.accept().await else { continue };
        let (metrics, health) = (metrics.clone(), health.clone());
        let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
            let reply = respond(request.uri().path(), &metrics, &health);
            async move { Ok::<_, Infallible>(reply) }
        });
        // A client that sends no request head within the timeout is dropped, so a stalled
        // scraper holds no task for long.
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_secs(5))
            .serve_connection(TokioIo::new(socket), service);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("an HTTP connection ended with an error: {e}");
            }
        });
    }
}

fn respond(path: &str, metrics: &Metrics, health: &Health) -> Response<Full<Bytes>> {
    let text = "text/plain; charset=utf-8";
    let (status, content_type, body) = match path {
        "/metrics" => (StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.encode()),
        "/healthz" | "/livez" => (StatusCode::OK, text, "ok\n".to_string()),
        "/readyz" if health.ready.load(Ordering::Relaxed) => (StatusCode::OK, text, "ok\n".to_string()),
        "/readyz" => (StatusCode::SERVICE_UNAVAILABLE, text, "not ready\n".to_string()),
        _ => (StatusCode::NOT_FOUND, text, "not found\n".to_string()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A request as a scraper sends it, its head in two writes; the whole answer.
    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        socket.write_all(format!("GET {path} HTTP/1.1\r\n").as_bytes()).await.unwrap();
        socket.write_all(b"Host: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut text = String::new();
        socket.read_to_string(&mut text).await.unwrap();
        text
    }

    #[tokio::test]
    async fn serves_metrics_health_and_readiness() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let health = Arc::new(Health::default());
        tokio::spawn(serve(listener, Arc::new(Metrics::default()), health.clone()));

        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 503"), "ready before the controller runs");
        health.ready.store(true, Ordering::Relaxed);
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        let metrics = get(addr, "/metrics").await;
        assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
        assert!(metrics.contains("content-type: application/openmetrics-text"), "{metrics}");
        assert!(metrics.ends_with("# EOF\n"), "{metrics}");
        assert!(get(addr, "/nope").await.starts_with("HTTP/1.1 404"));
    }
}
