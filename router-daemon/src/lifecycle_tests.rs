//! Lifecycle payloads, single messages or batches, apply every message in order under
//! one lock, and a bad or unknown message, or an over-long batch, costs only itself.

use super::*;
use crate::test_state::starting;
use kv_events::encode;
use kv_events::limits::MAX_LIFECYCLE_BATCH;
use kv_events::routing::LifecycleEvent;
use kv_events::routing::{LifecycleBatch, LifecycleMessage};
use kv_events::{DpRank, LocalBlockHash, WorkerId, WorkerRank};
use scheduler::{AddRequest, Origin, PrefillLoadHint, SequenceEvent};

const SUBJECT: &str = "it.router.lifecycle";

fn lifecycle(id: &str, event: LifecycleEvent) -> Vec<u8> {
    encode(&LifecycleMessage {
        request_id: id.into(),
        event,
    })
    .expect("a lifecycle message encodes")
}

/// The rank every test booking is on.
fn rank() -> WorkerRank {
    WorkerRank::new(WorkerId(1), DpRank(0))
}

/// Books `ids` on [`rank`], each with prefill tokens and decode blocks.
fn book(state: &crate::state::RouterState, ids: &[&str]) {
    let rank = rank();
    for &id in ids {
        state
            .scheduler()
            .apply(
                SequenceEvent::AddRequest(AddRequest {
                    request_id: id.into(),
                    rank,
                    block_hashes: vec![LocalBlockHash(1), LocalBlockHash(2)],
                    request_blocks: 3,
                    prefill: PrefillLoadHint {
                        initial_effective_prefill_tokens: 12,
                        expected_prefill_duration: None,
                    },
                    origin: Origin::Local,
                    session_id: None,
                }),
                Instant::now(),
            )
            .expect("a fresh booking");
    }
}

#[tokio::test]
async fn a_batch_applies_every_message_in_order_and_skips_only_the_bad_ones() {
    let starting = starting();
    let state = starting.state();
    let rank = rank();
    book(state, &["a", "b"]);
    let payloads = [
        lifecycle("a", LifecycleEvent::PrefillDone),
        b"\xc1 not msgpack".to_vec(),
        lifecycle("unknown", LifecycleEvent::Freed),
        lifecycle("b#prefill", LifecycleEvent::Freed),
        lifecycle("a", LifecycleEvent::Freed),
        // `b` finishes its prefill after being freed: applied in order, so rejected.
        lifecycle("b", LifecycleEvent::Freed),
        lifecycle("b", LifecycleEvent::PrefillDone),
    ];
    handle_lifecycle_batch(
        &state.admission,
        &state.counters,
        &Limits::default(),
        payloads.iter().map(|p| (SUBJECT, &p[..])),
    );
    assert_eq!(state.scheduler().active_requests(), 0);
    assert_eq!(state.scheduler().rank_load(rank), Default::default());
    let count = |outcome| state.counters.messages(MessageKind::Lifecycle, outcome);
    assert_eq!(
        count(Outcome::Ok),
        3,
        "a's prefill_done and freed, b's freed"
    );
    assert_eq!(count(Outcome::Malformed), 1);
    assert_eq!(
        count(Outcome::Rejected),
        3,
        "the unknown id, the reserved id, and b's prefill_done after its freed"
    );
}

fn message(id: &str, event: LifecycleEvent) -> LifecycleMessage {
    LifecycleMessage {
        request_id: id.into(),
        event,
    }
}

#[tokio::test]
async fn a_wire_batch_applies_in_order_beside_single_messages_and_an_over_long_one_is_refused_whole()
 {
    let starting = starting();
    let state = starting.state();
    book(state, &["a", "c", "d"]);
    let batch = |messages: &[LifecycleMessage]| LifecycleBatch::encode(messages).unwrap();

    // In order, `a` ends its prefill, then is freed; applied out of order, its
    // prefill_done would come after its freed and be rejected.
    let in_order = batch(&[
        message("a", LifecycleEvent::PrefillDone),
        message("c", LifecycleEvent::PrefillDone),
        message("a", LifecycleEvent::Freed),
    ]);
    // Over the limit: refused whole, so `d` stays booked.
    let over_long = batch(
        &std::iter::repeat_n(message("d", LifecycleEvent::Freed), MAX_LIFECYCLE_BATCH + 1)
            .collect::<Vec<_>>(),
    );
    // The single form, as older frontends send it.
    let single = lifecycle("c", LifecycleEvent::Freed);
    let payloads = [in_order, over_long, single];
    handle_lifecycle_batch(
        &state.admission,
        &state.counters,
        &Limits::default(),
        payloads.iter().map(|p| (SUBJECT, &p[..])),
    );
    assert_eq!(
        state.scheduler().active_requests(),
        1,
        "only d, whose batch was refused"
    );
    assert_ne!(state.scheduler().rank_load(rank()), Default::default());
    let count = |outcome| state.counters.messages(MessageKind::Lifecycle, outcome);
    assert_eq!(
        count(Outcome::Ok),
        4,
        "a's two, c's prefill_done and its single freed"
    );
    assert_eq!(
        count(Outcome::Rejected),
        0,
        "every message applied in order"
    );
    assert_eq!(count(Outcome::OverLimit), 1, "the over-long batch, once");
}
