//! The relay's etcd registration, alive exactly while the engine's stream is.
//!
//! The key `kv-router/{ns}/workers/{worker_id}` holds the JSON
//! [`WorkerRegistration`], bound to a lease of `--lease-ttl-secs`. The lease is granted
//! when the first engine socket connects, renewed every TTL/3, and revoked as soon as
//! every engine socket is disconnected (routers then drop the worker at once: its
//! engine is gone) or the relay shuts down. A renewal that fails or finds the lease
//! expired grants a new lease and writes the key again. If the relay itself dies, the
//! lease expires after the TTL. Cost: one etcd round trip per TTL/3.

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use kv_events::discovery::WorkerRegistration;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Upper bound on one etcd call, in wall-clock time.
const ETCD_CALL: Duration = Duration::from_secs(5);
/// Wait before retrying a failed registration.
const RETRY: Duration = Duration::from_secs(1);

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// etcd returned an error.
    #[error("etcd request failed: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// etcd did not answer in time.
    #[error("etcd did not answer within {0:?}")]
    Timeout(Duration),
}

async fn bounded<T>(
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, LeaseError> {
    tokio::time::timeout(ETCD_CALL, call)
        .await
        .map_err(|_| LeaseError::Timeout(ETCD_CALL))?
        .map_err(LeaseError::from)
}

/// What to register, where, for how long.
pub struct LeaseTask {
    /// etcd client.
    pub client: Client,
    /// The worker key.
    pub key: String,
    /// The JSON registration.
    pub value: String,
    /// TTL in seconds (validated ≥ 3 and within i64).
    pub ttl_secs: i64,
}

struct Active {
    lease_id: i64,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
}

impl LeaseTask {
    /// A task registering `record` under `key`.
    ///
    /// # Errors
    /// When the record cannot be encoded (never for a valid registration).
    pub fn new(
        client: Client,
        key: String,
        record: &WorkerRegistration,
        ttl_secs: i64,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self {
            client,
            key,
            value: serde_json::to_string(record)?,
            ttl_secs,
        })
    }

    async fn grant(&mut self) -> Result<Active, LeaseError> {
        let lease_id = bounded(self.client.lease_grant(self.ttl_secs, None))
            .await?
            .id();
        let put = PutOptions::new().with_lease(lease_id);
        bounded(
            self.client
                .put(self.key.clone(), self.value.clone(), Some(put)),
        )
        .await?;
        let (keeper, stream) = bounded(self.client.lease_keep_alive(lease_id)).await?;
        info!(key = %self.key, lease_id, "worker registered");
        Ok(Active {
            lease_id,
            keeper,
            stream,
        })
    }

    async fn renew(&self, active: &mut Active) -> bool {
        if let Err(e) = active.keeper.keep_alive().await {
            warn!(key = %self.key, error = %e, "lease keep-alive failed");
            return false;
        }
        match tokio::time::timeout(ETCD_CALL, active.stream.message()).await {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => true,
            other => {
                warn!(key = %self.key, lease_id = active.lease_id, result = ?other.map(|r| r.map(|m| m.map(|m| m.ttl()))), "lease lost");
                false
            }
        }
    }

    async fn revoke(&mut self, active: Active) {
        match bounded(self.client.lease_revoke(active.lease_id)).await {
            Ok(_) => info!(key = %self.key, "worker registration revoked"),
            Err(e) => {
                warn!(key = %self.key, error = %e, "lease revoke failed; it expires after its ttl")
            }
        }
    }

    /// Registers while `alive` is true, revokes when it turns false, and revokes
    /// for good on `shutdown`.
    pub async fn run(mut self, mut alive: watch::Receiver<bool>, shutdown: CancellationToken) {
        let period = Duration::from_millis(self.ttl_secs.unsigned_abs() * 1000 / 3);
        loop {
            // Wait for the engine.
            tokio::select! {
                () = shutdown.cancelled() => return,
                up = async { alive.wait_for(|a| *a).await.is_ok() } => if !up { return },
            }
            let mut active = match self.grant().await {
                Ok(active) => active,
                Err(e) => {
                    warn!(key = %self.key, error = %e, "registration failed, retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(RETRY) => continue,
                    }
                }
            };
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => {
                        self.revoke(active).await;
                        return;
                    }
                    down = async { alive.wait_for(|a| !*a).await.is_ok() } => {
                        if down {
                            info!(key = %self.key, "engine stream down; revoking the registration");
                        }
                        self.revoke(active).await;
                        if !down {
                            return;
                        }
                        break;
                    }
                    _ = tick.tick() => {
                        if !self.renew(&mut active).await {
                            match self.grant().await {
                                Ok(new) => active = new,
                                Err(e) => warn!(key = %self.key, error = %e, "re-registration failed, retrying"),
                            }
                        }
                    }
                }
            }
        }
    }
}
