//! The roll call (docs/protocol.md, "Roll call"): one request that every router
//! replica answers, naming itself.
//!
//! Why: under the `lowest` pin target a gateway pins to the lowest replica id it
//! knows, so gateways agree on one replica only once each has heard of it. Readiness
//! probes through the queue group each reach one replica at random: with 8 replicas
//! started after the gateways, a gateway took several windows to hear of the lowest,
//! and 3–11% of a quickstart pass's queries were placed by other replicas. One roll
//! call hears every replica that is up, in one round trip.
//!
//! Cost: one subscription and one request per call, one small reply per replica, and
//! a wait of about a tenth of [`ROLL_CALL_WAIT`] once the first reply is in (the whole
//! of it when nobody answers); the caller runs it in the background, one at a time
//! (module `router::stalls`).

use super::verdict_after;
use async_nats::Client;
use futures::StreamExt as _;
use kv_events::RouterId;
use std::time::Duration;
use tokio::time::Instant;
use tracing::debug;

/// Longest a roll call waits for its replies. Replicas answer within a millisecond
/// on one host and a few across a network; nobody answering within this means no
/// replica is up, or only replicas from before the roll call are.
pub(super) const ROLL_CALL_WAIT: Duration = Duration::from_millis(250);

/// Asks every replica on `subject`, calls `heard` with each that answers as its
/// reply comes (at most `max` of them), and returns how many did: the replies that
/// come within [`verdict_after`] the first one's delay (at most `wait`), each naming
/// its replica in [`kv_events::ROUTER_ID_HEADER`] (a reply that names none is
/// skipped). 0 when nobody answers within `wait`, or the request cannot be sent
/// (NATS is away).
pub(super) async fn roll_call(
    nats: &Client,
    subject: String,
    wait: Duration,
    max: usize,
    mut heard_of: impl FnMut(RouterId),
) -> usize {
    let inbox = nats.new_inbox();
    // One connection: the server reads the subscription before the request.
    let Ok(mut replies) = nats.subscribe(inbox.clone()).await else {
        return 0;
    };
    if let Err(e) = (nats.publish_with_reply(subject, inbox, bytes::Bytes::new())).await {
        debug!(error = %e, "roll call not sent");
        return 0;
    }
    let started = Instant::now();
    let mut deadline = started + wait;
    let mut heard: Vec<RouterId> = Vec::new();
    while heard.len() < max {
        let Ok(Some(reply)) = tokio::time::timeout_at(deadline, replies.next()).await else {
            break;
        };
        let Some(router) = super::named_replica(&reply) else {
            continue;
        };
        if heard.is_empty() {
            deadline = deadline.min(started + verdict_after(started.elapsed(), wait));
        }
        if !heard.contains(&router) {
            heard.push(router);
            heard_of(router);
        }
    }
    let _ = replies.unsubscribe().await;
    debug!(replicas = heard.len(), "roll call");
    heard.len()
}
