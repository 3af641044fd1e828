//! A worker's HTTP listeners: its OpenAI server (`--http-port` + index, or
//! ephemeral) and, for an SGLang prefill worker, its bootstrap server
//! (`--bootstrap-port` + index), both served by [`kv_cluster::http::serve`] until the
//! engines stop.

use super::ServiceError;
use crate::engine::config::EngineConfigError;
use crate::engine::config::RuntimeArgs;
use crate::engine::disaggregation::DisaggregationConfig;
use crate::engine::http::transfer::TransferSide;
use crate::engine::http::transfer::rooms::{self, Rooms};
use crate::engine::http::{self, EngineHttpArgs, EngineHttpState, WorkerHttp};
use axum::serve::ListenerExt;
use kv_cluster::args::WorkerPlacement;
use kv_events::disaggregation::{TransferProtocol, WorkerRole};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Worker `index`'s half of disaggregated requests, `placement` its registration
/// fields; an SGLang prefill worker's bootstrap server is bound and spawned here.
/// Its advertised address is filled in by [`serve_http`].
///
/// # Errors
/// [`ServiceError::HttpBind`] when the bootstrap port cannot be bound,
/// [`ServiceError::Cluster`] when no HTTP client can be built.
pub(super) async fn transfer_side(
    args: &EngineHttpArgs,
    config: &DisaggregationConfig,
    placement: WorkerPlacement,
    runtime: RuntimeArgs,
    tasks: &mut JoinSet<()>,
    shutdown: &CancellationToken,
) -> Result<TransferSide, ServiceError> {
    let protocol = placement.kv_transfer.map(|t| t.protocol);
    let bootstrap_port = placement.kv_transfer.and_then(|t| t.bootstrap_port);
    let rooms = match (placement.role, protocol, bootstrap_port) {
        (WorkerRole::Prefill, Some(TransferProtocol::Sglang), Some(port)) => {
            let rooms = Arc::new(Rooms::default());
            let listener = bind(&args.http_host, port).await?.0;
            let router = rooms::router(rooms.clone(), shutdown.clone());
            let (limits, token) = (args.limits(), shutdown.clone());
            tasks.spawn(kv_cluster::http::serve(listener, router, limits, token));
            Some(rooms)
        }
        _ => None,
    };
    let client = match (placement.role, protocol) {
        (WorkerRole::Decode, Some(TransferProtocol::Sglang)) => Some(kv_cluster::http::client()?),
        _ => None,
    };
    Ok(TransferSide {
        placement,
        rooms,
        cost: config.transfer,
        runtime,
        bootstrap_timeout: config.bootstrap_timeout,
        host: String::new(),
        port: 0,
        client,
        shutdown: shutdown.clone(),
    })
}

/// Binds worker `index`'s listener (`--http-port` + index, or ephemeral), spawns its
/// server until `shutdown` and returns its base URL.
pub(super) async fn serve_http(
    args: &EngineHttpArgs,
    index: usize,
    mut worker: WorkerHttp,
    tasks: &mut JoinSet<()>,
    shutdown: CancellationToken,
) -> Result<String, ServiceError> {
    let port = match args.http_port {
        0 => Some(0),
        base => u16::try_from(index).ok().and_then(|i| base.checked_add(i)),
    }
    .ok_or(EngineConfigError::HttpPortOverflow {
        base: args.http_port,
        workers: index + 1,
    })?;
    let (listener, local) = bind(&args.http_host, port).await?;
    let host = args
        .http_advertise_host
        .as_deref()
        .unwrap_or(&args.http_host);
    let url = format!("http://{}:{}", bracket_v6(host), local.port());
    worker.transfer.host = host.to_owned();
    worker.transfer.port = local.port();
    let limits = args.limits();
    let router = http::router(
        Arc::new(EngineHttpState::new(args, worker)?),
        args.vllm_dev_mode,
    );
    tasks.spawn(async move {
        // Small SSE writes go out at once (no Nagle wait for a delayed ACK).
        let listener = listener.tap_io(|tcp| {
            if let Err(err) = tcp.set_nodelay(true) {
                warn!(%err, "cannot set TCP_NODELAY");
            }
        });
        kv_cluster::http::serve(listener, router, limits, shutdown).await;
    });
    Ok(url)
}

/// A listener on `host:port` and its bound address.
async fn bind(
    host: &str,
    port: u16,
) -> Result<(tokio::net::TcpListener, SocketAddr), ServiceError> {
    let addr = format!("{}:{port}", bracket_v6(host));
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServiceError::HttpBind {
            addr: addr.clone(),
            source,
        })?;
    let local = listener
        .local_addr()
        .map_err(|source| ServiceError::HttpBind { addr, source })?;
    Ok((listener, local))
}

/// `[addr]` for an IPv6 literal, so it can be followed by `:port`.
fn bracket_v6(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}
