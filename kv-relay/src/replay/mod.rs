//! The replay client: reads an engine's replay ROUTER socket from a given seq on,
//! keeping what arrives and asking again from the first batch it is missing.
//!
//! The engines answer a request `["", start_seq]` with every batch they still buffer
//! from `start_seq` on, one message each, then an end marker ([`crate::frames`]).
//! vLLM does so from a ROUTER socket at libzmq's default send high-water mark (1,000
//! messages) without `ROUTER_MANDATORY` (`vllm/distributed/kv_events.py`,
//! `ZmqEventPublisher._service_replay`): once the reader falls that far behind, libzmq
//! silently drops whole messages. A long buffer therefore arrives with holes, and its
//! tail and end marker may never come. A relay that discarded everything before a hole
//! (as a buffer trimmed past it) or everything read when the end marker was late
//! rebuilt part of the engine's picture, or none.
//!
//! So a read is a series of requests ([`ReplayRead`], the policy in [`ReplayPolicy`]):
//! - each request opens a fresh DEALER connection (a stale reply of an earlier request
//!   can never be taken for this one's, and the engine's queue towards it starts
//!   empty) and keeps the batches that arrive in order from the seq asked for;
//! - a batch after a missing one (a hole), or a reply that stops without an end marker
//!   (nothing for [`REPLY_IDLE`] once it started, or its deadline passed), ends the
//!   request: the next one asks from the first missing seq, so nothing is applied
//!   twice or out of order;
//! - the first message of a reply is never dropped (the queue towards a new
//!   connection is empty), so a reply whose first batch is later than the seq asked
//!   for means the engine no longer buffers the batches in between ([`Round::skipped`]);
//! - an end marker right after a batch could follow a dropped tail, so a read from a
//!   seq with no end in view (at connect) asks once more: an end marker again, or one
//!   with nothing before it, confirms the engine has nothing newer;
//! - after [`ReplayPolicy::max_requests`] requests, a request with no answer, or a
//!   socket error, the read ends with what it has ([`ReadOutcome::Incomplete`]) and the
//!   caller goes on from there: the next live batch is then a gap, filled the same way.
//!
//! Cost: one TCP connection per request; the engine resends its buffer from the
//! first missing seq on each re-ask. A request holds at most [`ROUND_MAX_BATCHES`]
//! batches or [`ROUND_MAX_BYTES`] bytes of payload before they are handed on, then
//! asks again from the next seq.

mod read;

pub use read::{ReadOutcome, ReplayRead};

use crate::frames::{FrameError, ReplayItem, parse_replay, replay_request};
use bytes::Bytes;
use std::ops::Range;
use std::time::Duration;
use tokio::time::Instant;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

/// How long a reply may pause once it started before its rest (end marker included)
/// is taken as dropped. vLLM sends a reply in one loop; a pause this long means the
/// messages are not coming.
pub const REPLY_IDLE: Duration = Duration::from_millis(500);

/// Batches one request keeps before handing them on and asking again.
pub const ROUND_MAX_BATCHES: usize = 4096;

/// Payload bytes one request keeps before handing them on and asking again.
pub const ROUND_MAX_BYTES: usize = 64 << 20;

/// How a replay read asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayPolicy {
    /// Deadline of one request, from connecting to its last message
    /// (`--replay-timeout-ms`).
    pub request_timeout: Duration,
    /// Requests one read may make, the first and its re-asks
    /// (`--replay-max-requests`, at least 1).
    pub max_requests: u32,
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayRequestError {
    /// ZMQ connect, send or receive failed.
    #[error("replay socket {endpoint}: {source}")]
    Zmq {
        /// The replay endpoint.
        endpoint: String,
        /// The cause.
        source: zeromq::ZmqError,
    },
    /// A reply had the wrong framing.
    #[error("replay reply from {endpoint}: {source}")]
    Frame {
        /// The replay endpoint.
        endpoint: String,
        /// The cause.
        source: FrameError,
    },
}

/// How one request's reply stopped.
#[derive(Debug)]
pub enum Stop {
    /// The end marker came after the last batch kept.
    End,
    /// Batch `seen` arrived while `missing` had not: lost in transit.
    Hole {
        /// The first seq missing.
        missing: u64,
        /// The batch that arrived after the hole.
        seen: u64,
    },
    /// The reply stopped without an end marker ([`REPLY_IDLE`] or the deadline).
    Cut,
    /// The batches wanted were read (the read's end seq was reached), or the
    /// request's memory bound.
    Enough,
    /// No message at all within the deadline.
    Silent,
    /// The socket failed or a reply was malformed.
    Failed(ReplayRequestError),
}

impl Stop {
    /// Label for `kv_relay_replay_requests_total{stop}`.
    pub fn label(&self) -> &'static str {
        match self {
            Stop::End => "end",
            Stop::Hole { .. } => "hole",
            Stop::Cut => "cut",
            Stop::Enough => "enough",
            Stop::Silent => "silent",
            Stop::Failed(_) => "failed",
        }
    }
}

/// What one request brought.
#[derive(Debug)]
pub struct Round {
    /// The seqs the engine no longer buffers: from the seq asked for to its reply's
    /// first batch (at most to the read's end seq).
    pub skipped: Option<Range<u64>>,
    /// Batches in order, each the seq after the one before, the first at the seq
    /// asked for (or at the end of `skipped`).
    pub batches: Vec<(u64, Bytes)>,
    /// The seq a next request asks from.
    pub next: u64,
    /// How the reply stopped.
    pub stop: Stop,
}

/// Keeps the in-order batches of one reply (pure: the socket is in [`request`]).
#[derive(Debug)]
struct Collector {
    until: Option<u64>,
    next: u64,
    seen_any: bool,
    bytes: usize,
    skipped: Option<Range<u64>>,
    batches: Vec<(u64, Bytes)>,
}

impl Collector {
    fn new(start: u64, until: Option<u64>) -> Self {
        Self {
            until,
            next: start,
            seen_any: false,
            bytes: 0,
            skipped: None,
            batches: Vec::new(),
        }
    }

    fn done(&self) -> bool {
        self.until.is_some_and(|u| self.next >= u)
            || self.batches.len() >= ROUND_MAX_BATCHES
            || self.bytes >= ROUND_MAX_BYTES
    }

    /// Takes batch `seq`; `Some` when the reply should not be read further.
    fn take(&mut self, seq: u64, payload: Bytes) -> Option<Stop> {
        let first = !std::mem::replace(&mut self.seen_any, true);
        if seq < self.next {
            return None; // Already kept: an engine never sends it, but it is harmless.
        }
        if seq > self.next {
            if !first {
                return Some(Stop::Hole {
                    missing: self.next,
                    seen: seq,
                });
            }
            // The engine's buffer starts at `seq` now.
            let to = self.until.map_or(seq, |u| seq.min(u));
            self.skipped = Some(self.next..to);
            self.next = to;
            if self.done() {
                return Some(Stop::Enough);
            }
        }
        self.bytes += payload.len();
        self.batches.push((seq, payload));
        self.next += 1;
        self.done().then_some(Stop::Enough)
    }

    fn finish(self, stop: Stop) -> Round {
        Round {
            skipped: self.skipped,
            batches: self.batches,
            next: self.next,
            stop,
        }
    }
}

/// One request: the batches the engine at `endpoint` sends from `start` on, kept while
/// they arrive in order, up to `until` (excluded) if given, within `timeout`.
pub async fn request(endpoint: &str, start: u64, until: Option<u64>, timeout: Duration) -> Round {
    let deadline = Instant::now() + timeout;
    let mut collector = Collector::new(start, until);
    let stop = read_reply(endpoint, start, deadline, &mut collector).await;
    collector.finish(stop)
}

async fn read_reply(
    endpoint: &str,
    start: u64,
    deadline: Instant,
    collector: &mut Collector,
) -> Stop {
    let zmq = |source| {
        Stop::Failed(ReplayRequestError::Zmq {
            endpoint: endpoint.to_owned(),
            source,
        })
    };
    let mut options = SocketOptions::default();
    options.connect_timeout(deadline.saturating_duration_since(Instant::now()));
    let mut socket = DealerSocket::with_options(options);
    let Ok(request) = ZmqMessage::try_from(replay_request(start)) else {
        // The request always has two frames, so it is never empty.
        return zmq(zeromq::ZmqError::NoMessage);
    };
    let sent = tokio::time::timeout_at(deadline, async {
        socket.connect(endpoint).await?;
        socket.send(request).await
    })
    .await;
    match sent {
        Err(_) => return Stop::Silent,
        Ok(Err(e)) => return zmq(e),
        Ok(Ok(())) => {}
    }
    let mut any = false;
    loop {
        let wait = if any {
            deadline.min(Instant::now() + REPLY_IDLE)
        } else {
            deadline
        };
        let reply = match tokio::time::timeout_at(wait, socket.recv()).await {
            Err(_) if any => return Stop::Cut,
            Err(_) => return Stop::Silent,
            Ok(Err(e)) => return zmq(e),
            Ok(Ok(reply)) => reply,
        };
        any = true;
        match parse_replay(reply.into_vec()) {
            Ok(ReplayItem::End) => return Stop::End,
            Ok(ReplayItem::Batch { seq, payload }) => {
                if let Some(stop) = collector.take(seq, payload) {
                    return stop;
                }
            }
            Err(source) => {
                return Stop::Failed(ReplayRequestError::Frame {
                    endpoint: endpoint.to_owned(),
                    source,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(start: u64, until: Option<u64>, seqs: &[u64]) -> Round {
        let mut c = Collector::new(start, until);
        for &s in seqs {
            if let Some(stop) = c.take(s, Bytes::from(vec![s as u8])) {
                return c.finish(stop);
            }
        }
        c.finish(Stop::End)
    }

    fn seqs(r: &Round) -> Vec<u64> {
        r.batches.iter().map(|b| b.0).collect()
    }

    #[test]
    fn a_reply_is_kept_in_order_up_to_its_first_hole() {
        let r = collect(2, None, &[2, 3, 4, 6, 7]);
        assert_eq!(seqs(&r), vec![2, 3, 4]);
        assert!(matches!(
            r.stop,
            Stop::Hole {
                missing: 5,
                seen: 6
            }
        ));
        assert_eq!((r.next, r.skipped), (5, None));
    }

    #[test]
    fn a_reply_starting_late_means_the_engine_no_longer_has_the_start() {
        let r = collect(2, None, &[5, 6]);
        assert_eq!(
            (seqs(&r), r.skipped.clone(), r.next),
            (vec![5, 6], Some(2..5), 7)
        );
        assert!(matches!(r.stop, Stop::End));
        // Within a gap fill the skip ends at the live batch, which is not kept.
        let r = collect(2, Some(4), &[5, 6]);
        assert_eq!(
            (seqs(&r), r.skipped.clone(), r.next),
            (vec![], Some(2..4), 4)
        );
        assert!(matches!(r.stop, Stop::Enough));
    }

    #[test]
    fn a_gap_fill_stops_at_the_live_batch() {
        let r = collect(2, Some(4), &[2, 3, 4, 5]);
        assert_eq!((seqs(&r), r.next), (vec![2, 3], 4));
        assert!(matches!(r.stop, Stop::Enough));
    }

    #[test]
    fn a_request_holds_a_bounded_number_of_batches() {
        let all: Vec<u64> = (0..ROUND_MAX_BATCHES as u64 + 10).collect();
        let r = collect(0, None, &all);
        assert_eq!(r.batches.len(), ROUND_MAX_BATCHES);
        assert_eq!(r.next, ROUND_MAX_BATCHES as u64);
        assert!(matches!(r.stop, Stop::Enough));
    }
}
