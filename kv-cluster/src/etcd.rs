//! How a participant reaches etcd, and how it waits between attempts when etcd is
//! down.
//!
//! The client connects lazily (the first call finds out whether an endpoint answers)
//! with the configured connect timeout and a TCP keep-alive, so a dead endpoint is
//! noticed instead of waited on forever. Retries use one [`Backoff`] (100 ms doubling
//! to 5 s) everywhere, so every participant treats an etcd outage the same way.

use crate::Error;
use etcd_client::{Client, ConnectOptions};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How to reach etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Endpoint URLs.
    pub endpoints: Vec<String>,
    /// Timeout of the initial connection, and the bound on each call of the worker
    /// directory.
    pub connect_timeout: Duration,
}

/// Connects to etcd (lazily: the first call finds out whether an endpoint answers).
///
/// # Errors
/// [`Error::EtcdConnect`] when the endpoints or options are invalid.
pub async fn connect(config: &EtcdConfig) -> Result<Client, Error> {
    let options = ConnectOptions::new()
        .with_connect_timeout(config.connect_timeout)
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
    Client::connect(&config.endpoints, Some(options))
        .await
        .map_err(|source| Error::EtcdConnect {
            endpoints: config.endpoints.clone(),
            source,
        })
}

/// Exponential backoff between etcd attempts: 100 ms, doubling, at most 5 s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    /// First delay.
    pub const INITIAL: Duration = Duration::from_millis(100);
    /// Largest delay.
    pub const MAX: Duration = Duration::from_secs(5);

    /// Starts at [`Backoff::INITIAL`].
    pub fn new() -> Self {
        Self {
            next: Self::INITIAL,
        }
    }

    /// The delay to wait now; the one after is doubled, up to [`Backoff::MAX`].
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        delay
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

/// Waits `delay` unless `shutdown` fires first; returns whether it was cancelled.
pub(crate) async fn wait_or_cancelled(delay: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(delay) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let mut b = Backoff::new();
        let delays: Vec<Duration> = (0..8).map(|_| b.next_delay()).collect();
        assert_eq!(delays[0], Backoff::INITIAL);
        assert_eq!(delays[1], Duration::from_millis(200));
        assert_eq!(delays[5], Duration::from_millis(3_200));
        assert_eq!(delays[6], Backoff::MAX);
        assert_eq!(delays[7], Backoff::MAX);
    }
}
