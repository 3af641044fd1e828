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
//! Bounds: at most [`CAPACITY`] entries in arrival order (an id freed again takes a
//! second one), so at most that many ids, each for [`REMEMBER_FOR`]; the oldest is
//! forgotten first. Cost: about 190 bytes per id with the gateway's 27-byte ids
//! (measured: 12.3 MB for 65,536, allocator overhead aside: the map's slot at its
//! load factor, the arrival queue's slot, and the id's two heap copies), so about
//! 12 MiB full; one hash lookup per route decision while any id is remembered, and
//! nothing per `freed` of a request the router holds (the normal case).

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
    /// The same, in the order they were freed, at most `capacity` entries (an id
    /// freed again appears twice; the map's instant tells which entry is current).
    /// Every id in `ids` has an entry here.
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
        // Bounded by entries, not ids: a `freed` sent again and again for one id
        // must not grow the queue.
        while self.order.len() >= self.capacity {
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

        // Expired ids are dropped when another is remembered.
        freed.remember(&id("d"), t0 + Duration::from_secs(62));
        assert_eq!(freed.len(), 1, "b and c expired and were dropped");
    }

    /// An id freed again is remembered from its last `freed`: its first entry in the
    /// arrival queue, stale, forgets nothing when it expires or when it is the oldest
    /// at capacity.
    #[test]
    fn a_stale_entry_of_an_id_freed_again_forgets_nothing() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let id = |s: &str| RequestId(s.into());

        let mut freed = FreedEarly::with_capacity(8);
        freed.remember(&id("a"), at(0));
        freed.remember(&id("a"), at(30));
        // The first entry expires and is dropped here; `a` stays until 90 s.
        freed.remember(&id("x"), at(61));
        assert_eq!(freed.order.len(), 2, "(a, 30 s) and x");
        assert!(freed.contains(&id("a"), at(89)));

        let mut full = FreedEarly::with_capacity(2);
        full.remember(&id("a"), at(0));
        full.remember(&id("a"), at(10));
        // Full: the oldest entry, the stale one, goes for `b`; `a` stays.
        full.remember(&id("b"), at(20));
        assert!(full.contains(&id("a"), at(21)) && full.contains(&id("b"), at(21)));
    }

    #[test]
    fn an_id_freed_over_and_over_does_not_grow_the_memory() {
        let t0 = Instant::now();
        let mut freed = FreedEarly::with_capacity(4);
        let id = |s: &str| RequestId(s.into());
        freed.remember(&id("other"), t0);
        for i in 0..1000 {
            freed.remember(&id("again"), t0 + Duration::from_millis(i));
            assert!(freed.order.len() <= 4, "{} entries", freed.order.len());
        }
        let now = t0 + Duration::from_secs(1);
        assert!(freed.contains(&id("again"), now));
        // The oldest entry went first, and with it the other id.
        assert!(!freed.contains(&id("other"), now));
        assert_eq!(freed.len(), 1);
        // Remembered from its last `freed`, not its first.
        assert!(freed.contains(&id("again"), t0 + REMEMBER_FOR + Duration::from_millis(500)));
    }
}
