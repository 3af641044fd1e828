//! The publisher side of discovery: one worker's etcd registration under a lease —
//! grant, put, keep alive, revoke. Used by `kv-router relay` (registered while its
//! engine is up) and by the mock engines (`kv-mocker engines`), so every worker in a
//! namespace registers the way the [`crate::directory`] of the router expects.
//!
//! The key `kv-router/{ns}/workers/{worker_id}` holds the JSON [`WorkerRegistration`],
//! bound to a lease of `ttl_secs`. The lease is renewed every TTL/3 over etcd's
//! keep-alive stream; a renewal that fails or finds the lease gone (TTL 0, e.g. after
//! etcd was unreachable for longer than the TTL) grants a new lease and writes the key
//! again. Revoking deletes the key at once, so routers drop the worker without waiting
//! for the TTL. Every etcd call is bounded by [`ETCD_CALL_TIMEOUT`], so an unreachable
//! etcd cannot hang start-up or shutdown. Cost: one small etcd round trip per TTL/3.

use crate::Error;
use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use kv_events::discovery::WorkerRegistration;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Upper bound on one etcd call, in wall-clock time.
pub const ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) async fn bounded<T>(
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(ETCD_CALL_TIMEOUT, call)
        .await
        .map_err(|_| Error::Timeout(ETCD_CALL_TIMEOUT))?
        .map_err(Error::from)
}

/// A TTL etcd accepts: 1 to `i64::MAX` seconds.
pub(crate) fn checked_ttl(ttl_secs: u64) -> Result<i64, Error> {
    i64::try_from(ttl_secs)
        .ok()
        .filter(|t| *t > 0)
        .ok_or(Error::TtlOutOfRange(ttl_secs))
}

/// A third of the TTL, so two renewals can fail before the lease expires.
pub(crate) fn renew_period(ttl_secs: i64) -> Duration {
    Duration::from_millis(ttl_secs.unsigned_abs().saturating_mul(1_000) / 3)
}

/// An interval firing every `period`, first one period from now, delaying (not
/// bursting) after a missed tick.
pub(crate) fn ticks_every(period: Duration) -> tokio::time::Interval {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

/// What one renewal found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// etcd renewed the lease.
    Alive,
    /// etcd answered that the lease is gone (TTL 0): its keys are deleted.
    Expired,
    /// The keep-alive failed, timed out or its stream closed (logged); the lease may
    /// still be alive.
    Failed,
}

/// A granted lease with its keep-alive stream.
pub(crate) struct KeptLease {
    pub(crate) lease_id: i64,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
}

impl KeptLease {
    /// Grants a lease of `ttl_secs` (no key attached yet) and opens its keep-alive
    /// stream.
    pub(crate) async fn grant(client: &mut Client, ttl_secs: i64) -> Result<Self, Error> {
        let lease_id = bounded(client.lease_grant(ttl_secs, None)).await?.id();
        match Self::keep(client, lease_id).await {
            Ok(kept) => Ok(kept),
            Err(e) => {
                Self::revoke_id(client, lease_id, "").await;
                Err(e)
            }
        }
    }

    /// Opens a (new) keep-alive stream for an existing lease.
    pub(crate) async fn keep(client: &mut Client, lease_id: i64) -> Result<Self, Error> {
        let (keeper, stream) = bounded(client.lease_keep_alive(lease_id)).await?;
        Ok(Self {
            lease_id,
            keeper,
            stream,
        })
    }

    /// Renews the lease once; `key` names it in the logs.
    pub(crate) async fn renew(&mut self, key: &str) -> Renewal {
        if let Err(e) = self.keeper.keep_alive().await {
            warn!(key, error = %e, "lease keep-alive failed");
            return Renewal::Failed;
        }
        match tokio::time::timeout(ETCD_CALL_TIMEOUT, self.stream.message()).await {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => Renewal::Alive,
            Ok(Ok(Some(_))) => {
                warn!(key, lease_id = self.lease_id, "lease expired");
                Renewal::Expired
            }
            Ok(Ok(None)) => {
                warn!(key, "lease keep-alive stream closed");
                Renewal::Failed
            }
            Ok(Err(e)) => {
                warn!(key, error = %e, "lease keep-alive failed");
                Renewal::Failed
            }
            Err(_) => {
                warn!(key, "lease keep-alive timed out");
                Renewal::Failed
            }
        }
    }

    /// Revokes lease `lease_id`, deleting its keys; a failure is logged (the lease
    /// then expires after its TTL). Returns whether etcd confirmed.
    pub(crate) async fn revoke_id(client: &mut Client, lease_id: i64, key: &str) -> bool {
        match bounded(client.lease_revoke(lease_id)).await {
            Ok(_) => true,
            Err(e) => {
                warn!(key, lease_id, error = %e, "lease revoke failed; it expires after its ttl");
                false
            }
        }
    }
}

/// One worker's registration: what to write where, and the lease holding it (if
/// granted).
pub struct WorkerLease {
    client: Client,
    key: String,
    value: String,
    ttl_secs: i64,
    active: Option<KeptLease>,
}

impl WorkerLease {
    /// A registration of `record` at `key` with leases of `ttl_secs`; nothing is
    /// written until [`Self::grant`].
    ///
    /// # Errors
    /// [`Error::TtlOutOfRange`] for a TTL of 0 or above `i64::MAX` seconds;
    /// [`Error::Encode`] if the record cannot be serialized.
    pub fn new(
        client: Client,
        key: String,
        record: &WorkerRegistration,
        ttl_secs: u64,
    ) -> Result<Self, Error> {
        Ok(Self {
            client,
            key,
            value: serde_json::to_string(record)?,
            ttl_secs: checked_ttl(ttl_secs)?,
            active: None,
        })
    }

    /// [`Self::new`], then [`Self::grant`].
    ///
    /// # Errors
    /// As both.
    pub async fn register(
        client: Client,
        key: String,
        record: &WorkerRegistration,
        ttl_secs: u64,
    ) -> Result<Self, Error> {
        let mut lease = Self::new(client, key, record, ttl_secs)?;
        lease.grant().await?;
        Ok(lease)
    }

    /// Replaces the record; when a lease is granted, the key is written again under
    /// it at once (routers see a changed registration), otherwise at the next
    /// [`Self::grant`].
    ///
    /// # Errors
    /// [`Error::Encode`] if the record cannot be serialized; [`Error`] if etcd
    /// refuses the write or does not answer in time (the record is kept for the next
    /// grant).
    pub async fn update(&mut self, record: &WorkerRegistration) -> Result<(), Error> {
        self.value = serde_json::to_string(record)?;
        let Some(active) = &self.active else {
            return Ok(());
        };
        let put = PutOptions::new().with_lease(active.lease_id);
        bounded(
            self.client
                .put(self.key.clone(), self.value.clone(), Some(put)),
        )
        .await?;
        info!(key = %self.key, lease_id = active.lease_id, "worker registration updated");
        Ok(())
    }

    /// The etcd key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// How often the lease is renewed: a third of its TTL.
    pub fn renew_period(&self) -> Duration {
        renew_period(self.ttl_secs)
    }

    /// Grants a new lease, writes the key under it and opens the keep-alive stream;
    /// the previous lease, if any, is dropped (it expires on its own).
    ///
    /// # Errors
    /// [`Error`] if etcd refuses or does not answer in time.
    pub async fn grant(&mut self) -> Result<(), Error> {
        self.active = None;
        let kept = KeptLease::grant(&mut self.client, self.ttl_secs).await?;
        let put = PutOptions::new().with_lease(kept.lease_id);
        let written = bounded(
            self.client
                .put(self.key.clone(), self.value.clone(), Some(put)),
        )
        .await;
        if let Err(e) = written {
            KeptLease::revoke_id(&mut self.client, kept.lease_id, &self.key).await;
            return Err(e);
        }
        info!(key = %self.key, lease_id = kept.lease_id, "worker registered");
        self.active = Some(kept);
        Ok(())
    }

    /// Renews the lease once; false if none is granted, the lease is gone, or etcd
    /// failed (logged).
    pub async fn renew(&mut self) -> bool {
        match self.active.as_mut() {
            Some(active) => active.renew(&self.key).await == Renewal::Alive,
            None => false,
        }
    }

    /// Renews, or re-grants after a failed renewal (logging a failed re-grant; the
    /// next tick retries).
    pub async fn renew_or_regrant(&mut self) {
        if self.renew().await {
            return;
        }
        if let Err(e) = self.grant().await {
            warn!(key = %self.key, error = %e, "re-registration failed, retrying");
        }
    }

    /// Revokes the lease, deleting the key; failures are logged (the lease then
    /// expires after its TTL). A no-op without a granted lease.
    pub async fn revoke(&mut self) {
        let Some(active) = self.active.take() else {
            return;
        };
        if KeptLease::revoke_id(&mut self.client, active.lease_id, &self.key).await {
            info!(key = %self.key, "worker registration revoked");
        }
    }

    /// Keeps the registration alive every [`Self::renew_period`] until `shutdown`,
    /// then revokes it.
    pub async fn keep_alive_until(mut self, shutdown: CancellationToken) {
        let mut tick = self.renewal_ticks();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = tick.tick() => self.renew_or_regrant().await,
            }
        }
        self.revoke().await;
    }

    /// An interval firing every [`Self::renew_period`], first one period from now,
    /// delaying (not bursting) after a missed tick.
    pub fn renewal_ticks(&self) -> tokio::time::Interval {
        ticks_every(self.renew_period())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_must_be_positive_and_fit_etcd_and_renewal_is_a_third_of_it() {
        for bad in [0, u64::MAX, i64::MAX as u64 + 1] {
            let err = checked_ttl(bad).expect_err("refused");
            assert!(matches!(err, Error::TtlOutOfRange(t) if t == bad), "{err}");
            assert!(err.to_string().contains("out of range"), "{err}");
        }
        assert_eq!(checked_ttl(10).expect("valid"), 10);
        assert_eq!(renew_period(9), Duration::from_secs(3));
        assert_eq!(renew_period(10), Duration::from_millis(3_333));
        assert_eq!(renew_period(i64::MAX), Duration::from_millis(u64::MAX / 3));
    }
}
