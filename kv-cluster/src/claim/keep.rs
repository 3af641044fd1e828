//! Keeping a claim: renew its lease, take the key again after the lease lapsed, and
//! report the claim lost when another holder took it meanwhile.

use super::{Take, WorkerIdClaim};
use crate::lease::{KeptLease, Renewal, renew_period, ticks_every};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Whether the claim is still ours after a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// Ours (or not known to be lost yet: etcd failed, the next tick retries).
    Kept,
    /// Another holder has the key.
    Lost,
}

impl WorkerIdClaim {
    /// Renews the claim's lease every TTL/3 until `stop`, then revokes it (deleting
    /// the key, so the id is free at once). If the lease is found gone, the key is
    /// taken again under a new lease; if another holder took it meanwhile,
    /// [`Self::lost`] fires and this returns without touching the other's key.
    pub async fn keep_until(mut self, stop: CancellationToken) {
        let mut tick = ticks_every(renew_period(self.ttl_secs));
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = tick.tick() => {
                    if self.renew_or_take_again().await == Held::Lost {
                        self.lost.cancel();
                        return;
                    }
                }
            }
        }
        if let Some(lease) = self.lease.take()
            && KeptLease::revoke_id(&mut self.client, lease.lease_id, &self.key).await
        {
            info!(key = %self.key, worker_id = %self.worker_id, "worker id claim released");
        }
    }

    async fn renew_or_take_again(&mut self) -> Held {
        if let Some(lease) = self.lease.as_mut() {
            match lease.renew(&mut self.client, &self.key).await {
                // Failed: no member answered within the period; the lease may well
                // be alive, the next tick tries again.
                Renewal::Alive | Renewal::Failed => return Held::Kept,
                Renewal::Expired => self.lease = None,
            }
        }
        self.take_again().await
    }

    /// The lease is gone (and with it the key): take the key again, create-only.
    async fn take_again(&mut self) -> Held {
        let lease = match KeptLease::grant(&mut self.client, self.ttl_secs).await {
            Ok(lease) => lease,
            Err(e) => {
                warn!(key = %self.key, error = %e, "re-claiming the worker id failed, retrying");
                return Held::Kept;
            }
        };
        match self.take(lease.lease_id).await {
            Ok(Take::Taken) => {
                warn!(
                    key = %self.key,
                    worker_id = %self.worker_id,
                    lease_id = lease.lease_id,
                    "worker id claim lease had expired; claimed again"
                );
                self.lease = Some(lease);
                Held::Kept
            }
            Ok(Take::Held { seen, .. }) => {
                error!(
                    key = %self.key,
                    worker_id = %self.worker_id,
                    holder = %seen,
                    "worker id claim lost to another holder; stopping"
                );
                KeptLease::revoke_id(&mut self.client, lease.lease_id, &self.key).await;
                Held::Lost
            }
            Err(e) => {
                // Whether the put happened is unknown: revoking the new lease deletes
                // the key if it did, so the next attempt starts clean.
                warn!(key = %self.key, error = %e, "re-claiming the worker id failed, retrying");
                KeptLease::revoke_id(&mut self.client, lease.lease_id, &self.key).await;
                Held::Kept
            }
        }
    }
}
