//! Unit and property tests of the active-sequence write model.

use super::*;
use kv_events::DpRank;
use proptest::prelude::*;
use std::collections::HashSet;
use std::time::Duration;

fn rank(id: u64, dp: u32) -> WorkerRank {
    WorkerRank::new(WorkerId(id), DpRank(dp))
}

fn id(s: &str) -> RequestId {
    RequestId::from(s)
}

fn seqs(assume_kv_reuse: bool) -> ActiveSequences {
    ActiveSequences::new(SequencesConfig {
        assume_kv_reuse,
        request_ttl: Duration::from_secs(60),
    })
}

fn add(req: &str, at: WorkerRank, hashes: &[u64], blocks: u32, tokens: u64) -> AddRequest {
    AddRequest {
        request_id: id(req),
        rank: at,
        block_hashes: hashes.iter().copied().map(LocalBlockHash).collect(),
        request_blocks: blocks,
        prefill: PrefillLoadHint {
            initial_effective_prefill_tokens: tokens,
            expected_prefill_duration: None,
        },
        origin: Origin::Local,
        session_id: None,
    }
}

#[test]
fn booking_lifecycle_updates_the_projection() {
    let t = Instant::now();
    let mut s = seqs(true);
    s.add_request(add("a", rank(1, 0), &[1, 2, 3], 8, 100), t)
        .unwrap();
    s.add_request(add("b", rank(1, 0), &[9], 3, 40), t).unwrap();
    s.add_request(add("c", rank(2, 0), &[], 1, 7), t).unwrap();
    assert_eq!(
        s.load(rank(1, 0), t),
        RankLoad {
            active_prefill_tokens: 140,
            active_decode_blocks: 11,
            active_requests: 2,
            active_uncached_tokens: 140,
            active_context_blocks: 11,
        }
    );

    assert_eq!(s.mark_prefill_completed(&id("a"), t), Ok(Origin::Local));
    s.mark_prefill_completed(&id("a"), t).unwrap();
    assert_eq!(s.load(rank(1, 0), t).active_prefill_tokens, 40);
    assert_eq!(s.load(rank(1, 0), t).active_decode_blocks, 11);
    assert_eq!(s.load(rank(1, 0), t).active_uncached_tokens, 140);
    assert!(s.get(&id("a")).unwrap().prefill_done);

    let freed = s.free(&id("a"), t).unwrap();
    assert_eq!(freed.request_blocks, 8);
    assert_eq!(
        s.load(rank(1, 0), t),
        RankLoad {
            active_prefill_tokens: 40,
            active_decode_blocks: 3,
            active_requests: 1,
            active_uncached_tokens: 40,
            active_context_blocks: 3,
        }
    );
    // Freeing before prefill completed releases its prefill tokens too.
    s.free(&id("b"), t).unwrap();
    assert_eq!(s.load(rank(1, 0), t), RankLoad::default());
    assert_eq!(s.len(), 1);
    assert!(!s.per_rank.contains_key(&rank(1, 0)));
}

#[test]
fn apply_dispatches_every_event_and_reports_the_origin() {
    let t = Instant::now();
    let mut s = seqs(true);
    let peer = Origin::Peer(RouterId(7));
    let booking = AddRequest {
        origin: peer,
        ..add("p", rank(1, 0), &[1], 2, 30)
    };
    assert_eq!(s.apply(SequenceEvent::AddRequest(booking), t), Ok(peer));
    assert_eq!(
        s.apply(SequenceEvent::MarkPrefillCompleted(id("p")), t),
        Ok(peer)
    );
    assert_eq!(s.apply(SequenceEvent::KeepAlive(id("p")), t), Ok(peer));
    assert_eq!(s.apply(SequenceEvent::Free(id("p")), t), Ok(peer));
    assert_eq!(
        s.apply(SequenceEvent::Free(id("p")), t),
        Err(SchedulerError::UnknownRequest(id("p")))
    );
}

#[test]
fn kv_reuse_counts_a_shared_prefix_once_and_can_be_turned_off() {
    let t = Instant::now();
    // Two requests share 3 of their 4 hashed blocks; each has 1 partial block.
    for (reuse, expected) in [(true, 3 + 1 + 1 + 1 + 1), (false, 5 + 5)] {
        let mut s = seqs(reuse);
        s.add_request(add("a", rank(1, 0), &[1, 2, 3, 4], 5, 0), t)
            .unwrap();
        s.add_request(add("b", rank(1, 0), &[1, 2, 3, 8], 5, 0), t)
            .unwrap();
        assert_eq!(
            s.load(rank(1, 0), t).active_decode_blocks,
            expected,
            "assume_kv_reuse = {reuse}"
        );
        // Decode attention still reads the shared prefix once per sequence.
        assert_eq!(s.load(rank(1, 0), t).active_context_blocks, 10);
        // The same prefix on another rank is not shared with this one.
        s.add_request(add("c", rank(2, 0), &[1, 2, 3, 4], 5, 0), t)
            .unwrap();
        assert_eq!(s.load(rank(2, 0), t).active_decode_blocks, 5);
    }
}

#[test]
fn new_blocks_counts_only_blocks_not_already_held() {
    let t = Instant::now();
    let hashes: Vec<LocalBlockHash> = [1, 2, 3, 4].into_iter().map(LocalBlockHash).collect();
    let ids = chain_block_ids(&hashes);
    let mut s = seqs(true);
    assert_eq!(s.new_blocks(rank(1, 0), &ids, 5), 5);
    s.add_request(add("a", rank(1, 0), &[1, 2, 9], 3, 0), t)
        .unwrap();
    assert_eq!(s.new_blocks(rank(1, 0), &ids, 5), 3);
    assert_eq!(s.new_blocks(rank(2, 0), &ids, 5), 5);
    assert_eq!(seqs(false).new_blocks(rank(1, 0), &ids, 5), 5);
}

#[test]
fn requests_expire_after_the_ttl_unless_refreshed() {
    let t0 = Instant::now();
    let s_at = |secs| t0 + Duration::from_secs(secs);
    let mut s = seqs(true);
    s.add_request(add("quiet", rank(1, 0), &[1], 1, 10), t0)
        .unwrap();
    s.add_request(add("chatty", rank(1, 0), &[2], 1, 10), t0)
        .unwrap();
    assert_eq!(s.next_deadline(), Some(s_at(60)));
    // Any lifecycle event pushes the deadline out by a full TTL.
    s.mark_prefill_completed(&id("chatty"), s_at(30)).unwrap();
    s.keep_alive(&id("chatty"), s_at(59)).unwrap();
    assert!(s.expire(s_at(59)).is_empty());
    let expired = s.expire(s_at(60));
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].0, id("quiet"));
    assert_eq!(s.load(rank(1, 0), s_at(60)).active_requests, 1);
    assert_eq!(s.next_deadline(), Some(s_at(119)));
    assert!(s.expire(s_at(118)).is_empty());
    assert_eq!(s.expire(s_at(119)).len(), 1);
    assert!(s.is_empty());
    assert_eq!(s.next_deadline(), None);
    assert_eq!(
        s.keep_alive(&id("quiet"), s_at(120)),
        Err(SchedulerError::UnknownRequest(id("quiet")))
    );
}

#[test]
fn duplicate_and_unknown_ids_are_typed_errors() {
    let t = Instant::now();
    let mut s = seqs(true);
    s.add_request(add("a", rank(1, 0), &[], 1, 10), t).unwrap();
    assert_eq!(
        s.add_request(add("a", rank(2, 0), &[], 9, 99), t),
        Err(SchedulerError::DuplicateRequest(id("a")))
    );
    assert_eq!(s.load(rank(2, 0), t), RankLoad::default());
    assert_eq!(s.load(rank(1, 0), t).active_prefill_tokens, 10);
    assert_eq!(
        s.mark_prefill_completed(&id("zz"), t),
        Err(SchedulerError::UnknownRequest(id("zz")))
    );
    assert_eq!(
        s.free(&id("zz"), t),
        Err(SchedulerError::UnknownRequest(id("zz")))
    );
}

#[test]
fn remove_worker_and_rank_drop_only_their_requests_and_deadlines() {
    let t = Instant::now();
    let mut s = seqs(true);
    s.add_request(add("a", rank(1, 0), &[], 1, 10), t).unwrap();
    s.add_request(add("b", rank(1, 1), &[], 1, 10), t).unwrap();
    s.add_request(add("c", rank(2, 0), &[], 1, 10), t).unwrap();
    s.add_request(add("d", rank(2, 1), &[], 1, 10), t).unwrap();
    assert_eq!(s.remove_worker(WorkerId(1)), 2);
    assert!(!s.contains(&id("a")) && !s.contains(&id("b")));
    assert_eq!(s.load(rank(1, 1), t), RankLoad::default());
    assert_eq!(s.remove_rank(rank(2, 1)), 1);
    assert_eq!(s.len(), 1);
    assert_eq!(s.deadlines.len(), 1);
    assert_eq!(s.load(rank(2, 0), t).active_requests, 1);
    assert!(matches!(
        s.free(&id("d"), t),
        Err(SchedulerError::UnknownRequest(_))
    ));
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        req: u8,
        rank: u8,
        prefix: u8,
        len: u8,
        /// Blocks from this one on leave the prefix's chain (none when at or past
        /// `len`): prompts that branch off each other's middle.
        twist: u8,
        tokens: u16,
    },
    Prefill {
        req: u8,
    },
    Free {
        req: u8,
    },
    Expire {
        secs: u8,
    },
    RemoveWorker {
        worker: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..12, 0u8..4, 0u8..3, 0u8..6, 1u8..8, any::<u16>()).prop_map(
            |(req, rank, prefix, len, twist, tokens)| Op::Add {
                req,
                rank,
                prefix,
                len,
                twist,
                tokens
            }
        ),
        (0u8..12).prop_map(|req| Op::Prefill { req }),
        (0u8..12).prop_map(|req| Op::Free { req }),
        (0u8..20).prop_map(|secs| Op::Expire { secs }),
        (0u8..2).prop_map(|worker| Op::RemoveWorker { worker }),
    ]
}

/// A prompt of `len` block hashes along chain `prefix`, leaving it at block `twist`.
fn prompt(prefix: u8, len: u8, twist: u8) -> Vec<u64> {
    (0..u64::from(len))
        .map(|i| u64::from(prefix) * 100 + i + if i >= u64::from(twist) { 50 } else { 0 })
        .collect()
}

proptest! {
    /// The incremental aggregates always equal a recomputation from the records,
    /// with and without KV reuse (prompts drawn from 3 shared prefixes).
    #[test]
    fn aggregates_match_records(
        ops in proptest::collection::vec(op(), 0..200),
        reuse in any::<bool>(),
    ) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut s = ActiveSequences::new(SequencesConfig {
            assume_kv_reuse: reuse,
            request_ttl: Duration::from_secs(30),
        });
        for op in ops {
            match op {
                Op::Add { req, rank: r, prefix, len, twist, tokens } => {
                    let hashes = prompt(prefix, len, twist);
                    let _ = s.add_request(
                        add(&req.to_string(), rank(u64::from(r / 2), u32::from(r % 2)),
                            &hashes, u32::from(len) + 1, u64::from(tokens)),
                        now,
                    );
                }
                Op::Prefill { req } => {
                    let _ = s.mark_prefill_completed(&RequestId(req.to_string()), now);
                }
                Op::Free { req } => {
                    let _ = s.free(&RequestId(req.to_string()), now);
                }
                Op::Expire { secs } => {
                    now += Duration::from_secs(u64::from(secs));
                    s.expire(now);
                }
                Op::RemoveWorker { worker } => {
                    s.remove_worker(WorkerId(u64::from(worker)));
                }
            }
            prop_assert_eq!(s.deadlines.len(), s.requests.len());
            prop_assert!(s.requests.values().all(|r| r.deadline > now));
            let mut expected: HashMap<WorkerRank, (RankLoad, HashSet<u64>)> = HashMap::new();
            for r in s.requests.values() {
                let (load, ids) = expected.entry(r.rank).or_default();
                if !r.prefill_done {
                    load.active_prefill_tokens += r.prefill.initial_effective_prefill_tokens;
                }
                load.active_decode_blocks += r.private_blocks;
                ids.extend(r.block_ids.iter().copied());
                load.active_requests += 1;
                load.active_uncached_tokens += r.prefill.initial_effective_prefill_tokens;
                load.active_context_blocks += u64::from(r.request_blocks);
            }
            for (rank, (mut load, ids)) in expected {
                load.active_decode_blocks += ids.len() as u64;
                prop_assert_eq!(load, s.load(rank, now));
                // The prompts' leading blocks held in flight, against the records.
                for (prefix, twist) in (0..3).flat_map(|p| [(p, 2), (p, 4), (p, 7)]) {
                    let hashes: Vec<LocalBlockHash> =
                        prompt(prefix, 6, twist).into_iter().map(LocalBlockHash).collect();
                    let chained = chain_block_ids(&hashes);
                    let held = if reuse {
                        chained.iter().take_while(|id| ids.contains(id)).count() as u32
                    } else {
                        0
                    };
                    prop_assert_eq!(s.new_blocks(rank, &chained, 7), 7 - held);
                }
            }
            prop_assert_eq!(s.per_rank.len(), s.requests.values().map(|r| r.rank).collect::<HashSet<_>>().len());
        }
    }
}

proptest! {
    /// Two prompts that share exactly their first `shared` blocks share exactly their
    /// first `shared` chained ids: after the first differing block no id of one is an
    /// id of the other, also for small, structured hashes (block hashes that differ
    /// in one low bit, repeated blocks, one prompt a prefix of the other's blocks).
    #[test]
    fn chained_ids_are_shared_exactly_as_far_as_the_prefix(
        shared in proptest::collection::vec(0u64..4, 0..24),
        a in proptest::collection::vec(prop_oneof![0u64..4, any::<u64>()], 1..24),
        b in proptest::collection::vec(prop_oneof![0u64..4, any::<u64>()], 1..24),
    ) {
        prop_assume!(a[0] != b[0]);
        let ids = |tail: &[u64]| {
            let hashes: Vec<_> =
                shared.iter().chain(tail).map(|&h| LocalBlockHash(h)).collect();
            chain_block_ids(&hashes)
        };
        let (ia, ib) = (ids(&a), ids(&b));
        let k = shared.len();
        prop_assert_eq!(&ia[..k], &ib[..k]);
        for x in &ia[k..] {
            prop_assert!(!ib.contains(x), "an id of one tail is an id of the other");
        }
        // Within one prompt, every position has its own id.
        let mut seen = ia.clone();
        seen.sort_unstable();
        seen.dedup();
        prop_assert_eq!(seen.len(), ia.len());
    }
}

/// A rank emptied leaves its aggregate to the next rank booked from idle: that rank
/// starts from nothing (no block, prefill or count of the old one), by either way
/// a rank empties (its last request, or a request freed after others).
#[test]
fn an_emptied_ranks_aggregate_serves_the_next_rank_from_nothing() {
    let t = Instant::now();
    let mut s = seqs(true);
    let fresh = |s: &mut ActiveSequences, req: &str, at: WorkerRank| {
        s.add_request(add(req, at, &[50, 51], 3, 30), t).unwrap();
        s.load(at, t)
    };
    let expected = fresh(&mut seqs(true), "x", rank(9, 0));
    // Emptied by its only request.
    s.add_request(add("a", rank(1, 0), &[1, 2, 3], 8, 100), t)
        .unwrap();
    s.free(&id("a"), t).unwrap();
    assert_eq!(fresh(&mut s, "b", rank(2, 0)), expected);
    // Emptied after holding two requests, the last freed through its blocks.
    s.add_request(add("c", rank(3, 0), &[1, 2], 4, 10), t)
        .unwrap();
    s.add_request(add("d", rank(3, 0), &[1, 7], 4, 20), t)
        .unwrap();
    s.mark_prefill_completed(&id("c"), t).unwrap();
    s.free(&id("c"), t).unwrap();
    s.free(&id("d"), t).unwrap();
    assert_eq!(s.load(rank(3, 0), t), RankLoad::default());
    assert_eq!(fresh(&mut s, "e", rank(4, 0)), expected);
    // The new rank's blocks are its own: a prompt of the old ones is all new there.
    let ids = chain_block_ids(&[LocalBlockHash(1), LocalBlockHash(2)]);
    assert_eq!(s.new_blocks(rank(4, 0), &ids, 2), 2);
}
