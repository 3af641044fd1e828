//! A round trip through NATS, from one connection to another (or to itself).
//!
//! `async_nats::Client::flush` only writes our buffer to the socket; it does not wait
//! for the server to process it. A server handles one connection's commands in
//! order, so once a message a connection publishes comes back, every subscription it
//! made before is registered. The router daemon uses this before declaring itself
//! ready, so the first query after `ready` does not meet "no responders", and around
//! the replica sync subscription (see [`server_barrier_between`]); a test that
//! subscribes and then makes another connection publish needs it too (a `flush`
//! there loses the message now and then on a loaded host).
//!
//! Why it re-publishes: in a NATS cluster the two connections may sit on different
//! nodes, and a subscription reaches the other nodes asynchronously, over the routes.
//! A message published on the sender's node before the receiver's subscription got
//! there is dropped — once, a start-up waited forever on it. So the sender publishes
//! again, 20 ms after the first and doubling up to 1 s, until one arrives. Each try
//! costs one empty message. The wait counts only the time both connections are
//! connected (a start before NATS is up waits for NATS, as every other step does);
//! past [`BARRIER_DEADLINE`] of that it fails, naming both servers.

use futures::StreamExt;
use std::time::Duration;
use tokio::time::Instant;

/// How long a barrier may wait while both its connections are up before it fails: far
/// beyond any route's propagation delay, so reaching it means the servers do not
/// carry messages between the two connections (broken routes, a partition).
pub const BARRIER_DEADLINE: Duration = Duration::from_secs(30);

/// The first wait before publishing again; doubles up to [`MAX_RETRY_DELAY`].
const FIRST_RETRY_DELAY: Duration = Duration::from_millis(20);
/// The longest wait between two publishes.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(1);

/// Errors of the barrier round trip.
#[derive(Debug, thiserror::Error)]
pub enum BarrierError {
    /// Subscribing to the private inbox failed.
    #[error("barrier subscribe failed: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
    /// Publishing to the private inbox failed.
    #[error("barrier publish failed: {0}")]
    Publish(#[from] async_nats::PublishError),
    /// The connection closed before the message came back.
    #[error("connection closed during the barrier")]
    Closed,
    /// No message came back within the deadline while both connections were up.
    #[error(
        "no barrier message published on NATS server {sender} reached a subscriber on server {receiver} within {waited:?} ({publishes} publishes): the servers do not carry messages between these connections; check the cluster's routes"
    )]
    Timeout {
        /// The sending connection's server (its `server_name`).
        sender: String,
        /// The receiving connection's server.
        receiver: String,
        /// Time waited while both connections were up.
        waited: Duration,
        /// Messages published.
        publishes: u32,
    },
}

/// [`round_trip`] within [`BARRIER_DEADLINE`], for a `sender` that cannot read its
/// own messages (a `no_echo` connection): once the message arrives, every
/// subscription `sender` made before it is registered on its server and has reached
/// the receiver's.
///
/// # Errors
/// As [`round_trip`].
pub async fn server_barrier_between(
    sender: &async_nats::Client,
    receiver: &async_nats::Client,
) -> Result<(), BarrierError> {
    round_trip(sender, receiver, BARRIER_DEADLINE).await
}

/// Returns once the server has processed everything this client sent before: a
/// [`round_trip`] to itself, failing after 30 s of waiting while connected.
///
/// # Errors
/// As [`round_trip`].
pub async fn server_barrier(client: &async_nats::Client) -> Result<(), BarrierError> {
    round_trip(client, client, BARRIER_DEADLINE).await
}

/// Returns once the server(s) have processed everything `sender` sent before, as seen
/// from `receiver`: `receiver` subscribes to a private inbox, and `sender` publishes
/// an empty message there until one arrives (see the module docs).
///
/// # Errors
/// [`BarrierError`] when either connection fails meanwhile, or after `deadline` of
/// waiting while both are up.
pub async fn round_trip(
    sender: &async_nats::Client,
    receiver: &async_nats::Client,
    deadline: Duration,
) -> Result<(), BarrierError> {
    let inbox = receiver.new_inbox();
    let mut sub = receiver.subscribe(inbox.clone()).await?;
    let mut delays = backon::BackoffBuilder::build(
        backon::ExponentialBuilder::default()
            .with_min_delay(FIRST_RETRY_DELAY)
            .with_max_delay(MAX_RETRY_DELAY)
            .with_factor(2.0)
            .without_max_times(),
    );
    let (mut waited, mut publishes) = (Duration::ZERO, 0u32);
    loop {
        sender.publish(inbox.clone(), bytes::Bytes::new()).await?;
        publishes = publishes.saturating_add(1);
        let delay = delays.next().unwrap_or(MAX_RETRY_DELAY);
        let since = Instant::now();
        match tokio::time::timeout(delay.min(deadline), sub.next()).await {
            Ok(Some(_)) => return Ok(()),
            Ok(None) => return Err(BarrierError::Closed),
            Err(_) => {}
        }
        if connected(sender) && connected(receiver) {
            waited += since.elapsed();
        }
        if waited >= deadline {
            return Err(BarrierError::Timeout {
                sender: sender.server_info().server_name,
                receiver: receiver.server_info().server_name,
                waited,
                publishes,
            });
        }
    }
}

fn connected(client: &async_nats::Client) -> bool {
    client.connection_state() == async_nats::connection::State::Connected
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Nothing listens on this port: the client never connects.
    async fn never_connected() -> async_nats::Client {
        async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .connect("nats://127.0.0.1:1")
            .await
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn time_without_a_connection_does_not_count_against_the_deadline() {
        let client = never_connected().await;
        let deadline = Duration::from_millis(100);
        // Far past the deadline in (paused, auto-advanced) time: still waiting for NATS.
        let waiting = tokio::time::timeout(
            Duration::from_secs(60),
            round_trip(&client, &client, deadline),
        )
        .await;
        assert!(
            waiting.is_err(),
            "gave up while never connected: {waiting:?}"
        );
    }
}
