//! What decoding a route request costs the daemon, by prompt form and size: block
//! hashes or token ids, each as a msgpack array (what clients in other languages
//! send) or packed in one `bin` (what this crate encodes, `codec::packed`); and what
//! decoding a peer replica's sync booking costs, its block hashes in either form.
//!
//! ```sh
//! cargo bench -p kv-events --bench codec
//! ```
//!
//! Why it exists: `route_bench` measures the daemon's CPU per route through
//! nats-server on 2 shared cores, where a 5% change is inside the run-to-run noise;
//! here the decode (`kv_events::decode`, the shape walk included) runs alone.
//! Figures are nanoseconds per decoded request, the median of 7 rounds, with the
//! spread; the array and packed forms alternate within each round.

use kv_events::replicas::{
    BookedSequence, HashForm, RouterId, SequenceStep, SequenceSyncBatch, SequenceUpdate,
};
use kv_events::routing::{Prompt, RouteRequest};
use kv_events::{DpRank, LocalBlockHash, WorkerId, decode, encode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt::Debug;
use std::hint::black_box;
use std::time::Instant;

/// The same request with its prompt's list as a plain array.
#[derive(Serialize)]
struct ArrayRequest<'a> {
    request_id: &'a str,
    prompt: ArrayPrompt,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ArrayPrompt {
    Tokens {
        token_ids: Vec<u32>,
    },
    Blocks {
        block_hashes: Vec<u64>,
        num_tokens: u64,
    },
}

/// Nanoseconds per decode of `bytes` as a `T`, over `n` decodes.
fn time<T: DeserializeOwned>(bytes: &[u8], n: usize) -> f64 {
    let start = Instant::now();
    for _ in 0..n {
        let msg: T = decode(black_box(bytes)).expect("a valid message");
        black_box(msg);
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

/// One table row: both forms of one message decoded as a `T`, alternated 7 times.
fn row<T: DeserializeOwned + PartialEq + Debug>(what: &str, array: &[u8], packed: &[u8]) {
    let a: T = decode(array).expect("array form decodes");
    let p: T = decode(packed).expect("packed form decodes");
    assert_eq!(a, p, "both forms decode to the same message");
    let n = (2_000_000 / array.len()).max(200);
    let (mut ta, mut tp) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        ta.push(time::<T>(array, n));
        tp.push(time::<T>(packed, n));
    }
    let ((ma, la, ha), (mp, lp, hp)) = (median(ta), median(tp));
    println!(
        "| {what} | {} | **{ma:.0}** ({la:.0}–{ha:.0}) | {} | **{mp:.0}** ({lp:.0}–{hp:.0}) | {:.2} |",
        array.len(),
        packed.len(),
        mp / ma
    );
}

/// A peer's sync batch of one booking of `blocks` block hashes.
fn sync_batch(blocks: u64, mix: impl Fn(u64) -> u64) -> SequenceSyncBatch {
    SequenceSyncBatch {
        router_id: RouterId(7),
        steps: vec![SequenceStep {
            request_id: "req-000001".into(),
            update: SequenceUpdate::Booked(BookedSequence {
                worker_id: WorkerId(3),
                dp_rank: DpRank(0),
                block_hashes: (0..blocks).map(|i| LocalBlockHash(mix(i))).collect(),
                request_blocks: u32::try_from(blocks).expect("small"),
                prefill_tokens: 16 * blocks,
                expected_prefill_ms: Some(120),
                session_id: None,
            }),
        }],
        queued_at_us: Some(1_764_000_000_000_000),
        accepts_packed: true,
    }
}

fn median(mut xs: Vec<f64>) -> (f64, f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[xs.len() / 2], xs[0], xs[xs.len() - 1])
}

fn main() {
    // Well-mixed 64-bit hashes (most take 9 bytes as msgpack integers) and token
    // ids of a 150k vocabulary (most take 3 or 5 bytes).
    let mix = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5555;
    let cases: Vec<(String, Vec<u8>, Vec<u8>)> = [64u64, 1024]
        .iter()
        .map(|&blocks| {
            let hashes: Vec<u64> = (0..blocks).map(mix).collect();
            let packed = RouteRequest::new(
                "req-000001",
                Prompt::Blocks {
                    block_hashes: hashes.iter().copied().map(LocalBlockHash).collect(),
                    num_tokens: blocks * 16,
                },
            );
            let array = ArrayRequest {
                request_id: "req-000001",
                prompt: ArrayPrompt::Blocks {
                    block_hashes: hashes,
                    num_tokens: blocks * 16,
                },
            };
            (
                format!("{blocks} block hashes"),
                encode(&array).expect("encodes"),
                encode(&packed).expect("encodes"),
            )
        })
        .chain([8192u32].iter().map(|&tokens| {
            let ids: Vec<u32> = (0..tokens)
                .map(|i| (mix(u64::from(i)) % 150_000) as u32)
                .collect();
            let packed = RouteRequest::new(
                "req-000001",
                Prompt::Tokens {
                    token_ids: ids.clone(),
                },
            );
            let array = ArrayRequest {
                request_id: "req-000001",
                prompt: ArrayPrompt::Tokens { token_ids: ids },
            };
            (
                format!("{tokens} token ids"),
                encode(&array).expect("encodes"),
                encode(&packed).expect("encodes"),
            )
        }))
        .collect();
    println!(
        "| message | array: bytes | ns per decode | packed: bytes | ns per decode | packed / array |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (what, array, packed) in &cases {
        row::<RouteRequest>(&format!("route request, {what}"), array, packed);
    }
    for blocks in [64u64, 1024] {
        let batch = sync_batch(blocks, mix);
        row::<SequenceSyncBatch>(
            &format!("sync booking, {blocks} block hashes"),
            &encode(&batch.with_hashes(HashForm::Array)).expect("encodes"),
            &encode(&batch.with_hashes(HashForm::Packed)).expect("encodes"),
        );
    }
}
