//! The differential test of pair selection: a request that does not allow
//! disaggregation, or any request in a fleet without `prefill` workers, is placed
//! exactly as before. Three schedulers with one seed take the same random fleet of
//! `both` workers and the same random routes, lifecycle steps, load reports and clock:
//! `plain` routes without `allow_disaggregation` (the aggregated path, as it was),
//! `allowing` with it (no prefill worker is registered, so no decision), and
//! `mixed` without it in the same fleet plus idle `prefill` workers whose ids sort
//! between the others'. Every result — rank, overlap, cost, booked prefill, session
//! outcome, or error — must be equal, so `mixed` never routes to a prefill worker
//! and the prefill workers change nothing else either.

use super::*;
use kv_events::RequestId;
use kv_events::disaggregation::{KvTransfer, TransferProtocol, WorkerRole};
use kv_events::routing::SessionId;
use kv_events::{DpRank, LoadMetrics, LocalBlockHash};
use proptest::prelude::*;
use std::collections::HashMap;
use std::time::Duration;

const BLOCK: u32 = 16;

#[derive(Debug, Clone)]
enum Op {
    Route {
        tokens: u64,
        prefix: u64,
        /// Per rank (by index), the share of the prompt it caches, in percent.
        cached: Vec<u8>,
        session: Option<u8>,
        exclude: Option<u8>,
        pin: Option<u8>,
    },
    PrefillDone(u8),
    Free(u8),
    Report(u8),
    Advance(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            1..3000u64,
            0..4u64,
            proptest::collection::vec(0..=100u8, 8),
            proptest::option::of(0..3u8),
            proptest::option::weighted(0.2, 0..8u8),
            proptest::option::weighted(0.1, 0..2u8),
        )
            .prop_map(|(tokens, prefix, cached, session, exclude, pin)| Op::Route {
                tokens,
                prefix,
                cached,
                session,
                exclude,
                pin,
            }),
        2 => any::<u8>().prop_map(Op::PrefillDone),
        2 => any::<u8>().prop_map(Op::Free),
        1 => any::<u8>().prop_map(Op::Report),
        1 => (0..2000u16).prop_map(Op::Advance),
    ]
}

fn worker(id: u64, dp_size: u32, total_kv_blocks: u64, role: WorkerRole) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: WorkerId(id),
        dp_size,
        block_size: BLOCK,
        total_kv_blocks,
        url: None,
        epoch: 0,
        max_model_len: None,
        role,
        kv_transfer: (role != WorkerRole::Both).then_some(KvTransfer {
            protocol: TransferProtocol::Vllm,
            bootstrap_port: None,
        }),
    }
}

fn config(kind: PolicyKind, busy: bool) -> SchedulerConfig {
    SchedulerConfig {
        policy: PolicyConfig::default_for(kind),
        busy: BusyThresholds {
            decode_blocks: busy.then_some(Threshold::Fraction(0.5)),
            prefill_tokens: busy.then_some(Threshold::Absolute(4000)),
        },
        liveness: LivenessConfig {
            metrics_interval: Duration::from_millis(100),
            ..LivenessConfig::default()
        },
        ..SchedulerConfig::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn requests_without_disaggregation_are_placed_as_before(
        fleet in proptest::collection::vec((1..=2u32, 100..3000u64), 1..=4),
        kind in proptest::sample::select(PolicyKind::ALL.to_vec()),
        busy in any::<bool>(),
        seed in any::<u64>(),
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let build = |with_prefill: bool| {
            let mut s = Scheduler::new(config(kind, busy), Some(seed)).unwrap();
            for (i, &(dp, kv)) in fleet.iter().enumerate() {
                let id = 2 * i as u64 + 1;
                s.add_worker(worker(id, dp, kv, WorkerRole::Both)).unwrap();
                if with_prefill {
                    s.add_worker(worker(id + 1, 1, kv, WorkerRole::Prefill)).unwrap();
                }
            }
            s
        };
        let (mut plain, mut allowing, mut mixed) = (build(false), build(false), build(true));
        let ranks: Vec<WorkerRank> = plain.ranks().to_vec();
        let mut now = Instant::now();
        let mut routed: Vec<RequestId> = Vec::new();
        for (n, op) in ops.into_iter().enumerate() {
            match op {
                Op::Route { tokens, prefix, cached, session, exclude, pin } => {
                    let hashes = (0..tokens / u64::from(BLOCK))
                        .map(|i| LocalBlockHash(prefix * 10_000 + i))
                        .collect();
                    let mut req = ScheduleRequest::new(format!("r{n}"), hashes, tokens, BLOCK);
                    req.session_id = session.map(|s| SessionId::new(&format!("s{s}")).unwrap());
                    req.exclude(exclude.map(|e| WorkerId(u64::from(e))).into_iter().collect());
                    req.dp_rank = pin.map(|p| DpRank(u32::from(p)));
                    let overlaps: HashMap<WorkerRank, u32> = ranks
                        .iter()
                        .zip(&cached)
                        .map(|(&r, &pct)| (r, req.request_blocks * u32::from(pct) / 100))
                        .collect();
                    let a = plain.schedule(&req, &overlaps, now);
                    let c = mixed.schedule(&req, &overlaps, now);
                    req.allow_disaggregation = true;
                    let b = allowing.schedule(&req, &overlaps, now);
                    prop_assert_eq!(&a, &b);
                    prop_assert_eq!(&a, &c);
                    if let Ok(sel) = a {
                        prop_assert!(sel.disaggregation.is_none());
                        routed.push(req.request_id);
                    }
                }
                Op::PrefillDone(i) | Op::Free(i) if !routed.is_empty() => {
                    let id = routed[usize::from(i) % routed.len()].clone();
                    for s in [&mut plain, &mut allowing, &mut mixed] {
                        let _ = match op {
                            Op::Free(_) => s.free(&id, now),
                            _ => s.mark_prefill_completed(&id, now),
                        };
                    }
                }
                Op::Report(i) => {
                    let rank = ranks[usize::from(i) % ranks.len()];
                    for s in [&mut plain, &mut allowing, &mut mixed] {
                        let sample = LoadMetrics {
                            worker_id: rank.worker_id,
                            dp_rank: rank.dp_rank,
                            ..LoadMetrics::default()
                        };
                        s.update_load_metrics(sample, now);
                    }
                }
                Op::Advance(ms) => now += Duration::from_millis(u64::from(ms)),
                Op::PrefillDone(_) | Op::Free(_) => {}
            }
        }
    }
}
