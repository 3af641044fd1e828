//! A batch of lifecycle messages applies each in order under one lock, and a bad or
//! unknown message in it costs only itself.

use super::*;
use crate::test_state::starting;
use kv_events::encode;
use kv_events::routing::LifecycleEvent;
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

#[tokio::test]
async fn a_batch_applies_every_message_in_order_and_skips_only_the_bad_ones() {
    let starting = starting();
    let state = starting.state();
    let rank = WorkerRank::new(WorkerId(1), DpRank(0));
    for id in ["a", "b"] {
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
