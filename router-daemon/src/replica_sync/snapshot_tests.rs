//! Applying snapshot replies against a daemon state built without network, so the
//! races with live steps are driven deterministically.

use super::*;
use crate::lifecycle::handle_lifecycle;
use crate::replica_sync::sync::handle_sync;
use crate::replicas::bookings::OwnBookings;
use crate::test_state::starting;
use kv_events::limits::Limits;
use kv_events::replicas::{SequenceSync, SequenceUpdate};
use kv_events::routing::{LifecycleEvent, LifecycleMessage};
use kv_events::{DpRank, LocalBlockHash, WorkerId, WorkerRank};
use scheduler::{AddRequest, Origin, PrefillLoadHint};

const PEER: RouterId = RouterId(7);
const US: RouterId = RouterId(1);

fn booked(worker: u64) -> BookedSequence {
    BookedSequence {
        worker_id: WorkerId(worker),
        dp_rank: DpRank(0),
        block_hashes: vec![LocalBlockHash(1), LocalBlockHash(2)],
        request_blocks: 3,
        prefill_tokens: 12,
        expected_prefill_ms: None,
        session_id: None,
    }
}

fn entry(id: &str, worker: u64, prefill_done: bool) -> SnapshotEntry {
    SnapshotEntry {
        request_id: id.into(),
        booked: booked(worker),
        prefill_done,
    }
}

fn sync(id: &str, update: SequenceUpdate) -> Vec<u8> {
    encode(&SequenceSync {
        router_id: PEER,
        request_id: id.into(),
        update,
    })
    .unwrap()
}

fn lifecycle(id: &str, event: LifecycleEvent) -> Vec<u8> {
    encode(&LifecycleMessage {
        request_id: id.into(),
        event,
    })
    .unwrap()
}

fn reply(router_id: RouterId, requests: Vec<SnapshotEntry>) -> Vec<u8> {
    encode(&SnapshotReply {
        router_id,
        chunk: 0,
        last: true,
        requests,
        accepts_packed: true,
    })
    .unwrap()
}

#[tokio::test]
async fn a_reply_skips_what_was_freed_or_known_and_keeps_prefill_done() {
    let starting = starting();
    let state = starting.state();
    let replicas = &state.admission.replicas;
    replicas.begin_recording();

    // While the snapshot window is open, live traffic arrives before the reply:
    // a peer booking, frees from the frontend and from the peer (for requests this
    // replica does not know yet), and a prefill_done from the frontend.
    handle_sync(
        &state.admission,
        &state.counters,
        &Limits::default(),
        "it.router.sequences",
        &sync("known", SequenceUpdate::Booked(booked(1))),
    );
    handle_lifecycle(
        &state.admission,
        &state.counters,
        &Limits::default(),
        "it.router.lifecycle",
        &lifecycle("gone-frontend", LifecycleEvent::Freed),
    );
    handle_sync(
        &state.admission,
        &state.counters,
        &Limits::default(),
        "it.router.sequences",
        &sync("gone-peer", SequenceUpdate::Freed),
    );
    handle_lifecycle(
        &state.admission,
        &state.counters,
        &Limits::default(),
        "it.router.lifecycle",
        &lifecycle("early", LifecycleEvent::PrefillDone),
    );
    assert_eq!(state.scheduler().active_requests(), 1);
    let known_load = state
        .scheduler()
        .rank_load(WorkerRank::new(WorkerId(1), DpRank(0)));

    // The peer's answer was taken before those steps.
    let mut summary = SnapshotSummary::default();
    let payload = reply(
        PEER,
        vec![
            entry("known", 1, false),
            entry("gone-frontend", 1, false),
            entry("gone-peer", 2, true),
            entry("early", 2, false),
            entry("done", 2, true),
            entry("fresh", 1, false),
            entry("ghost", 99, false),
        ],
    );
    apply_reply(
        &state.admission,
        &state.counters,
        &Limits::default(),
        "_INBOX.x",
        &payload,
        &mut summary,
    );

    let scheduler = state.scheduler();
    let mut ids: Vec<String> = scheduler
        .sequences()
        .iter()
        .map(|(id, _)| id.0.clone())
        .collect();
    ids.sort();
    assert_eq!(
        ids,
        ["done", "early", "fresh", "known"],
        "freed requests are not resurrected"
    );
    for (_, r) in scheduler.sequences().iter() {
        assert_eq!(r.origin, Origin::Peer(PEER));
    }
    let prefill_done = |id: &str| {
        scheduler
            .sequences()
            .get(&id.into())
            .map(|r| r.prefill_done)
    };
    assert_eq!(
        prefill_done("early"),
        Some(true),
        "a recorded prefill_done applies"
    );
    assert_eq!(prefill_done("done"), Some(true), "the reply's flag applies");
    assert_eq!(prefill_done("fresh"), Some(false));
    // "known" was not counted twice: worker 1 holds it and "fresh", which shares its
    // prefix blocks.
    let load = scheduler.rank_load(WorkerRank::new(WorkerId(1), DpRank(0)));
    assert_eq!(load.active_requests, 2);
    assert_eq!(
        load.active_decode_blocks,
        known_load.active_decode_blocks + 1
    );
    drop(scheduler);

    assert_eq!(summary.peers.get(&PEER), Some(&(1, true)));
    assert_eq!(
        (
            summary.applied,
            summary.duplicate,
            summary.freed,
            summary.rejected
        ),
        (3, 1, 2, 1)
    );
    let m = replicas.metrics();
    assert_eq!(m.get("snapshot_in", "applied"), 3);
    assert_eq!(m.get("snapshot_in", "duplicate"), 1);
    assert_eq!(m.get("snapshot_in", "freed"), 2);
    assert_eq!(m.get("snapshot_in", "rejected"), 1);

    // The live `booked` arriving after the reply is a duplicate, not a refusal.
    handle_sync(
        &state.admission,
        &state.counters,
        &Limits::default(),
        "it.router.sequences",
        &sync("fresh", SequenceUpdate::Booked(booked(1))),
    );
    assert_eq!(
        m.get("in", "duplicate"),
        2,
        "gone-peer's free and fresh's booking"
    );
    assert_eq!(m.get("in", "rejected"), 0);
    assert_eq!(state.scheduler().active_requests(), 4);

    // Once the window closes, nothing is recorded any more.
    replicas.end_recording();
    handle_lifecycle(
        &state.admission,
        &state.counters,
        &Limits::default(),
        "it.router.lifecycle",
        &lifecycle("later", LifecycleEvent::Freed),
    );
    assert_eq!(replicas.recent_steps().get(&"later".into()), None);
    assert_eq!(replicas.recent_steps().get(&"gone-peer".into()), None);
}

#[tokio::test]
async fn malformed_and_own_replies_are_skipped() {
    let starting = starting();
    let state = starting.state();
    let mut summary = SnapshotSummary::default();
    apply_reply(
        &state.admission,
        &state.counters,
        &Limits::default(),
        "_INBOX.x",
        &[0xc1, 0x00],
        &mut summary,
    );
    apply_reply(
        &state.admission,
        &state.counters,
        &Limits::default(),
        "_INBOX.x",
        &reply(US, vec![entry("mine", 1, false)]),
        &mut summary,
    );
    assert_eq!(summary.malformed, 1);
    assert!(summary.peers.is_empty());
    assert_eq!(state.scheduler().active_requests(), 0);
    assert_eq!(
        state
            .counters
            .messages(MessageKind::SequenceSnapshot, Outcome::Malformed),
        1
    );
    assert_eq!(
        state
            .admission
            .replicas
            .metrics()
            .get("snapshot_in", "malformed"),
        1
    );
}

#[tokio::test]
async fn answers_hold_only_bookings_still_our_own() {
    let starting = starting();
    let state = starting.state();
    let now = Instant::now();
    let add = |id: &str, origin: Origin| {
        state
            .scheduler()
            .apply(
                scheduler::SequenceEvent::AddRequest(AddRequest {
                    request_id: id.into(),
                    rank: WorkerRank::new(WorkerId(1), DpRank(0)),
                    block_hashes: vec![],
                    request_blocks: 1,
                    prefill: PrefillLoadHint::default(),
                    origin,
                    session_id: None,
                }),
                now,
            )
            .unwrap();
    };
    add("own", Origin::Local);
    add("own-done", Origin::Local);
    add("peer", Origin::Peer(PEER));
    state
        .scheduler()
        .mark_prefill_completed(&"own-done".into(), now)
        .unwrap();
    let mut own = OwnBookings::default();
    for id in ["own", "own-done", "peer", "dropped-with-its-worker"] {
        assert!(!own.insert(id.into(), Arc::new(booked(1))));
    }
    let scheduler = state.scheduler();
    let mut current: Vec<(String, bool)> = own
        .current(&scheduler)
        .into_iter()
        .map(|(id, _, done)| (id.0, done))
        .collect();
    current.sort();
    assert_eq!(
        current,
        [("own".to_owned(), false), ("own-done".to_owned(), true)]
    );
    own.prune(&scheduler);
    assert_eq!(own.len(), 2);
}
