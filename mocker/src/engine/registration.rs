//! etcd registration of one worker under a lease: grant, put, keep alive, revoke.
//!
//! The key `kv-router/{ns}/workers/{worker_id}` holds the JSON
//! [`WorkerRegistration`] and is bound to a lease of `--lease-ttl-secs`. The lease is
//! renewed every TTL/3 over etcd's keep-alive stream; if a renewal fails or etcd says
//! the lease is gone (TTL 0, e.g. after etcd was unreachable for longer than the TTL),
//! the worker grants a new lease and writes the key again on the next tick. On shutdown
//! the lease is revoked so routers drop the worker at once instead of after the TTL.
//! Cost: one small etcd round trip per TTL/3 per worker.

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use kv_events::discovery::WorkerRegistration;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Upper bound on one etcd call, so an unreachable etcd cannot hang start-up or
/// shutdown, in wall-clock time.
const ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Why registering (or re-registering) a worker failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// etcd returned an error.
    #[error("etcd request failed: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// etcd did not answer within the call timeout.
    #[error("etcd did not answer within {0:?}")]
    Timeout(Duration),
    /// The lease TTL does not fit etcd's signed 64-bit seconds.
    #[error("lease ttl {0} s is out of range")]
    TtlOutOfRange(u64),
    /// The registration record could not be serialized.
    #[error("could not encode registration: {0}")]
    Encode(#[from] serde_json::Error),
}

async fn bounded<T>(
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, LeaseError> {
    tokio::time::timeout(ETCD_CALL_TIMEOUT, call)
        .await
        .map_err(|_| LeaseError::Timeout(ETCD_CALL_TIMEOUT))?
        .map_err(LeaseError::from)
}

/// A worker's live registration: its current lease and keep-alive stream.
pub(super) struct Registration {
    client: Client,
    key: String,
    value: String,
    ttl_secs: i64,
    lease_id: i64,
    keep_alive: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
}

impl Registration {
    /// Grants a lease, writes `record` at `key` under it and opens the keep-alive stream.
    ///
    /// # Errors
    /// [`LeaseError`] if etcd refuses or does not answer in time.
    pub async fn register(
        client: Client,
        key: String,
        record: &WorkerRegistration,
        ttl_secs: u64,
    ) -> Result<Self, LeaseError> {
        let ttl = i64::try_from(ttl_secs).map_err(|_| LeaseError::TtlOutOfRange(ttl_secs))?;
        let mut reg = Self {
            client,
            key,
            value: serde_json::to_string(record)?,
            ttl_secs: ttl,
            lease_id: 0,
            keep_alive: None,
        };
        reg.grant_and_put().await?;
        Ok(reg)
    }

    async fn grant_and_put(&mut self) -> Result<(), LeaseError> {
        let lease = bounded(self.client.lease_grant(self.ttl_secs, None)).await?;
        self.lease_id = lease.id();
        let opts = PutOptions::new().with_lease(self.lease_id);
        bounded(
            self.client
                .put(self.key.clone(), self.value.clone(), Some(opts)),
        )
        .await?;
        self.keep_alive = Some(bounded(self.client.lease_keep_alive(self.lease_id)).await?);
        debug!(key = %self.key, lease_id = self.lease_id, "registered");
        Ok(())
    }

    /// Renews the lease once; false if the lease is lost or etcd failed.
    async fn renew(&mut self) -> bool {
        let Some((keeper, stream)) = self.keep_alive.as_mut() else {
            return false;
        };
        if let Err(err) = keeper.keep_alive().await {
            warn!(key = %self.key, %err, "lease keep-alive failed");
            return false;
        }
        match tokio::time::timeout(ETCD_CALL_TIMEOUT, stream.message()).await {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => true,
            Ok(Ok(Some(_))) => {
                warn!(key = %self.key, lease_id = self.lease_id, "lease expired");
                false
            }
            Ok(Ok(None)) => {
                warn!(key = %self.key, "lease keep-alive stream closed");
                false
            }
            Ok(Err(err)) => {
                warn!(key = %self.key, %err, "lease keep-alive failed");
                false
            }
            Err(_) => {
                warn!(key = %self.key, "lease keep-alive timed out");
                false
            }
        }
    }

    /// Keeps the registration alive every TTL/3 until `shutdown`, then revokes it.
    pub async fn keep_alive_until(mut self, shutdown: CancellationToken) {
        let period = Duration::from_millis(self.ttl_secs.unsigned_abs() * 1_000 / 3);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = tick.tick() => {}
            }
            if self.renew().await {
                continue;
            }
            self.keep_alive = None;
            match self.grant_and_put().await {
                Ok(()) => info!(key = %self.key, lease_id = self.lease_id, "re-registered"),
                Err(err) => warn!(key = %self.key, %err, "re-registration failed, retrying"),
            }
        }
        self.revoke().await;
    }

    /// Revokes the lease (deleting the key); failures are logged.
    pub async fn revoke(mut self) {
        self.keep_alive = None;
        match bounded(self.client.lease_revoke(self.lease_id)).await {
            Ok(_) => debug!(key = %self.key, "lease revoked"),
            Err(err) => warn!(key = %self.key, %err, "lease revoke failed"),
        }
    }
}
