//! The `kubernetes` Service without kube-proxy: pods reach the API server at the Service's
//! ClusterIP (KUBERNETES_SERVICE_HOST, in the API server's certificate), which the agent holds on
//! the bridge and forwards byte for byte to the API server on the host's loopback. TLS passes
//! through untouched, so pods authenticate with their own service-account tokens.

use anyhow::{Context, Result};
use std::net::SocketAddr;
use tokio::net::{TcpListener, TcpStream};

pub async fn run(listen: SocketAddr, upstream: String) -> Result<()> {
    let listener =
        TcpListener::bind(listen).await.with_context(|| format!("listening on {listen} for the API proxy"))?;
    loop {
        let (mut inbound, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("API proxy accept: {e}");
                continue;
            }
        };
        let upstream = upstream.clone();
        tokio::spawn(async move {
            match TcpStream::connect(&upstream).await {
                Ok(mut outbound) => {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
                Err(e) => tracing::warn!("API proxy: connecting to {upstream}: {e}"),
            }
        });
    }
}
