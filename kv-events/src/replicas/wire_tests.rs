use super::*;
use crate::codec::{decode, encode};
use crate::ids::{DpRank, LocalBlockHash, RequestId, WorkerId};
use crate::replicas::RouterId;
use crate::routing::SessionId;
use serde::Deserialize;

/// The wire form as serde derived it before the packed form: what replicas of
/// earlier versions write, and must keep reading from this one.
mod derived {
    use super::*;

    #[derive(Serialize)]
    pub struct Batch {
        pub router_id: RouterId,
        pub steps: Vec<Step>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub queued_at_us: Option<u64>,
    }

    #[derive(Serialize)]
    pub struct Step {
        pub request_id: RequestId,
        pub update: Update,
    }

    #[derive(Serialize)]
    #[serde(tag = "type", rename_all = "snake_case")]
    pub enum Update {
        Booked(Booked),
        Freed,
    }

    #[derive(Serialize)]
    pub struct Booked {
        pub worker_id: WorkerId,
        pub dp_rank: DpRank,
        pub block_hashes: Vec<LocalBlockHash>,
        pub request_blocks: u32,
        pub prefill_tokens: u64,
        pub expected_prefill_ms: Option<u64>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub session_id: Option<SessionId>,
    }

    /// What an earlier replica decodes a batch as (it ignores keys it does not know).
    #[derive(Debug, Deserialize, PartialEq)]
    pub struct OlderBatch {
        pub router_id: RouterId,
        pub steps: Vec<SequenceStep>,
    }
}

fn booking(blocks: u64, session: Option<&str>, ms: Option<u64>) -> BookedSequence {
    BookedSequence {
        worker_id: WorkerId(7),
        dp_rank: DpRank(2),
        block_hashes: (0..blocks)
            .map(|i| LocalBlockHash(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .collect(),
        request_blocks: u32::try_from(blocks).expect("small") + 1,
        prefill_tokens: 16 * blocks,
        expected_prefill_ms: ms,
        session_id: session.map(|s| SessionId::new(s).expect("short")),
    }
}

fn derived_booking(b: &BookedSequence) -> derived::Booked {
    derived::Booked {
        worker_id: b.worker_id,
        dp_rank: b.dp_rank,
        block_hashes: b.block_hashes.clone(),
        request_blocks: b.request_blocks,
        prefill_tokens: b.prefill_tokens,
        expected_prefill_ms: b.expected_prefill_ms,
        session_id: b.session_id.clone(),
    }
}

fn batch(accepts_packed: bool, queued_at_us: Option<u64>) -> SequenceSyncBatch {
    SequenceSyncBatch {
        router_id: RouterId(11),
        steps: vec![
            SequenceStep {
                request_id: "a".into(),
                update: SequenceUpdate::Booked(booking(1024, Some("chat-1"), Some(40))),
            },
            SequenceStep {
                request_id: "b".into(),
                update: SequenceUpdate::Booked(booking(3, None, None)),
            },
            SequenceStep {
                request_id: "a".into(),
                update: SequenceUpdate::Freed,
            },
        ],
        queued_at_us,
        accepts_packed,
    }
}

#[test]
fn arrays_are_written_byte_for_byte_as_serde_derived_them() {
    for queued_at_us in [None, Some(1_764_000_000_000_001)] {
        let ours = batch(false, queued_at_us);
        let steps = ours
            .steps
            .iter()
            .map(|s| derived::Step {
                request_id: s.request_id.clone(),
                update: match &s.update {
                    SequenceUpdate::Booked(b) => derived::Update::Booked(derived_booking(b)),
                    _ => derived::Update::Freed,
                },
            })
            .collect();
        let theirs = derived::Batch {
            router_id: ours.router_id,
            steps,
            queued_at_us,
        };
        assert_eq!(encode(&ours).unwrap(), encode(&theirs).unwrap());
        assert_eq!(
            encode(&ours.with_hashes(HashForm::Array)).unwrap(),
            encode(&theirs).unwrap()
        );
        for step in &ours.steps {
            if let SequenceUpdate::Booked(b) = &step.update {
                assert_eq!(encode(b).unwrap(), encode(&derived_booking(b)).unwrap());
            }
        }
    }
}

#[test]
fn both_forms_decode_to_the_same_batch_and_the_packed_one_is_one_bin_per_booking() {
    let ours = batch(true, Some(5));
    let arrays = encode(&ours.with_hashes(HashForm::Array)).unwrap();
    let packed = encode(&ours.with_hashes(HashForm::Packed)).unwrap();
    assert_eq!(decode::<SequenceSyncBatch>(&arrays).unwrap(), ours);
    assert_eq!(decode::<SequenceSyncBatch>(&packed).unwrap(), ours);
    // 1,024 hashes in a bin 16: 0xc5, then 8,192 as a big-endian u16.
    let bin = [0xc5, 0x20, 0];
    assert!(packed.windows(3).any(|w| w == bin), "a bin of 8,192 bytes");
    assert!(!arrays.windows(3).any(|w| w == bin));
    assert!(
        packed.len() < arrays.len(),
        "{} vs {}",
        packed.len(),
        arrays.len()
    );
    // A replica before the packed form reads the array batch and ignores the flag.
    let older: derived::OlderBatch = decode(&arrays).unwrap();
    assert_eq!(older.steps, ours.steps);
}

#[test]
fn the_flag_is_written_only_when_set_and_defaults_to_false() {
    let quiet = encode(&batch(false, None)).unwrap();
    assert!(!quiet.windows(14).any(|w| w == b"accepts_packed"));
    assert!(!decode::<SequenceSyncBatch>(&quiet).unwrap().accepts_packed);
    let loud = encode(&batch(true, None)).unwrap();
    assert!(decode::<SequenceSyncBatch>(&loud).unwrap().accepts_packed);
}
