//! The daemon's NATS connections — the main one, the route path's
//! ([`crate::route_thread`]) and replica sync's: connection-state reporting and
//! draining subscriptions at shutdown. The seed list, authentication and TLS are
//! [`kv_cluster::nats`], shared with every other participant.
//!
//! The client (async-nats) reconnects by itself, forever, with a backoff of up to 4 s
//! between attempts, and re-sends every subscription on reconnect, so intake, the
//! route queue group and lifecycle messages resume without the daemon doing anything.
//! What the daemon adds: every event of the main and route connections is counted
//! (`kv_router_nats_events_total`) and drives `kv_router_nats_connected` and the
//! `nats` readiness check (both must be up), and the initial connection is retried too
//! (`retry_on_initial_connect`), so a daemon started before NATS reports "not ready"
//! instead of exiting. Messages published while the daemon was disconnected are not
//! delivered to it (core NATS has no replay); the indexer notices the missing event
//! ids and recovers them (see `indexer/README.md`).

use crate::health::{Health, Link};
use futures::{Stream, StreamExt};
use kv_cluster::Error as NatsError;
use kv_cluster::nats::NatsConfig;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Connects one of the daemon's connections to NATS: the main one ([`Link::Main`])
/// or the route path's ([`Link::Routes`], see [`crate::route_thread`]), named
/// `kv-router` and `kv-router-routes` on the server. The client reports every
/// connection event to `health` as `link`'s, and keeps retrying the initial
/// connection in the background (the returned client queues commands until then).
///
/// # Errors
/// [`NatsError`] when the options are unusable (unreadable credentials, bad URL).
pub(crate) async fn connect(
    config: &NatsConfig,
    health: Arc<Health>,
    link: Link,
) -> Result<async_nats::Client, NatsError> {
    let name = match link {
        Link::Main => "kv-router",
        Link::Routes => "kv-router-routes",
    };
    config
        .connect_with(name, |options| {
            options
                .retry_on_initial_connect()
                .event_callback(move |event| {
                    let health = health.clone();
                    async move { health.nats_event(link, &event) }
                })
        })
        .await
}

/// A second connection, for replica sync only, opened with NATS's `no_echo`: the
/// server does not deliver this connection's own publications back to it. Every
/// route books, steps and frees a request, and each step is published to the peers
/// on `{ns}.router.sequences`; on the daemon's main connection the server would
/// hand each of those messages back to the replica that sent it, two of the four
/// messages a route makes the daemon read (measured in `route_bench`, see
/// docs/benchmarks.md). Same seed list, authentication and TLS as the main
/// connection; its events are logged, not counted in readiness (sync is best
/// effort: a replica that misses peers' messages only mispredicts their load until
/// the requests end or expire).
///
/// # Errors
/// [`NatsError`] when the options are unusable (unreadable credentials, bad URL).
pub(crate) async fn connect_sync(config: &NatsConfig) -> Result<async_nats::Client, NatsError> {
    config
        .connect_with("kv-router-sync", |options| {
            options
                .retry_on_initial_connect()
                .no_echo()
                .event_callback(|event| async move {
                    tracing::info!(%event, "replica sync connection event");
                })
        })
        .await
}

/// How long a subscription drain may take at shutdown before its remaining messages
/// are given up (the connection is down, so the server will not confirm).
pub(crate) const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// The messages of `subscriber` until `stop` is cancelled, then — instead of dropping
/// what is buffered or still on the wire — a drain: the daemon unsubscribes, the server
/// confirms with a round trip, and every message the server had sent before that is
/// still yielded; then the stream ends. This is what lets shutdown answer every route
/// query the daemon received, and apply every KV event it received. If the drain
/// cannot complete (connection down) the stream ends after [`DRAIN_TIMEOUT`].
pub(crate) fn drain_on_cancel(
    subscriber: async_nats::Subscriber,
    stop: CancellationToken,
) -> impl Stream<Item = async_nats::Message> + Send {
    futures::stream::unfold(
        (subscriber, stop, false),
        |(mut sub, stop, draining)| async move {
            if draining {
                let next = tokio::time::timeout(DRAIN_TIMEOUT, sub.next()).await;
                return next.ok().flatten().map(|m| (m, (sub, stop, true)));
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => {
                    if let Err(e) = sub.drain().await {
                        tracing::warn!(error = %e, "cannot drain a subscription; dropping its buffered messages");
                        return None;
                    }
                    let next = tokio::time::timeout(DRAIN_TIMEOUT, sub.next()).await;
                    next.ok().flatten().map(|m| (m, (sub, stop, true)))
                }
                m = sub.next() => m.map(|m| (m, (sub, stop, false))),
            }
        },
    )
}
