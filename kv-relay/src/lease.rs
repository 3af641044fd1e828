//! The relay's etcd registration, alive exactly while the engine's stream is.
//!
//! The key `kv-router/{ns}/workers/{worker_id}` holds the JSON
//! [`kv_events::discovery::WorkerRegistration`], bound to a lease of
//! `--lease-ttl-secs`. The lease is granted when the first engine socket connects, renewed every TTL/3, and revoked as soon as
//! every engine socket is disconnected (routers then drop the worker at once: its
//! engine is gone) or the relay shuts down. A renewal that fails or finds the lease
//! expired grants a new lease and writes the key again. If the relay itself dies, the
//! lease expires after the TTL. Cost: one etcd round trip per TTL/3. The lease itself
//! is [`kv_cluster::lease`], shared with the mock engines.

use kv_cluster::lease::WorkerLease;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Wait before retrying a failed registration.
const RETRY: Duration = Duration::from_secs(1);

/// Registers `lease` while `alive` is true, revokes it when `alive` turns false, and
/// revokes it for good on `shutdown` (or when the engine's side of `alive` is gone).
pub async fn run(
    mut lease: WorkerLease,
    mut alive: watch::Receiver<bool>,
    shutdown: CancellationToken,
) {
    loop {
        // Wait for the engine.
        tokio::select! {
            () = shutdown.cancelled() => return,
            up = async { alive.wait_for(|a| *a).await.is_ok() } => if !up { return },
        }
        if let Err(e) = lease.grant().await {
            warn!(key = %lease.key(), error = %e, "registration failed, retrying");
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(RETRY) => continue,
            }
        }
        let mut tick = lease.renewal_ticks();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => {
                    lease.revoke().await;
                    return;
                }
                down = async { alive.wait_for(|a| !*a).await.is_ok() } => {
                    if down {
                        info!(key = %lease.key(), "engine stream down; revoking the registration");
                    }
                    lease.revoke().await;
                    if !down {
                        return;
                    }
                    break;
                }
                _ = tick.tick() => lease.renew_or_regrant().await,
            }
        }
    }
}
