//! One measurement round of one library on one case: every figure but memory.

use crate::lib_api::{Front, Library, Scores};
use bench_workload::percentiles;
use kv_events::{KvEventBatch, LocalBlockHash, WorkerId};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Flood rate: Stored and Removed blocks per second, in 1 ms bursts.
pub const FLOOD_BLOCKS_PER_SEC: u64 = 1_000_000;

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
    /// Flood events (never matching a query).
    pub flood: Vec<KvEventBatch>,
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

fn best(s: &Scores) -> Option<(WorkerId, u32)> {
    s.iter().max_by_key(|(_, n)| **n).map(|(w, n)| (*w, *n))
}

/// The figures of one round.
#[derive(Debug, Clone, Copy, Default)]
pub struct Figures {
    /// Bare tree, 1 thread: stored blocks per second.
    pub apply: f64,
    /// Bare tree query p50, µs.
    pub bare_p50: f64,
    /// Front bulk ingest on 2 threads: blocks per second.
    pub ingest: f64,
    /// Front query p50 / p99 idle, µs.
    pub front_p50: f64,
    /// Front query p99 idle, µs.
    pub front_p99: f64,
    /// Front query p99 under the flood, µs.
    pub flood_p99: f64,
    /// Flood rate achieved, blocks per second.
    pub flood_rate: f64,
}

/// One round of `L` on `case`, on `rt` (2 worker threads); answers are checked into
/// `wrong`.
pub fn round<L: Library>(case: &Case, rt: &tokio::runtime::Runtime, wrong: &mut Wrong) -> Figures {
    let events = L::events(&case.batches);
    let queries: Vec<L::Query> = case.queries.iter().map(|(q, _)| L::query(q)).collect();
    let mut f = Figures::default();

    let (tree, took) = L::build(events.clone());
    f.apply = case.blocks as f64 / took.as_secs_f64();
    let mut samples = Vec::with_capacity(queries.len());
    for (q, (_, expected)) in queries.iter().zip(&case.queries) {
        let start = Instant::now();
        let answer = L::find(&tree, q);
        samples.push(start.elapsed());
        wrong.check("bare", expected, &L::scores(answer));
    }
    f.bare_p50 = percentiles(samples).0;
    drop(tree);

    let queries = Arc::new(queries);
    let expected: Arc<Vec<Scores>> =
        Arc::new(case.queries.iter().map(|(_, s)| s.clone()).collect());
    let flood = L::events(&case.flood);
    let (ingest, idle, flooded, rate, front_wrong) = rt.block_on(front_round::<L>(
        events,
        case.blocks,
        queries,
        expected,
        flood,
    ));
    f.ingest = ingest;
    (f.front_p50, f.front_p99, _) = percentiles(idle);
    f.flood_p99 = percentiles(flooded).1;
    f.flood_rate = rate;
    wrong.count += front_wrong.count;
    wrong.checked += front_wrong.checked;
    wrong.examples.extend(front_wrong.examples);
    wrong.examples.truncate(3);
    f
}

async fn front_round<L: Library>(
    events: Vec<L::Event>,
    blocks: u64,
    queries: Arc<Vec<L::Query>>,
    expected: Arc<Vec<Scores>>,
    flood: Vec<L::Event>,
) -> (f64, Vec<Duration>, Vec<Duration>, f64, Wrong) {
    let front = L::front();
    // Bulk ingest: one producer task per shard/thread (workers split by parity).
    let (even, odd): (Vec<_>, Vec<_>) = events.into_iter().partition(|e| L::worker(e) % 2 == 0);
    let start = Instant::now();
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
    let ingest = blocks as f64 / start.elapsed().as_secs_f64();

    // Queries cycle until MIN_SAMPLES answers and MIN_PHASE have passed, so the
    // flood runs through the whole flooded phase at its rate.
    let ask = |front: L::Front| {
        let (queries, expected) = (queries.clone(), expected.clone());
        async move {
            let mut samples = Vec::with_capacity(MIN_SAMPLES);
            let mut wrong = Wrong::default();
            let began = Instant::now();
            let pairs = queries.iter().zip(expected.iter()).cycle();
            for (q, e) in pairs {
                if samples.len() >= MIN_SAMPLES && began.elapsed() >= MIN_PHASE {
                    break;
                }
                let start = Instant::now();
                let answer = front.find(q).await;
                samples.push(start.elapsed());
                wrong.check("front", e, &L::scores(answer));
            }
            (samples, wrong)
        }
    };
    let (idle, mut wrong) = tokio::spawn(ask(front.clone())).await.expect("queries");

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (front, stop, sent) = (front.clone(), stop.clone(), sent.clone());
        tokio::spawn(async move {
            let per_ms = (FLOOD_BLOCKS_PER_SEC / 1000 / 16) as usize;
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let started = Instant::now();
            let mut flood = flood.into_iter();
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                for _ in 0..per_ms {
                    let Some(e) = flood.next() else {
                        return started.elapsed();
                    };
                    front.apply(e).await;
                    sent.fetch_add(16, Ordering::Relaxed);
                }
            }
            started.elapsed()
        })
    };
    let (flooded, flood_wrong) = tokio::spawn(ask(front.clone())).await.expect("queries");
    stop.store(true, Ordering::Relaxed);
    let elapsed = flooder.await.expect("flooder");
    front.settle().await;
    front.stop();
    wrong.count += flood_wrong.count;
    wrong.checked += flood_wrong.checked;
    wrong.examples.extend(flood_wrong.examples);
    let rate = sent.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64();
    (ingest, idle, flooded, rate, wrong)
}

/// Median of each figure over rounds.
pub fn median(rounds: &[Figures]) -> Figures {
    let m = |get: fn(&Figures) -> f64| {
        let mut v: Vec<f64> = rounds.iter().map(get).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    Figures {
        apply: m(|f| f.apply),
        bare_p50: m(|f| f.bare_p50),
        ingest: m(|f| f.ingest),
        front_p50: m(|f| f.front_p50),
        front_p99: m(|f| f.front_p99),
        flood_p99: m(|f| f.flood_p99),
        flood_rate: m(|f| f.flood_rate),
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
