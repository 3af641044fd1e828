//! The relay's etcd registration, alive exactly while the engine's stream is.
//!
//! The key `kv-router/{ns}/workers/{worker_id}` holds the JSON
//! [`kv_events::discovery::WorkerRegistration`], bound to a lease of
//! `--lease-ttl-secs`. The lease is granted when an engine socket is connected and
//! the engine's facts allow a registration ([`crate::facts`]: the block size is known
//! and the metrics page was read once); it is renewed every TTL/3, and revoked as
//! soon as every engine socket is disconnected (routers then drop the worker at once:
//! its engine is gone) or the relay shuts down. A fact learned while registered (the
//! capacity, say) rewrites the key under the same lease. A renewal that cannot reach
//! one etcd member keeps the same lease alive through another; only a lease etcd
//! says is gone is replaced by a new one, with the key written again. If the relay
//! itself dies, the lease expires after the TTL. Cost: one etcd round trip per TTL/3.
//! The lease itself is [`kv_cluster::lease`], shared with the mock engines.

use crate::facts::{EngineFacts, WorkerIdentity};
use kv_cluster::lease::WorkerLease;
use kv_events::discovery::WorkerRegistration;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Wait before retrying a failed registration.
const RETRY: Duration = Duration::from_secs(1);

/// The registration the relay may write now: the engine is connected and its facts
/// allow one.
fn registrable(
    alive: &watch::Receiver<bool>,
    facts: &watch::Receiver<EngineFacts>,
    who: &WorkerIdentity,
) -> Option<WorkerRegistration> {
    if *alive.borrow() {
        facts.borrow().registration(who)
    } else {
        None
    }
}

/// Where the registration goes.
pub struct Registration {
    /// etcd connection.
    pub etcd: kv_cluster::etcd::EtcdClient,
    /// `kv-router/{ns}/workers/{worker_id}`.
    pub key: String,
    /// Lease TTL, in seconds (validated by the configuration: 3 or more).
    pub ttl_secs: u64,
    /// The worker apart from the engine's facts.
    pub who: WorkerIdentity,
}

/// Registers the worker while the engine is alive and its facts allow it, keeps the
/// registration equal to the facts, revokes it when `alive` turns false, and revokes
/// it for good on `shutdown` (or when the engine's side of `alive` is gone).
pub async fn run(
    target: Registration,
    mut alive: watch::Receiver<bool>,
    facts: watch::Sender<EngineFacts>,
    shutdown: CancellationToken,
) {
    let Registration {
        etcd,
        key,
        ttl_secs,
        who,
    } = target;
    // Holding the sender here, the facts channel never closes under this task.
    let mut facts_rx = facts.subscribe();
    let mut lease: Option<WorkerLease> = None;
    let mut waiting_logged = false;
    loop {
        // Wait for the engine and its facts.
        let mut current = loop {
            if let Some(reg) = registrable(&alive, &facts_rx, &who) {
                break reg;
            }
            if *alive.borrow() && !waiting_logged {
                waiting_logged = true;
                info!(%key, "engine connected; registering once its block size is known \
                    (from its metrics page, or its first stored-block event)");
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                up = alive.changed() => if up.is_err() { return },
                _ = facts_rx.changed() => {}
            }
        };
        match lease.as_mut() {
            // Not granted here: the record is only stored for the grant below.
            Some(l) => {
                if let Err(e) = l.update(&current).await {
                    warn!(%key, error = %e, "registration record not stored");
                }
            }
            None => match WorkerLease::new(etcd.clone(), key.clone(), &current, ttl_secs) {
                Ok(new) => lease = Some(new),
                Err(e) => {
                    error!(%key, error = %e, "the registration cannot be written; the worker stays unregistered");
                    return;
                }
            },
        }
        let Some(lease) = lease.as_mut() else {
            return; // Set just above.
        };
        if let Err(e) = lease.grant().await {
            warn!(key = %lease.key(), error = %e, "registration failed, retrying");
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(RETRY) => continue,
            }
        }
        info!(key = %lease.key(), block_size = current.block_size,
            total_kv_blocks = current.total_kv_blocks, max_model_len = current.max_model_len,
            "registered the engine's block size and capacity");
        let mut tick = lease.renewal_ticks();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => {
                    lease.revoke().await;
                    return;
                }
                changed = alive.changed() => {
                    let gone = changed.is_err();
                    if gone || !*alive.borrow() {
                        if !gone {
                            info!(key = %lease.key(), "engine stream down; revoking the registration");
                        }
                        lease.revoke().await;
                        if gone {
                            return;
                        }
                        break;
                    }
                }
                _ = facts_rx.changed() => {
                    let next = facts_rx.borrow_and_update().registration(&who);
                    if let Some(next) = next.filter(|n| *n != current) {
                        match lease.update(&next).await {
                            Ok(()) => current = next,
                            Err(e) => warn!(key = %lease.key(), error = %e, "registration update failed; written again after the next renewal"),
                        }
                    }
                }
                _ = tick.tick() => lease.renew_or_regrant().await,
            }
        }
    }
}
