//! The relay's optional HTTP endpoint: `GET /metrics` in the Prometheus text format
//! (the `kv_relay_*` counters, see [`crate::counters`]). Off unless `--http-listen` is
//! given. Cost: one small axum server; nothing per event.

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::net::SocketAddr;
use tokio_util::sync::CancellationToken;
use tracing::warn;

async fn metrics(State(registry): State<prometheus::Registry>) -> Response {
    match prometheus::TextEncoder::new().encode_to_string(&registry.gather()) {
        Ok(text) => text.into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {e}\n"),
        )
            .into_response(),
    }
}

/// Binds `addr` and serves `/metrics` from `registry` until `shutdown`; returns the
/// bound address (useful with port 0).
///
/// # Errors
/// When the address cannot be bound.
pub async fn serve_metrics(
    addr: SocketAddr,
    registry: prometheus::Registry,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .with_state(registry);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
        {
            warn!(error = %e, "relay http endpoint failed");
        }
    });
    Ok((bound, task))
}
