//! The one door every NATS payload goes through: bounded, decoded, checked against
//! the daemon's [`Limits`], and — when refused — counted by reason and logged without
//! flooding the log.
//!
//! Why one door: the rule "a malformed or oversized message is counted, logged once
//! with its subject, and skipped" must hold for every subject, and a flood of bad
//! messages must not turn into a flood of log lines (a misbehaving publisher once
//! produced 12,000 lines per second). So a refusal is always counted in
//! `kv_router_messages_total{kind, outcome}` (`outcome` = `malformed`, `too_large`
//! or `over_limit`), but logged at most once per `metrics::refusals::LOG_EVERY` per (kind, reason),
//! with its subject, the error and how many refusals of that kind were not logged
//! since the last line.
//!
//! Cost: the byte check, the decode, one pass over the message's counts; on refusal a
//! short mutex-guarded map lookup.

use crate::metrics::counters::{Counters, MessageKind};
use kv_events::limits::{Limits, Refusal, WithinLimits, decode_within};
use serde::de::DeserializeOwned;

/// Decodes `payload` from `subject` as a `T` within `limits`. On refusal it is counted
/// under `kind` and logged (rate-limited, see the module docs); the caller skips the
/// message or answers with the error, and counts successes itself.
///
/// # Errors
/// The [`Refusal`].
pub(crate) fn admit<T: DeserializeOwned + WithinLimits>(
    counters: &Counters,
    limits: &Limits,
    kind: MessageKind,
    subject: &str,
    payload: &[u8],
) -> Result<T, Refusal> {
    decode_within(payload, limits).inspect_err(|refusal| counters.refused(kind, subject, refusal))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::counters::Outcome;
    use kv_events::KvEventBatch;

    #[test]
    fn every_refusal_is_counted_by_reason() {
        let counters = Counters::unregistered();
        let limits = Limits {
            max_message_bytes: 4,
            ..Limits::default()
        };
        for payload in [&b"\xc1"[..], b"\xc1", b"too long"] {
            let refused =
                admit::<KvEventBatch>(&counters, &limits, MessageKind::Events, "s", payload);
            assert!(refused.is_err());
        }
        assert_eq!(
            counters.messages(MessageKind::Events, Outcome::Malformed),
            2
        );
        assert_eq!(counters.messages(MessageKind::Events, Outcome::TooLarge), 1);
    }
}
