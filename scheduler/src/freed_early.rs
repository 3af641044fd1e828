//! Request ids a frontend freed before this router booked them, remembered for a
//! while so that a route query for one of them, read late, books nothing.
//!
//! Why: a frontend that gives up on a route query (its timeout passed, or it asked
//! the query again of another replica under a fresh id because the first one
//! stalled) publishes `freed` for the id it gave up. A router replica that stalled
//! reads both the stale query and that `freed` when it resumes, but on two
//! subscriptions served by two tasks, so it may apply the `freed` first — to an id it
//! does not hold, which changes nothing — and then book the query: a booking nobody
//! frees until the request TTL (10 minutes by default). Remembering the id closes
//! that order. Only a frontend's `freed` is remembered: a peer replica's sync `freed`
//! reaches every replica after the frontend's own, for every request, and would fill
//! the memory with ids no query will name again.
//!
//! Bounds: at most [`CAPACITY`] ids, each for [`REMEMBER_FOR`]; the oldest is
//! forgotten first. Cost: about 100 bytes per id with the gateway's 24-byte ids (the
//! id twice, in the map and in the arrival queue, with an instant each), under 7 MiB
//! full; one hash lookup per route decision, and nothing per `freed` of a request the
//! router holds (the normal case).

use kv_events::RequestId;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Most ids remembered.
pub const CAPACITY: usize = 65_536;

/// How long an id is remembered: longer than a frontend waits for a route answer
/// (the gateway's 10 s route timeout) several times over, so a replica that stalls
/// for up to this long still refuses what it reads late.
pub const REMEMBER_FOR: Duration = Duration::from_secs(60);

/// The ids, bounded as the module docs say.
#[derive(Debug, Clone)]
pub(crate) struct FreedEarly {
    capacity: usize,
    /// Each id and when it was freed.
    ids: HashMap<RequestId, Instant>,
    /// The same, in the order they were freed (an id freed again appears twice; the
    /// map's instant tells which entry is current).
    order: VecDeque<(RequestId, Instant)>,
}

impl Default for FreedEarly {
    fn default() -> Self {
        Self::with_capacity(CAPACITY)
    }
}

impl FreedEarly {
    /// An empty memory of at most `capacity` ids.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            capacity,
            ids: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Remembers that `id` was freed at `now`, before it was booked here.
    pub(crate) fn remember(&mut self, id: &RequestId, now: Instant) {
        self.forget_before(now);
        while self.ids.len() >= self.capacity {
            let Some((oldest, at)) = self.order.pop_front() else {
                break;
            };
            if self.ids.get(&oldest) == Some(&at) {
                self.ids.remove(&oldest);
            }
        }
        self.ids.insert(id.clone(), now);
        self.order.push_back((id.clone(), now));
    }

    /// Whether `id` was freed before it was booked, within [`REMEMBER_FOR`] of `now`.
    pub(crate) fn contains(&self, id: &RequestId, now: Instant) -> bool {
        // Empty unless a frontend freed an id before its route: every decision asks.
        !self.ids.is_empty()
            && self
                .ids
                .get(id)
                .is_some_and(|at| now.saturating_duration_since(*at) < REMEMBER_FOR)
    }

    /// Ids remembered (some may be past [`REMEMBER_FOR`], until the next `remember`).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// Forgets the ids freed [`REMEMBER_FOR`] or longer before `now`.
    fn forget_before(&mut self, now: Instant) {
        while let Some((id, at)) = self.order.front() {
            if now.saturating_duration_since(*at) < REMEMBER_FOR {
                break;
            }
            if self.ids.get(id) == Some(at) {
                self.ids.remove(id);
            }
            self.order.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_remembered_for_a_while_and_the_oldest_goes_first() {
        let t0 = Instant::now();
        let mut freed = FreedEarly::with_capacity(2);
        let id = |s: &str| RequestId(s.into());
        freed.remember(&id("a"), t0);
        assert!(freed.contains(&id("a"), t0 + Duration::from_secs(59)));
        assert!(!freed.contains(&id("a"), t0 + REMEMBER_FOR));
        assert!(!freed.contains(&id("b"), t0));

        // Full: the oldest is forgotten for the newest.
        freed.remember(&id("b"), t0 + Duration::from_secs(1));
        freed.remember(&id("c"), t0 + Duration::from_secs(2));
        assert_eq!(freed.len(), 2);
        let later = t0 + Duration::from_secs(3);
        assert!(!freed.contains(&id("a"), later));
        assert!(freed.contains(&id("b"), later) && freed.contains(&id("c"), later));

        // Freed again: the stale first entry does not forget it early.
        freed.remember(&id("b"), t0 + Duration::from_secs(30));
        let after_first = t0 + Duration::from_secs(70);
        freed.remember(&id("d"), after_first);
        assert!(freed.contains(&id("b"), after_first));
        assert!(!freed.contains(&id("c"), after_first));
        assert_eq!(freed.len(), 2, "c expired and was dropped");
    }
}
