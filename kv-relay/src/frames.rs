//! ZMQ framing of the engines' event stream and replay replies, and the sequence
//! tracking that turns a stream of `seq` numbers into in-order / duplicate / gap /
//! restart decisions. Pure and synchronous; the sockets live in [`crate::source`].
//!
//! Live PUB frames (every vLLM and SGLang version): `[topic, seq (8 bytes BE), payload]`.
//! Replay: a DEALER sends `["", start_seq (8 bytes BE)]` to the engine's ROUTER and
//! receives one message per buffered batch from `start_seq` on, then an end marker
//! whose seq is `-1` (`ff × 8`):
//! - vLLM ≥ 0.28 and SGLang: `["", topic, seq, payload]`, end `["", "", ff×8, ""]`;
//! - vLLM ≤ 0.25: `["", seq, payload]`, end `["", ff×8, ""]`.

use bytes::Bytes;

/// The seq value that ends a replay (`-1` as a signed 64-bit integer).
pub const REPLAY_END: u64 = u64::MAX;

/// One live batch from the PUB socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveFrame {
    /// The ZMQ topic frame.
    pub topic: Bytes,
    /// The engine's sequence number of the batch.
    pub seq: u64,
    /// The msgpack batch.
    pub payload: Bytes,
}

/// One replay reply message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayItem {
    /// A buffered batch.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// The msgpack batch.
        payload: Bytes,
    },
    /// The end marker.
    End,
}

/// A ZMQ message that does not have the engine's framing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Wrong number of frames.
    #[error("expected {expected} frames, got {got}")]
    FrameCount {
        /// What the framing needs.
        expected: &'static str,
        /// What arrived.
        got: usize,
    },
    /// The seq frame is not 8 bytes.
    #[error("sequence frame has {0} bytes, expected 8")]
    SeqLength(usize),
    /// A replay reply without the empty delimiter frame.
    #[error("replay reply does not start with an empty delimiter frame")]
    Delimiter,
}

fn seq_of(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Parses a live message `[topic, seq, payload]`.
///
/// # Errors
/// [`FrameError`] for any other shape.
pub fn parse_live(frames: Vec<Bytes>) -> Result<LiveFrame, FrameError> {
    let [topic, seq, payload]: [Bytes; 3] =
        frames
            .try_into()
            .map_err(|f: Vec<Bytes>| FrameError::FrameCount {
                expected: "3 ([topic, seq, payload])",
                got: f.len(),
            })?;
    Ok(LiveFrame {
        seq: seq_of(&seq)?,
        topic,
        payload,
    })
}

/// Parses one replay reply as received by the DEALER, in either framing.
///
/// # Errors
/// [`FrameError`] for any other shape.
pub fn parse_replay(frames: Vec<Bytes>) -> Result<ReplayItem, FrameError> {
    let (delim, seq, payload) = match frames.as_slice() {
        [delim, _, seq, payload] | [delim, seq, payload] => (delim, seq, payload),
        other => {
            return Err(FrameError::FrameCount {
                expected: "3 or 4 ([\"\", (topic,) seq, payload])",
                got: other.len(),
            });
        }
    };
    if !delim.is_empty() {
        return Err(FrameError::Delimiter);
    }
    let (seq, payload) = (seq_of(seq)?, payload.clone());
    Ok(if seq == REPLAY_END {
        ReplayItem::End
    } else {
        ReplayItem::Batch { seq, payload }
    })
}

/// The replay request for batches from `start_seq` on.
pub fn replay_request(start_seq: u64) -> Vec<Bytes> {
    vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start_seq.to_be_bytes()),
    ]
}

/// What to do with a live batch, given what was applied before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStep {
    /// The next batch: apply it.
    Apply,
    /// Already applied (it came through a replay first): drop it.
    Duplicate,
    /// Batches `from..seq` are missing: fill them from the replay socket, then apply.
    Gap {
        /// First missing seq.
        from: u64,
    },
    /// The engine's seq went backwards: it restarted. Clear, then treat `seq` as the
    /// first batch of a new stream (a gap from 0 when it is not 0).
    Restarted,
}

/// Per-socket sequence state.
///
/// Live frames from one engine process are strictly increasing, so a live seq at or
/// below the previous *live* seq means a new engine process. A live seq at or below
/// the last *applied* seq (but above the last live one) was already applied from a
/// replay. The first batch of a stream expects seq 0: anything later is a gap from 0,
/// which a replay can fill if the engine still buffers its whole history.
#[derive(Debug, Clone, Default)]
pub struct SeqTracker {
    last_live: Option<u64>,
    last_applied: Option<u64>,
}

impl SeqTracker {
    /// A tracker for a new stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Classifies live batch `seq` and records it as seen.
    pub fn observe(&mut self, seq: u64) -> SeqStep {
        if self.last_live.is_some_and(|live| seq <= live) {
            self.last_live = Some(seq);
            self.last_applied = None;
            return SeqStep::Restarted;
        }
        self.last_live = Some(seq);
        let next = self.last_applied.map_or(0, |a| a + 1);
        if self.last_applied.is_some_and(|a| seq <= a) {
            SeqStep::Duplicate
        } else if seq == next {
            SeqStep::Apply
        } else {
            SeqStep::Gap { from: next }
        }
    }

    /// Records that batch `seq` was applied (live or replayed).
    pub fn applied(&mut self, seq: u64) {
        if self.last_applied.is_none_or(|a| seq > a) {
            self.last_applied = Some(seq);
        }
    }

    /// Forgets the stream (the socket reconnected: a new engine process may be behind
    /// it), so the next batch is treated as a stream start.
    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// The last applied seq.
    pub fn last_applied(&self) -> Option<u64> {
        self.last_applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &[u8]) -> Bytes {
        Bytes::copy_from_slice(s)
    }

    #[test]
    fn live_frames_parse() {
        let f = parse_live(vec![b(b"kv"), b(&5u64.to_be_bytes()), b(b"x")]).unwrap();
        assert_eq!(
            (f.seq, &f.topic[..], &f.payload[..]),
            (5, &b"kv"[..], &b"x"[..])
        );
        assert!(matches!(
            parse_live(vec![b(b""), b(b"x")]),
            Err(FrameError::FrameCount { got: 2, .. })
        ));
        assert_eq!(
            parse_live(vec![b(b""), b(&[0; 4]), b(b"")]),
            Err(FrameError::SeqLength(4))
        );
    }

    #[test]
    fn both_replay_framings_and_their_end_markers_parse() {
        let seq = b(&2u64.to_be_bytes());
        let end = b(&[0xff; 8]);
        let new = parse_replay(vec![b(b""), b(b"kv"), seq.clone(), b(b"p")]).unwrap();
        let old = parse_replay(vec![b(b""), seq, b(b"p")]).unwrap();
        let expected = ReplayItem::Batch {
            seq: 2,
            payload: b(b"p"),
        };
        assert_eq!((new, old), (expected.clone(), expected));
        assert_eq!(
            parse_replay(vec![b(b""), b(b""), end.clone(), b(b"")]),
            Ok(ReplayItem::End)
        );
        assert_eq!(parse_replay(vec![b(b""), end, b(b"")]), Ok(ReplayItem::End));
        assert_eq!(
            parse_replay(vec![b(b"id"), b(&[0; 8]), b(b"")]),
            Err(FrameError::Delimiter)
        );
        assert_eq!(replay_request(2)[1][..], 2u64.to_be_bytes());
    }

    #[test]
    fn sequence_steps() {
        let mut t = SeqTracker::new();
        assert_eq!(t.observe(0), SeqStep::Apply);
        t.applied(0);
        assert_eq!(t.observe(1), SeqStep::Apply);
        t.applied(1);
        // 2 lost: a gap from 2 when 3 arrives; the replay brings 2..=4.
        assert_eq!(t.observe(3), SeqStep::Gap { from: 2 });
        for s in 2..=4 {
            t.applied(s);
        }
        // 4 was queued on the live socket meanwhile: a duplicate, not a restart.
        assert_eq!(t.observe(4), SeqStep::Duplicate);
        assert_eq!(t.observe(5), SeqStep::Apply);
        t.applied(5);
        // Backwards: the engine restarted.
        assert_eq!(t.observe(0), SeqStep::Restarted);
        assert_eq!(t.last_applied(), None);
        // A stream that starts late has a gap from 0.
        let mut late = SeqTracker::new();
        assert_eq!(late.observe(7), SeqStep::Gap { from: 0 });
        late.reset();
        assert_eq!(late.observe(0), SeqStep::Apply);
    }
}
