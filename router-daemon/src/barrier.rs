//! A round trip through the NATS server on our own connection.
//!
//! `async_nats::Client::flush` only writes our buffer to the socket; it does not wait
//! for the server to process it. The server handles one connection's commands in
//! order, so once a message we publish to a private inbox comes back to us, every
//! subscription we made before it is registered and visible to other clients. The
//! daemon uses this before declaring itself ready, so the first query after `ready`
//! never meets "no responders".

use futures::StreamExt;

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
}

/// Returns once the server has processed everything `sender` sent before, for a
/// `sender` that cannot read its own messages (a `no_echo` connection): `receiver`
/// subscribes to a private inbox (made visible by its own [`server_barrier`]), and
/// once the empty message `sender` publishes there arrives, every subscription
/// `sender` made before it is registered.
///
/// # Errors
/// [`BarrierError`] when either connection fails meanwhile.
pub async fn server_barrier_between(
    sender: &async_nats::Client,
    receiver: &async_nats::Client,
) -> Result<(), BarrierError> {
    let inbox = receiver.new_inbox();
    let mut sub = receiver.subscribe(inbox.clone()).await?;
    server_barrier(receiver).await?;
    sender.publish(inbox, bytes::Bytes::new()).await?;
    sub.next().await.map(|_| ()).ok_or(BarrierError::Closed)
}

/// Returns once the server has processed everything this client sent before.
///
/// # Errors
/// [`BarrierError`] when the connection fails meanwhile.
pub async fn server_barrier(client: &async_nats::Client) -> Result<(), BarrierError> {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await?;
    client.publish(inbox, bytes::Bytes::new()).await?;
    sub.next().await.map(|_| ()).ok_or(BarrierError::Closed)
}
