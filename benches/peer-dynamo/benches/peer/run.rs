//! One measurement round of one library on one case: every figure but memory.

use crate::flood::{self, Flood};
use crate::lib_api::{Front, Library, Scores};
use bench_workload::{latencies, percentiles, quantile_ms};
use kv_events::{KvEventBatch, LocalBlockHash, WorkerId};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Front queries per phase (idle, flooded), at least; queries repeat as needed.
const MIN_SAMPLES: usize = 20_000;
/// Duration of a front query phase, at least.
const MIN_PHASE: Duration = Duration::from_secs(1);

/// A workload as both libraries get it.
pub struct Case {
    /// Column title, e.g. `64 × 1M`.
    pub name: String,
    /// Events in publication order.
    pub batches: Vec<KvEventBatch>,
    /// (worker, block) entries after applying `batches`.
    pub blocks: u64,
    /// Queries, and the reference model's answer to each.
    pub queries: Vec<(Arc<[LocalBlockHash]>, Scores)>,
}

/// Answers that differ from the reference model, with a few examples.
#[derive(Debug, Default)]
pub struct Wrong {
    /// Wrong answers.
    pub count: u64,
    /// Answers checked.
    pub checked: u64,
    /// Up to three examples.
    pub examples: Vec<String>,
}

impl Wrong {
    /// Checks one answer.
    pub fn check(&mut self, what: &str, expected: &Scores, got: &Scores) {
        self.checked += 1;
        if expected != got {
            self.count += 1;
            if self.examples.len() < 3 {
                self.examples.push(format!(
                    "{what}: expected {} workers (best {:?}), got {} (best {:?})",
                    expected.len(),
                    best(expected),
                    got.len(),
                    best(got)
                ));
            }
        }
    }
}

impl Wrong {
    /// Adds the counts and examples of `other`.
    fn add(&mut self, other: Wrong) {
        self.count += other.count;
        self.checked += other.checked;
        self.examples.extend(other.examples);
    }
}

fn best(s: &Scores) -> Option<(WorkerId, u32)> {
    s.iter().max_by_key(|(_, n)| **n).map(|(w, n)| (*w, *n))
}

/// The figures of one round.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    /// Bare tree, 1 thread: stored blocks per second.
    pub apply: f64,
    /// Bare tree, 1 thread: stored blocks per second on a CPU (NaN where the thread's
    /// CPU time is unknown): `apply` without the waits for a core on a shared host.
    pub apply_cpu: f64,
    /// Bare tree query p50, µs.
    pub bare_p50: f64,
    /// Front bulk ingest on 2 threads: blocks per second.
    pub ingest: f64,
    /// Front query p50 / p99 idle, µs.
    pub front_p50: f64,
    /// Front query p99 idle, µs.
    pub front_p99: f64,
    /// Front query p99 under each flood of the run, µs.
    pub flood_p99: Vec<f64>,
    /// Front query p99.9 under each flood of the run, µs: one query in a thousand
    /// waits this long, which shows a writer holding a shard where p99 may not (a
    /// closed-loop query task asks again right after a wait, so waits are few samples).
    pub flood_p999: Vec<f64>,
    /// Flood rate achieved in each flood, blocks per second.
    pub flood_rate: Vec<f64>,
}

/// The bare-tree figures of one round of `L` on `case` (`apply`, `bare_p50`; the rest
/// left zero); answers are checked into `wrong`.
pub fn bare<L: Library>(case: &Case, wrong: &mut Wrong) -> Figures {
    let queries: Vec<L::Query> = case.queries.iter().map(|(q, _)| L::query(q)).collect();
    let mut f = Figures::default();
    let (tree, took) = L::build(L::events(&case.batches));
    f.apply = case.blocks as f64 / took.wall.as_secs_f64();
    f.apply_cpu = took
        .cpu
        .map_or(f64::NAN, |cpu| case.blocks as f64 / cpu.as_secs_f64());
    let mut samples = Vec::with_capacity(queries.len());
    for (q, (_, expected)) in queries.iter().zip(&case.queries) {
        let start = Instant::now();
        let answer = L::find(&tree, q);
        samples.push(start.elapsed());
        wrong.check("bare", expected, &L::scores(answer));
    }
    f.bare_p50 = percentiles(samples).0;
    f
}

/// One round of `L` on `case`, on `rt` (2 worker threads), the front measured under
/// each of `floods`; answers are checked into `wrong`.
pub fn round<L: Library>(
    case: &Case,
    floods: &[Flood],
    rt: &tokio::runtime::Runtime,
    wrong: &mut Wrong,
) -> Figures {
    let mut f = bare::<L>(case, wrong);
    let queries: Vec<L::Query> = case.queries.iter().map(|(q, _)| L::query(q)).collect();
    let queries = Arc::new(queries);
    let expected: Arc<Vec<Scores>> =
        Arc::new(case.queries.iter().map(|(_, s)| s.clone()).collect());
    let front = rt.block_on(async { L::front() });
    let (ingest, idle) = rt.block_on(ingest::<L>(
        &front,
        L::events(&case.batches),
        case.blocks,
        queries.clone(),
        expected.clone(),
        wrong,
    ));
    f.ingest = ingest;
    (f.front_p50, f.front_p99, _) = percentiles(idle);
    front.stop();
    for &flood in floods {
        // Each flood on a fresh copy of the case, so no flood sees another's leftovers.
        let front = rt.block_on(async { L::front() });
        let events = L::events(&case.batches);
        let flood_events = L::events(&flood.batches());
        let (p99, p999, rate) = rt.block_on(async {
            ingest_only::<L>(&front, events).await;
            flooded::<L>(&front, flood, flood_events, &queries, &expected, wrong).await
        });
        front.stop();
        f.flood_p99.push(p99);
        f.flood_p999.push(p999);
        f.flood_rate.push(rate);
    }
    wrong.examples.truncate(3);
    f
}

/// Applies `events` to `front`, one producer task per shard/thread (workers split by
/// parity), and waits until they are applied.
async fn ingest_only<L: Library>(front: &L::Front, events: Vec<L::Event>) {
    let (even, odd): (Vec<_>, Vec<_>) = events.into_iter().partition(|e| L::worker(e) % 2 == 0);
    let producers: Vec<_> = [even, odd]
        .into_iter()
        .map(|part| {
            let front = front.clone();
            tokio::spawn(async move {
                for e in part {
                    front.apply(e).await;
                }
            })
        })
        .collect();
    for p in producers {
        p.await.expect("producer");
    }
    front.settle().await;
}

/// Bulk ingest (blocks per second) then the idle query latencies.
async fn ingest<L: Library>(
    front: &L::Front,
    events: Vec<L::Event>,
    blocks: u64,
    queries: Arc<Vec<L::Query>>,
    expected: Arc<Vec<Scores>>,
    wrong: &mut Wrong,
) -> (f64, Vec<Duration>) {
    let start = Instant::now();
    ingest_only::<L>(front, events).await;
    let rate = blocks as f64 / start.elapsed().as_secs_f64();
    let (idle, w) = tokio::spawn(ask::<L>(front.clone(), queries, expected, None))
        .await
        .expect("queries");
    wrong.add(w);
    (rate, idle)
}

/// Queries cycle until MIN_SAMPLES answers and MIN_PHASE have passed: in a closed
/// loop (latency from each query's start), or with `period` one due every period
/// (latency from when it was due, so a query held up delays the ones due after it,
/// as a router's arrivals would be).
async fn ask<L: Library>(
    front: L::Front,
    queries: Arc<Vec<L::Query>>,
    expected: Arc<Vec<Scores>>,
    period: Option<Duration>,
) -> (Vec<Duration>, Wrong) {
    let mut samples = Vec::with_capacity(MIN_SAMPLES);
    let mut wrong = Wrong::default();
    let began = Instant::now();
    for (i, (q, e)) in queries.iter().zip(expected.iter()).cycle().enumerate() {
        if samples.len() >= MIN_SAMPLES && began.elapsed() >= MIN_PHASE {
            break;
        }
        let start = match period {
            None => Instant::now(),
            Some(period) => {
                let due = began + period.mul_f64(i as f64);
                // Spin, not sleep: timers are 1 ms coarse. A closed loop keeps a core
                // busy too, so the fronts get the same CPU either way.
                while Instant::now() < due {
                    std::hint::spin_loop();
                }
                due
            }
        };
        let answer = front.find(q).await;
        samples.push(start.elapsed());
        wrong.check("front", e, &L::scores(answer));
    }
    (samples, wrong)
}

/// Query p99 and p99.9 (µs) under `flood` and the flood rate achieved (blocks per
/// second).
async fn flooded<L: Library>(
    front: &L::Front,
    flood: Flood,
    events: Vec<L::Event>,
    queries: &Arc<Vec<L::Query>>,
    expected: &Arc<Vec<Scores>>,
    wrong: &mut Wrong,
) -> (f64, f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (front, stop, sent) = (front.clone(), stop.clone(), sent.clone());
        let n = flood.batch_blocks as u64;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let started = Instant::now();
            let mut events = events.into_iter();
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                // Send whole batches while behind the rate's schedule.
                let due = (started.elapsed().as_secs_f64() * flood::RATE as f64) as u64;
                while sent.load(Ordering::Relaxed) + n <= due {
                    let Some(e) = events.next() else {
                        return started.elapsed();
                    };
                    front.apply(e).await;
                    sent.fetch_add(n, Ordering::Relaxed);
                }
            }
            started.elapsed()
        })
    };
    if flood.long {
        tokio::time::sleep(flood::LONG_LEAD).await;
    }
    let (samples, w) = tokio::spawn(ask::<L>(
        front.clone(),
        queries.clone(),
        expected.clone(),
        flood.pace.period(),
    ))
    .await
    .expect("queries");
    stop.store(true, Ordering::Relaxed);
    let elapsed = flooder.await.expect("flooder");
    front.settle().await;
    wrong.add(w);
    let rate = sent.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64();
    let histogram = latencies(samples);
    let us = |q| quantile_ms(&histogram, q) * 1e3;
    (us(0.99), us(0.999), rate)
}

/// Minimum, median and maximum of `v` (NaN for none).
pub fn spread(mut v: Vec<f64>) -> [f64; 3] {
    v.sort_by(f64::total_cmp);
    match (v.first(), v.get(v.len() / 2), v.last()) {
        (Some(&lo), Some(&mid), Some(&hi)) => [lo, mid, hi],
        _ => [f64::NAN; 3],
    }
}

/// Reference answers for `queries` after `batches`.
pub fn expected(batches: &[KvEventBatch], queries: &[Arc<[LocalBlockHash]>]) -> Vec<Scores> {
    let mut r = bench_workload::Reference::new();
    for b in batches {
        for e in &b.events {
            r.apply(b.worker_id, e);
        }
    }
    queries
        .iter()
        .map(|q| r.scores(q))
        .collect::<Vec<BTreeMap<_, _>>>()
}
