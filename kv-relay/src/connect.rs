//! Connecting an engine's PUB socket, on the relay's own schedule.
//!
//! The `zeromq` crate reconnects a SUB socket by itself, but with a fixed backoff that
//! doubles from 100 ms to 30 s (its `ReconnectConfig` is not configurable), and its
//! first connect retries a refused port the same way: an engine restarted after half
//! a minute away was read again only up to 30 s after it came back, unroutable all
//! that time. So the relay owns the schedule: every connection is a fresh socket, and
//! when the engine goes away the socket is dropped (which stops the crate's own
//! reconnect task) and [`connect`] starts again.
//!
//! One attempt is one `connect` bounded by twice the backoff cap: inside it the crate
//! retries a refused port 50 ms apart, doubling, so within that bound its tries are
//! at most the cap apart; a timed-out attempt is followed by the next at once. An
//! attempt that fails otherwise (the engine's port accepts but the handshake fails,
//! the host is unreachable) is followed by a wait of [`FIRST_RETRY`], doubling up to
//! the cap (`--reconnect-max-backoff-ms`, default 1 s). So an engine whose socket is
//! up again is connected within about the cap. Cost: one TCP connect attempt per
//! retry while the engine is away.

use backon::BackoffBuilder as _;
use futures::channel::mpsc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};
use zeromq::{Socket, SocketEvent, SocketOptions, SubSocket, ZmqError};

/// A socket task failed to start.
#[derive(Debug, thiserror::Error)]
#[error("engine socket {endpoint}: {source}")]
pub struct SourceError {
    /// The PUB endpoint.
    pub endpoint: String,
    /// The cause.
    pub source: zeromq::ZmqError,
}

/// The wait after the first failed attempt; doubled after each failure up to the cap.
pub const FIRST_RETRY: Duration = Duration::from_millis(100);

/// The waits between failed attempts, without end: [`FIRST_RETRY`] (or `cap`, if
/// smaller), doubling, at most `cap`, no jitter (`backon`).
pub fn retry_waits(cap: Duration) -> impl Iterator<Item = Duration> + Send {
    backon::ExponentialBuilder::new()
        .with_min_delay(FIRST_RETRY.min(cap))
        .with_max_delay(cap)
        .with_factor(2.0)
        .without_max_times()
        .build()
}

/// A connected SUB socket and its event monitor (for the disconnect).
pub struct Connected {
    /// The socket, subscribed to the topic.
    pub socket: SubSocket,
    /// Its connection events.
    pub monitor: mpsc::Receiver<SocketEvent>,
}

/// Connects a SUB socket subscribed to `topic` to `endpoint`, trying as long as it
/// takes with waits of at most `cap` (see the module docs); `None` on `shutdown`.
///
/// # Errors
/// [`SourceError`] when the endpoint itself is unusable (not when the engine is down).
pub async fn connect(
    endpoint: &str,
    topic: &str,
    cap: Duration,
    shutdown: &CancellationToken,
) -> Result<Option<Connected>, SourceError> {
    let permanent = |source| SourceError {
        endpoint: endpoint.to_owned(),
        source,
    };
    let mut waits = retry_waits(cap);
    let mut logged = false;
    loop {
        let mut options = SocketOptions::default();
        options.connect_timeout(cap * 2);
        let mut socket = SubSocket::with_options(options);
        let monitor = socket.monitor();
        socket.subscribe(topic).await.map_err(permanent)?;
        let attempt = tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            attempt = socket.connect(endpoint) => attempt,
        };
        let wait = match attempt {
            Ok(()) => return Ok(Some(Connected { socket, monitor })),
            Err(e @ ZmqError::Endpoint(_)) => return Err(permanent(e)),
            // The attempt already waited (the crate retried the refused port).
            Err(ZmqError::ConnectTimeout(_)) => Duration::ZERO,
            Err(e) => {
                debug!(%endpoint, error = %e, "engine socket connect attempt failed");
                // The schedule never ends; `cap` is its last value anyway.
                waits.next().unwrap_or(cap)
            }
        };
        if !std::mem::replace(&mut logged, true) {
            info!(%endpoint, max_backoff_ms = cap.as_millis(),
                "engine socket not reachable yet; trying again until it is");
        }
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_waits_double_from_100_ms_up_to_the_cap() {
        // backon multiplies in f32: compare whole milliseconds.
        let waits: Vec<u128> = retry_waits(Duration::from_millis(1000))
            .take(7)
            .map(|w| w.as_millis())
            .collect();
        assert_eq!(waits, vec![100, 200, 400, 800, 1000, 1000, 1000]);
        let mut small = retry_waits(Duration::from_millis(50));
        assert_eq!(small.next(), Some(Duration::from_millis(50)));
        assert_eq!(retry_waits(Duration::from_secs(1)).take(500).count(), 500);
    }
}
