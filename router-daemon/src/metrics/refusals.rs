//! Rate limiting of the log lines about refused messages: at most one line per
//! [`LOG_EVERY`] per (message kind, reason), which says how many refusals went unlogged
//! since the previous one. The counters count every refusal; the log only has to say
//! that it is happening, and from which subject.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// (message kind, refusal reason), both metric labels.
type Key = (&'static str, &'static str);

/// At most one log line per this interval per (message kind, refusal reason).
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(10);

/// The rate limiter of refusal log lines: per (kind, reason), when the last line was
/// written and how many refusals were silent since.
#[derive(Debug, Default)]
pub(crate) struct RefusalLog {
    lines: Mutex<HashMap<Key, (Instant, u64)>>,
}

impl RefusalLog {
    /// Whether to log a refusal of (kind, reason) now; `Some(n)` with the refusals not
    /// logged since the previous line.
    pub(crate) fn should_log(
        &self,
        kind: &'static str,
        reason: &'static str,
        now: Instant,
    ) -> Option<u64> {
        // A poisoned lock only means another thread panicked mid-update of a counter
        // pair; the map is still usable.
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        match lines.get_mut(&(kind, reason)) {
            Some((last, silent)) if now.duration_since(*last) < LOG_EVERY => {
                *silent += 1;
                None
            }
            Some((last, silent)) => {
                let skipped = *silent;
                (*last, *silent) = (now, 0);
                Some(skipped)
            }
            None => {
                lines.insert((kind, reason), (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_refusal_is_logged_then_one_line_per_interval_with_the_silent_count() {
        let log = RefusalLog::default();
        let t0 = Instant::now();
        let (events, route) = ("events", "route");
        assert_eq!(log.should_log(events, "malformed", t0), Some(0));
        assert_eq!(
            log.should_log(events, "malformed", t0 + Duration::from_secs(1)),
            None
        );
        assert_eq!(
            log.should_log(events, "malformed", t0 + Duration::from_secs(2)),
            None
        );
        // Another reason or kind has its own line.
        assert_eq!(log.should_log(events, "too_large", t0), Some(0));
        assert_eq!(log.should_log(route, "malformed", t0), Some(0));
        assert_eq!(log.should_log(events, "malformed", t0 + LOG_EVERY), Some(2));
        assert_eq!(log.should_log(events, "malformed", t0 + LOG_EVERY), None);
    }
}
