//! Lifecycle messages from frontends: `prefill_done` moves a request's prefill tokens
//! out of the worker's load, `freed` releases its decode blocks.
//!
//! A message for an unknown request (already freed, routed by another replica, or
//! sent twice) is counted as rejected and otherwise ignored: load accounting is
//! advisory and must never fail on a frontend's retry.

use crate::counters::{MessageKind, Outcome};
use crate::state::RouterState;
use kv_events::decode;
use kv_events::routing::{LifecycleEvent, LifecycleMessage};
use tracing::{debug, warn};

/// Applies one lifecycle payload received on `subject`.
pub fn handle_lifecycle(state: &RouterState, subject: &str, payload: &[u8]) {
    let msg: LifecycleMessage = match decode(payload) {
        Ok(m) => m,
        Err(e) => {
            state
                .counters
                .message(MessageKind::Lifecycle, Outcome::Malformed);
            warn!(subject, error = %e, "malformed lifecycle message skipped");
            return;
        }
    };
    let mut scheduler = state.scheduler();
    let result = match msg.event {
        LifecycleEvent::PrefillDone => scheduler.mark_prefill_completed(&msg.request_id),
        LifecycleEvent::Freed => scheduler.free(&msg.request_id),
    };
    drop(scheduler);
    match result {
        Ok(_) => state.counters.message(MessageKind::Lifecycle, Outcome::Ok),
        Err(e) => {
            state
                .counters
                .message(MessageKind::Lifecycle, Outcome::Rejected);
            debug!(request_id = %msg.request_id, error = %e, "lifecycle message ignored");
        }
    }
}
