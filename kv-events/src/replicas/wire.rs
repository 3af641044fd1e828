//! How a sync batch's bookings carry their block hashes: as a msgpack array, which
//! every replica decodes, or packed in one `bin` (`crate::codec::packed`), which
//! replicas decode since the packed form was introduced and say so with
//! `accepts_packed` on every sync and snapshot message.
//!
//! Why: a peer decodes every booking of every other replica. As an array a
//! 1,024-block prompt's hashes are 1,024 msgpack integers, each walked and decoded on
//! its own (about 5 µs per booking, per peer); packed they are one bounds check and
//! one copy (about 0.3 µs). At 8 replicas each route was decoded 7 times.
//!
//! The serializations here are the only field lists of the three types' wire form:
//! `Serialize` (arrays, for snapshot replies and anything without a choice) and
//! [`SequenceSyncBatch::with_hashes`] share them, so the two forms cannot drift.

use super::{BookedSequence, SequenceStep, SequenceSyncBatch, SequenceUpdate};
use serde::Serialize;
use serde::ser::{SerializeSeq, SerializeStruct, Serializer};

/// How block hashes are written in a booking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashForm {
    /// A msgpack array of integers: every replica decodes it.
    #[default]
    Array,
    /// One `bin` of 8-byte little-endian hashes: only for peers that sent
    /// `accepts_packed`.
    Packed,
}

impl SequenceSyncBatch {
    /// The batch for encoding with its bookings' block hashes in `form`; otherwise the
    /// same bytes as its `Serialize` (which writes arrays).
    pub fn with_hashes(&self, form: HashForm) -> impl Serialize + '_ {
        BatchOut { batch: self, form }
    }
}

struct BatchOut<'a> {
    batch: &'a SequenceSyncBatch,
    form: HashForm,
}

impl Serialize for BatchOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let b = self.batch;
        let len = 2 + usize::from(b.queued_at_us.is_some()) + usize::from(b.accepts_packed);
        let mut st = s.serialize_struct("SequenceSyncBatch", len)?;
        st.serialize_field("router_id", &b.router_id)?;
        st.serialize_field(
            "steps",
            &StepsOut {
                steps: &b.steps,
                form: self.form,
            },
        )?;
        match b.queued_at_us {
            Some(at) => st.serialize_field("queued_at_us", &at)?,
            None => st.skip_field("queued_at_us")?,
        }
        if b.accepts_packed {
            st.serialize_field("accepts_packed", &true)?;
        } else {
            st.skip_field("accepts_packed")?;
        }
        st.end()
    }
}

impl Serialize for SequenceSyncBatch {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.with_hashes(HashForm::Array).serialize(s)
    }
}

struct StepsOut<'a> {
    steps: &'a [SequenceStep],
    form: HashForm,
}

impl Serialize for StepsOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.steps.len()))?;
        for step in self.steps {
            seq.serialize_element(&StepOut {
                step,
                form: self.form,
            })?;
        }
        seq.end()
    }
}

struct StepOut<'a> {
    step: &'a SequenceStep,
    form: HashForm,
}

impl Serialize for StepOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("SequenceStep", 2)?;
        st.serialize_field("request_id", &self.step.request_id)?;
        match &self.step.update {
            SequenceUpdate::Booked(booked) => st.serialize_field(
                "update",
                &BookedOut {
                    booked,
                    form: self.form,
                    tag: Some("booked"),
                },
            )?,
            other => st.serialize_field("update", other)?,
        }
        st.end()
    }
}

impl Serialize for SequenceStep {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        StepOut {
            step: self,
            form: HashForm::Array,
        }
        .serialize(s)
    }
}

/// A booking's fields, with the `type` tag of a [`SequenceUpdate`] when written as
/// one (serde adds the tag itself when the enum's derived `Serialize` writes it).
struct BookedOut<'a> {
    booked: &'a BookedSequence,
    form: HashForm,
    tag: Option<&'static str>,
}

impl Serialize for BookedOut<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let b = self.booked;
        let len = 6 + usize::from(self.tag.is_some()) + usize::from(b.session_id.is_some());
        let mut st = s.serialize_struct("BookedSequence", len)?;
        if let Some(tag) = self.tag {
            st.serialize_field("type", tag)?;
        }
        st.serialize_field("worker_id", &b.worker_id)?;
        st.serialize_field("dp_rank", &b.dp_rank)?;
        match self.form {
            HashForm::Array => st.serialize_field("block_hashes", &b.block_hashes)?,
            HashForm::Packed => {
                st.serialize_field("block_hashes", &PackedHashes(&b.block_hashes))?
            }
        }
        st.serialize_field("request_blocks", &b.request_blocks)?;
        st.serialize_field("prefill_tokens", &b.prefill_tokens)?;
        st.serialize_field("expected_prefill_ms", &b.expected_prefill_ms)?;
        match &b.session_id {
            Some(session) => st.serialize_field("session_id", session)?,
            None => st.skip_field("session_id")?,
        }
        st.end()
    }
}

impl Serialize for BookedSequence {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        BookedOut {
            booked: self,
            form: HashForm::Array,
            tag: None,
        }
        .serialize(s)
    }
}

struct PackedHashes<'a>(&'a [crate::ids::LocalBlockHash]);

impl Serialize for PackedHashes<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        crate::codec::packed::serialize(self.0, s)
    }
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
