//! One read of the replay socket, as many requests as it takes (see the parent
//! module): each request asks from the first seq not read yet, and the decision to
//! ask again or to stop is taken here, on what the request brought.

use super::{ReplayPolicy, Round, Stop, request};

/// How a read ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Every batch the engine buffers from the read's start was read: up to its end
    /// seq for a gap, or up to the engine's newest batch (confirmed by an end marker).
    Complete,
    /// The read went on with what it had: the batches from `next` on were not read.
    Incomplete {
        /// The first seq not read.
        next: u64,
        /// The newest seq known to exist (seen after a hole), if any.
        seen: Option<u64>,
        /// Why the read stopped.
        reason: &'static str,
    },
    /// Nothing could be read: the first request had no answer or failed.
    Failed(String),
}

impl ReadOutcome {
    /// Batches known to exist that were not read (`next..=seen`), 0 when unknown.
    pub fn known_missing(&self) -> u64 {
        match self {
            ReadOutcome::Incomplete {
                next,
                seen: Some(seen),
                ..
            } => (seen + 1).saturating_sub(*next),
            _ => 0,
        }
    }
}

/// A read of the engine's replay buffer from one seq on, request by request.
///
/// ```text
/// let mut read = ReplayRead::new(endpoint, from, until, policy);
/// while let Some(round) = read.next_round().await { /* apply round.batches */ }
/// read.outcome()
/// ```
#[derive(Debug)]
pub struct ReplayRead {
    endpoint: String,
    policy: ReplayPolicy,
    until: Option<u64>,
    next: u64,
    requests: u32,
    read_any: bool,
    /// The last request ended with its end marker after a batch: a dropped tail cannot
    /// be ruled out, so one more request confirms.
    unconfirmed: bool,
    seen: Option<u64>,
    outcome: Option<ReadOutcome>,
}

impl ReplayRead {
    /// A read of the batches from `from` on, up to `until` (excluded) if given (a
    /// gap before a live batch), else up to the engine's newest.
    pub fn new(endpoint: &str, from: u64, until: Option<u64>, policy: ReplayPolicy) -> Self {
        let done = until.is_some_and(|u| from >= u);
        Self {
            endpoint: endpoint.to_owned(),
            policy,
            until,
            next: from,
            requests: 0,
            read_any: false,
            unconfirmed: false,
            seen: None,
            outcome: done.then_some(ReadOutcome::Complete),
        }
    }

    /// Makes the next request and returns what it brought, in order after the last
    /// round's batches; `None` once the read is over ([`Self::outcome`]).
    pub async fn next_round(&mut self) -> Option<Round> {
        if self.outcome.is_some() {
            return None;
        }
        let round = request(
            &self.endpoint,
            self.next,
            self.until,
            self.policy.request_timeout,
        )
        .await;
        self.absorb(&round);
        Some(round)
    }

    /// How the read ended; `None` while it goes on.
    pub fn outcome(&self) -> Option<&ReadOutcome> {
        self.outcome.as_ref()
    }

    /// Requests made so far.
    pub fn requests(&self) -> u32 {
        self.requests
    }

    /// Decides, from what a request brought, whether the read is over.
    fn absorb(&mut self, round: &Round) {
        self.requests += 1;
        let progress = !round.batches.is_empty() || round.skipped.is_some();
        self.read_any |= progress;
        self.next = round.next;
        if let Stop::Hole { seen, .. } = round.stop {
            self.seen = self.seen.max(Some(seen));
        }
        let (next, seen) = (round.next, self.seen.filter(|s| *s >= round.next));
        let incomplete = |reason| Some(ReadOutcome::Incomplete { next, seen, reason });
        let verdict = match &round.stop {
            _ if self.until.is_some_and(|u| self.next >= u) => Some(ReadOutcome::Complete),
            Stop::Enough => None,
            Stop::End if self.until.is_some() => {
                incomplete("the engine's buffer ends before the live batch")
            }
            Stop::End if !progress || self.unconfirmed => Some(ReadOutcome::Complete),
            Stop::End => None,
            Stop::Hole { .. } | Stop::Cut if progress => None,
            Stop::Hole { .. } | Stop::Cut => incomplete("a request brought no new batch"),
            Stop::Silent if self.read_any => incomplete("a request had no answer"),
            Stop::Failed(_) if self.read_any => incomplete("a request failed"),
            Stop::Silent => Some(ReadOutcome::Failed(format!(
                "no answer within {:?}",
                self.policy.request_timeout
            ))),
            Stop::Failed(e) => Some(ReadOutcome::Failed(e.to_string())),
        };
        self.unconfirmed = matches!(round.stop, Stop::End) && progress;
        self.outcome = match verdict {
            None if self.requests >= self.policy.max_requests => {
                incomplete("the request limit (--replay-max-requests) was reached")
            }
            verdict => verdict,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::ops::Range;
    use std::time::Duration;

    fn read(from: u64, until: Option<u64>, max_requests: u32) -> ReplayRead {
        let policy = ReplayPolicy {
            request_timeout: Duration::from_secs(1),
            max_requests,
        };
        ReplayRead::new("tcp://127.0.0.1:1", from, until, policy)
    }

    /// A request from `read.next` that brought `seqs` (skipping what precedes their
    /// first) and stopped with `stop`.
    fn round(read: &ReplayRead, seqs: Range<u64>, stop: Stop) -> Round {
        let skipped = (seqs.start > read.next).then_some(read.next..seqs.start);
        let next = if seqs.is_empty() {
            read.next.max(seqs.start)
        } else {
            seqs.end
        };
        Round {
            skipped,
            batches: seqs.map(|s| (s, Bytes::new())).collect(),
            next,
            stop,
        }
    }

    /// Feeds `rounds` until the read is over; returns the requests made.
    fn run(read: &mut ReplayRead, rounds: Vec<(Range<u64>, Stop)>) -> u32 {
        for (seqs, stop) in rounds {
            assert!(read.outcome().is_none(), "over before {seqs:?}");
            let r = round(read, seqs, stop);
            read.absorb(&r);
        }
        read.requests()
    }

    fn hole(missing: u64, seen: u64) -> Stop {
        Stop::Hole { missing, seen }
    }

    #[test]
    fn an_end_marker_after_batches_is_confirmed_by_one_more_request() {
        let mut r = read(0, None, 8);
        run(&mut r, vec![(0..3, Stop::End)]);
        assert_eq!(r.outcome(), None, "a dropped tail is not ruled out");
        assert_eq!(run(&mut r, vec![(3..3, Stop::End)]), 2);
        assert_eq!(r.outcome(), Some(&ReadOutcome::Complete));
        // An engine that keeps publishing: two end markers in a row are enough.
        let mut r = read(0, None, 8);
        run(&mut r, vec![(0..3, Stop::End), (3..4, Stop::End)]);
        assert_eq!(r.outcome(), Some(&ReadOutcome::Complete));
    }

    #[test]
    fn a_hole_and_a_lost_end_marker_are_asked_again_from_the_first_missing_seq() {
        let mut r = read(0, None, 8);
        let requests = run(
            &mut r,
            vec![
                (0..100, hole(100, 150)),
                (100..180, Stop::Cut),
                (180..200, Stop::End),
                (200..200, Stop::End),
            ],
        );
        assert_eq!((requests, r.outcome()), (4, Some(&ReadOutcome::Complete)));
        assert_eq!(r.next, 200);
    }

    #[test]
    fn the_request_limit_ends_the_read_with_what_is_missing() {
        let mut r = read(0, None, 2);
        run(&mut r, vec![(0..10, hole(10, 20)), (10..15, hole(15, 30))]);
        let outcome = r.outcome().cloned().unwrap();
        assert!(
            matches!(
                outcome,
                ReadOutcome::Incomplete {
                    next: 15,
                    seen: Some(30),
                    ..
                }
            ),
            "{outcome:?}"
        );
        assert_eq!(outcome.known_missing(), 16);
    }

    #[test]
    fn a_gap_fill_ends_at_its_live_batch() {
        let mut r = read(5, Some(20), 8);
        run(&mut r, vec![(5..9, hole(9, 12)), (9..20, Stop::Enough)]);
        assert_eq!(r.outcome(), Some(&ReadOutcome::Complete));
        // The engine no longer has the start: the read still ends at the live batch.
        let mut r = read(5, Some(20), 8);
        run(&mut r, vec![(8..20, Stop::Enough)]);
        assert_eq!(r.outcome(), Some(&ReadOutcome::Complete));
        // A buffer that ends before the live batch cannot fill the gap.
        let mut r = read(5, Some(20), 8);
        run(&mut r, vec![(5..9, Stop::End)]);
        assert!(matches!(
            r.outcome(),
            Some(ReadOutcome::Incomplete { next: 9, .. })
        ));
        assert_eq!(read(5, Some(5), 8).outcome(), Some(&ReadOutcome::Complete));
    }

    #[test]
    fn no_answer_fails_a_read_that_read_nothing_and_ends_one_that_did() {
        let mut r = read(0, None, 8);
        run(&mut r, vec![(0..0, Stop::Silent)]);
        assert!(matches!(r.outcome(), Some(ReadOutcome::Failed(_))));
        let mut r = read(0, None, 8);
        run(&mut r, vec![(0..10, Stop::Cut), (10..10, Stop::Silent)]);
        assert!(matches!(
            r.outcome(),
            Some(ReadOutcome::Incomplete {
                next: 10,
                seen: None,
                ..
            })
        ));
        // A request that brings nothing new is not repeated.
        let mut r = read(0, None, 8);
        run(&mut r, vec![(0..10, hole(10, 12)), (10..10, Stop::Cut)]);
        assert!(matches!(
            r.outcome(),
            Some(ReadOutcome::Incomplete {
                next: 10,
                seen: Some(12),
                ..
            })
        ));
    }

    #[test]
    fn the_memory_bound_only_splits_the_read() {
        let mut r = read(0, None, 8);
        run(
            &mut r,
            vec![
                (0..4096, Stop::Enough),
                (4096..5000, Stop::End),
                (5000..5000, Stop::End),
            ],
        );
        assert_eq!(r.outcome(), Some(&ReadOutcome::Complete));
    }
}
