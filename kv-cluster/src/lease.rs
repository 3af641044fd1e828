//! The publisher side of discovery: one worker's etcd registration under a lease —
//! grant, put, keep alive, revoke. Used by `kv-router relay` (registered while its
//! engine is up) and by the mock engines (`kv-mocker engines`), so every worker in a
//! namespace registers the way the [`crate::directory`] of the router expects; the
//! worker id claims ([`crate::claim`]) keep their leases the same way.
//!
//! The key `kv-router/{ns}/workers/{worker_id}` holds the JSON [`WorkerRegistration`],
//! bound to a lease of `ttl_secs`. The lease is renewed every TTL/3 over etcd's
//! keep-alive stream, a gRPC stream bound to the one etcd member it was opened on.
//!
//! # Losing an etcd member
//! The client is given every endpoint and balances calls over the members it can
//! reach; a member that died fails its calls at once (connection refused) or is left
//! out while it does not connect. When the keep-alive stream fails (its member died,
//! or it does not answer within half the retry window), the renewal opens a new
//! stream for the **same** lease — the balancer places it on another member — and
//! retries, 100 ms doubling to 1 s apart, for up to TTL/3 (at most
//! [`ETCD_CALL_TIMEOUT`]); if no member answered, the next tick tries again, so a
//! lease gets about three retry windows before its TTL runs out. A new lease is
//! granted, and the key written again, only when etcd answers that the lease is gone
//! (TTL 0 or "lease not found": it expired while etcd was unreachable for longer than
//! the TTL, or it was revoked) — never because one member is unreachable, since a new
//! lease and the old one's expiry make routers drop the worker and forget its index.
//! While the leader is being re-elected, renewals wait or fail and are retried; the
//! new leader extends every lease, so a lease renewed through the election survives.
//!
//! Revoking deletes the key at once, so routers drop the worker without waiting for
//! the TTL. Every other etcd call is bounded by [`ETCD_CALL_TIMEOUT`], so an
//! unreachable etcd cannot hang start-up or shutdown. Cost: one small etcd round trip
//! per TTL/3, plus a stream reopen (one round trip) after a member is lost.

use crate::Error;
use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use kv_events::discovery::WorkerRegistration;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

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
    /// etcd answered that the lease is gone (TTL 0, or "lease not found"): its keys
    /// are deleted.
    Expired,
    /// No member renewed it in time (logged); the lease may still be alive.
    Failed,
}

/// First pause between two renewal attempts; it doubles up to [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(100);
/// Largest pause between two renewal attempts.
const RETRY_MAX: Duration = Duration::from_secs(1);

/// How long one renewal (or re-grant) of a lease renewed every `period` keeps
/// retrying: until the next renewal is due, and at most [`ETCD_CALL_TIMEOUT`], so
/// a renewal under way holds its caller no longer than one etcd call could.
pub(crate) fn retry_window(period: Duration) -> Duration {
    period.min(ETCD_CALL_TIMEOUT)
}

/// The bound on one renewal attempt: half the [`retry_window`], so at least two
/// attempts, through different members, fit in it.
fn attempt_timeout(period: Duration) -> Duration {
    retry_window(period) / 2
}

/// Whether etcd said the lease does not exist (it expired or was revoked).
fn lease_gone(e: &etcd_client::Error) -> bool {
    // etcd-client reports a keep-alive answered with TTL 0 as "lease not found";
    // etcd itself says "etcdserver: requested lease not found".
    e.to_string().contains("lease not found")
}

/// A granted lease and, while one is open, its keep-alive stream (bound to the
/// member it was opened on).
pub(crate) struct KeptLease {
    pub(crate) lease_id: i64,
    ttl_secs: i64,
    stream: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
}

impl KeptLease {
    /// Grants a lease of `ttl_secs` (no key attached yet) and opens its keep-alive
    /// stream.
    pub(crate) async fn grant(client: &mut Client, ttl_secs: i64) -> Result<Self, Error> {
        let lease_id = bounded(client.lease_grant(ttl_secs, None)).await?.id();
        match bounded(client.lease_keep_alive(lease_id)).await {
            Ok(stream) => Ok(Self {
                lease_id,
                ttl_secs,
                stream: Some(stream),
            }),
            Err(e) => {
                Self::revoke_id(client, lease_id, "").await;
                Err(e)
            }
        }
    }

    /// How often the lease is renewed: a third of its TTL.
    pub(crate) fn period(&self) -> Duration {
        renew_period(self.ttl_secs)
    }

    /// Renews the lease, retrying until etcd answers or the [`retry_window`] has
    /// passed; `key` names it in the logs.
    ///
    /// An attempt renews on the open keep-alive stream; once that stream failed (its
    /// member died or stopped answering), the next attempt opens a new stream for the
    /// *same* lease, which the client's balancer places on a member that is
    /// connected, so a lost member costs a retry, not the lease. Attempts are bounded
    /// by [`attempt_timeout`] and spaced 100 ms doubling to 1 s. Only etcd's answer
    /// that the lease is gone yields [`Renewal::Expired`]; an unreachable etcd yields
    /// [`Renewal::Failed`] and the caller tries again at its next tick.
    pub(crate) async fn renew(&mut self, client: &mut Client, key: &str) -> Renewal {
        let period = self.period();
        let deadline = Instant::now() + retry_window(period);
        let mut delay = RETRY_MIN;
        let mut failures = 0u32;
        loop {
            let attempt =
                attempt_timeout(period).min(deadline.saturating_duration_since(Instant::now()));
            match self.attempt(client, key, attempt).await {
                Ok(true) => {
                    if failures > 0 {
                        info!(
                            key,
                            lease_id = self.lease_id,
                            failures,
                            "lease renewed after failed attempts"
                        );
                    }
                    return Renewal::Alive;
                }
                Ok(false) => {
                    warn!(key, lease_id = self.lease_id, "lease expired");
                    return Renewal::Expired;
                }
                Err(e) => {
                    failures += 1;
                    if failures == 1 {
                        warn!(key, lease_id = self.lease_id, error = %e, "lease renewal failed; retrying on another connection");
                    } else {
                        debug!(key, lease_id = self.lease_id, error = %e, "lease renewal failed again");
                    }
                }
            }
            if Instant::now() + delay >= deadline {
                warn!(
                    key,
                    lease_id = self.lease_id,
                    failures,
                    "lease not renewed; retrying at the next renewal"
                );
                return Renewal::Failed;
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(RETRY_MAX);
        }
    }

    /// One renewal within `timeout`: whether the lease is alive, or why etcd did not
    /// answer. A failed stream is dropped, so the next attempt opens another.
    async fn attempt(
        &mut self,
        client: &mut Client,
        key: &str,
        timeout: Duration,
    ) -> Result<bool, String> {
        let Some((keeper, stream)) = self.stream.as_mut() else {
            // Opening the stream is a renewal: its first answer carries the TTL.
            return match tokio::time::timeout(timeout, client.lease_keep_alive(self.lease_id)).await
            {
                Ok(Ok(opened)) => {
                    debug!(
                        key,
                        lease_id = self.lease_id,
                        "lease keep-alive stream reopened"
                    );
                    self.stream = Some(opened);
                    Ok(true)
                }
                Ok(Err(e)) if lease_gone(&e) => Ok(false),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {timeout:?}")),
            };
        };
        let renewed = async {
            keeper.keep_alive().await?;
            stream.message().await
        };
        let answer = match tokio::time::timeout(timeout, renewed).await {
            Ok(Ok(Some(resp))) => return Ok(resp.ttl() > 0),
            Ok(Ok(None)) => "the keep-alive stream closed".to_owned(),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {timeout:?}"),
        };
        self.stream = None;
        Err(answer)
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
    /// Whether the key under the active lease may differ from `value` (an update
    /// failed): written again after the next renewal.
    stale: bool,
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
            stale: false,
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
    /// refuses the write or does not answer in time (the record is kept and written
    /// after the next renewal or grant).
    pub async fn update(&mut self, record: &WorkerRegistration) -> Result<(), Error> {
        self.value = serde_json::to_string(record)?;
        if self.active.is_none() {
            return Ok(());
        }
        self.stale = true;
        self.write().await
    }

    /// Writes the record under the active lease (a no-op without one).
    async fn write(&mut self) -> Result<(), Error> {
        let Some(active) = &self.active else {
            return Ok(());
        };
        let put = PutOptions::new().with_lease(active.lease_id);
        bounded(
            self.client
                .put(self.key.clone(), self.value.clone(), Some(put)),
        )
        .await?;
        self.stale = false;
        info!(key = %self.key, lease_id = active.lease_id, "worker registration updated");
        Ok(())
    }

    /// The etcd key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease the key is bound to, once granted.
    pub fn lease_id(&self) -> Option<i64> {
        self.active.as_ref().map(|a| a.lease_id)
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
        self.stale = false;
        Ok(())
    }

    /// Renews the lease, through any member that answers within one
    /// [`Self::renew_period`]; false if none is granted, etcd says it is gone, or no
    /// member renewed it in time (logged).
    pub async fn renew(&mut self) -> bool {
        self.renewal().await == Renewal::Alive
    }

    async fn renewal(&mut self) -> Renewal {
        match self.active.as_mut() {
            Some(active) => active.renew(&mut self.client, &self.key).await,
            None => Renewal::Expired,
        }
    }

    /// Renews the *same* lease (retrying through other members for up to one
    /// [`Self::renew_period`]); grants a new one only when etcd says the lease is
    /// gone or none is granted, retrying that within the period too. An unreachable
    /// etcd keeps the lease for the next call. Failures are logged; a record whose
    /// update failed is written again after a renewal.
    pub async fn renew_or_regrant(&mut self) {
        match self.renewal().await {
            Renewal::Alive => {
                if self.stale
                    && let Err(e) = self.write().await
                {
                    warn!(key = %self.key, error = %e, "registration record not written, retrying after the next renewal");
                }
                return;
            }
            Renewal::Failed => return,
            Renewal::Expired => {}
        }
        let deadline = Instant::now() + retry_window(self.renew_period());
        let mut delay = RETRY_MIN;
        loop {
            match self.grant().await {
                Ok(()) => return,
                Err(e) if Instant::now() + delay >= deadline => {
                    warn!(key = %self.key, error = %e, "re-registration failed, retrying");
                    return;
                }
                Err(e) => debug!(key = %self.key, error = %e, "re-registration failed, retrying"),
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(RETRY_MAX);
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
    /// then revokes it. A renewal under way is abandoned at `shutdown`.
    pub async fn keep_alive_until(mut self, shutdown: CancellationToken) {
        let mut tick = self.renewal_ticks();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = tick.tick() => {
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = self.renew_or_regrant() => {}
                    }
                }
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

    #[test]
    fn a_renewal_retries_until_the_next_is_due_and_at_most_one_call_timeout() {
        let period = renew_period(3);
        assert_eq!(retry_window(period), Duration::from_secs(1));
        assert_eq!(attempt_timeout(period), Duration::from_millis(500));
        let long = renew_period(60);
        assert_eq!(retry_window(long), ETCD_CALL_TIMEOUT);
        assert_eq!(attempt_timeout(long), ETCD_CALL_TIMEOUT / 2);
    }

    #[test]
    fn only_etcds_lease_not_found_means_the_lease_is_gone() {
        let gone = [
            etcd_client::Error::LeaseKeepAliveError("lease not found".into()),
            etcd_client::Error::InvalidArgs("etcdserver: requested lease not found".into()),
        ];
        assert!(gone.iter().all(lease_gone));
        let unreachable = [
            etcd_client::Error::LeaseKeepAliveError("channel closed".into()),
            etcd_client::Error::InvalidArgs("transport error".into()),
        ];
        assert!(!unreachable.iter().any(lease_gone));
    }
}
