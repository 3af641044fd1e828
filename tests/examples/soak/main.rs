//! Soak: the release daemon under a steady KV event flood, routes and lifecycle for a
//! long time, recording its memory and route latency, for `docs/benchmarks.md`
//! (issue 14: "memory must be flat").
//!
//! ```sh
//! cargo build --release -p kv-router
//! cargo run --release -p integration-tests --example soak -- --minutes 30
//! ```
//!
//! It starts nats-server and etcd on free loopback ports and the release
//! `kv-router serve` (override with `KV_ROUTER_BIN`), registers `--workers` workers,
//! and then, for `--minutes`:
//! - **events**: `--events-per-s` single-block KV events over all workers, as engines
//!   with `--kv-blocks` blocks each publish them — a worker stores the next block of
//!   its current 16-block prompt (a new prompt from the root every 16 blocks) while it
//!   holds fewer than `--kv-blocks`, and evicts its oldest block otherwise, so the
//!   index churns at a steady size;
//! - **routes**: `--routes-per-s` route requests for prompts workers stored recently
//!   (prefix hits) and fresh ones (misses), each followed by `prefill_done` and, 50 ms
//!   later, `freed`, as a frontend sends them;
//! - every `--sample-s` it records the daemon's RSS (`/proc/PID/status`), its CPU, the
//!   route latency percentiles of the window (request sent → reply, client side),
//!   the events published and the index entries.
//!
//! The rows are printed, written to `OUT/soak.csv`, and drawn to `OUT/soak.png` (RSS
//! and route p99 against time). Load generator, daemon, nats-server and etcd share the
//! machine's cores.

use bench_workload::{latencies, quantile_ms};
use clap::Parser;
use integration_tests::child_daemon::ChildDaemon;
use kv_events::discovery::WorkerRegistration;
use kv_events::routing::{LifecycleEvent, LifecycleMessage, Prompt, RouteReply, RouteRequest};
use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    Namespace, StoredBlock, Subjects, WorkerId, decode, encode,
};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use testbed::{EtcdServer, NatsServer};

mod chart;

const BLOCK_SIZE: u32 = 16;
const PROMPT_BLOCKS: usize = 16;

/// A long run of events, routes and lifecycle against the release daemon.
#[derive(Parser, Debug)]
struct Args {
    /// Duration, in minutes.
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// KV events per second, over all workers (one block each).
    #[arg(long, default_value_t = 100_000)]
    events_per_s: u64,
    /// Route requests per second.
    #[arg(long, default_value_t = 200)]
    routes_per_s: u64,
    /// Workers (dp_size 1 each).
    #[arg(long, default_value_t = 16)]
    workers: u64,
    /// KV capacity of each worker, in blocks: the index holds about workers × this.
    #[arg(long, default_value_t = 50_000)]
    kv_blocks: usize,
    /// Seconds between samples.
    #[arg(long, default_value_t = 10)]
    sample_s: u64,
    /// Where the CSV and the chart go.
    #[arg(long, default_value = "target/soak")]
    out: PathBuf,
}

/// One engine as the event generator plays it.
struct Engine {
    id: WorkerId,
    next_event: u64,
    resident: VecDeque<(ExternalBlockHash, LocalBlockHash)>,
    /// The current prompt's last block, and its length so far.
    tail: Option<ExternalBlockHash>,
    len: usize,
    counter: u64,
}

impl Engine {
    /// The next event: store one block, or evict the oldest when full.
    fn next(
        &mut self,
        capacity: usize,
        recent: &Mutex<VecDeque<Vec<LocalBlockHash>>>,
    ) -> KvEventBatch {
        let data = if self.resident.len() >= capacity {
            let (old, _) = self
                .resident
                .pop_front()
                .unwrap_or((ExternalBlockHash(0), LocalBlockHash(0)));
            KvCacheEventData::Removed {
                group: None,
                block_hashes: vec![old],
                tier: kv_events::StorageTier::Gpu,
            }
        } else {
            if self.len == PROMPT_BLOCKS {
                // The prompt is complete: offer it to the router as a future hit.
                let prompt: Vec<LocalBlockHash> = self
                    .resident
                    .iter()
                    .rev()
                    .take(PROMPT_BLOCKS)
                    .rev()
                    .map(|b| b.1)
                    .collect();
                let mut recent = recent.lock().unwrap_or_else(|p| p.into_inner());
                recent.push_back(prompt);
                if recent.len() > 1024 {
                    recent.pop_front();
                }
                (self.tail, self.len) = (None, 0);
            }
            self.counter += 1;
            let local =
                LocalBlockHash(self.counter.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ self.id.0);
            let ext = ExternalBlockHash(local.0 ^ (self.id.0 << 48));
            let parent = self.tail;
            (self.tail, self.len) = (Some(ext), self.len + 1);
            self.resident.push_back((ext, local));
            KvCacheEventData::Stored {
                group: None,
                parent_hash: parent,
                blocks: vec![StoredBlock {
                    block_hash: ext,
                    tokens_hash: local,
                }],
                tier: kv_events::StorageTier::Gpu,
            }
        };
        let event_id = self.next_event;
        self.next_event += 1;
        KvEventBatch::new(
            self.id,
            vec![KvCacheEvent {
                event_id,
                dp_rank: DpRank(0),
                data,
            }],
        )
    }
}

/// Route latencies of the current window, in µs.
#[derive(Default)]
struct Window {
    latencies_us: Vec<u64>,
    errors: u64,
}

async fn one_route(
    nats: async_nats::Client,
    subjects: Arc<Subjects>,
    id: String,
    hashes: Vec<LocalBlockHash>,
    window: Arc<Mutex<Window>>,
) {
    let num_tokens = (hashes.len() as u64) * u64::from(BLOCK_SIZE);
    let request = RouteRequest::new(
        id.as_str(),
        Prompt::Blocks {
            block_hashes: hashes,
            num_tokens,
        },
    );
    let Ok(payload) = encode(&request) else {
        return;
    };
    let sent = Instant::now();
    let reply = nats.request(subjects.route(), payload.into()).await;
    let elapsed = sent.elapsed();
    let routed = matches!(
        reply
            .as_ref()
            .ok()
            .and_then(|r| decode::<RouteReply>(&r.payload).ok()),
        Some(RouteReply::Routed(_))
    );
    {
        let mut w = window.lock().unwrap_or_else(|p| p.into_inner());
        if routed {
            w.latencies_us
                .push(u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX));
        } else {
            w.errors += 1;
        }
    }
    if !routed {
        return;
    }
    for (event, after) in [
        (LifecycleEvent::PrefillDone, Duration::ZERO),
        (LifecycleEvent::Freed, Duration::from_millis(50)),
    ] {
        tokio::time::sleep(after).await;
        let msg = LifecycleMessage {
            request_id: id.clone().into(),
            event,
        };
        if let Ok(payload) = encode(&msg) {
            let _ = nats.publish(subjects.lifecycle(), payload.into()).await;
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out)?;
    let nats_server = NatsServer::start().await?;
    let etcd_server = EtcdServer::start().await?;
    let daemon = ChildDaemon::start(
        &nats_server.url(),
        &etcd_server.endpoint(),
        "soak",
        BLOCK_SIZE,
        &[],
    )
    .await?;
    let subjects = Arc::new(Subjects::new(Namespace::new("soak")?));
    let mut etcd = etcd_client::Client::connect([etcd_server.endpoint()], None).await?;
    // Leases outlive the run: nothing keeps them alive here, as engines would.
    let ttl = (args.minutes * 60.0) as i64 + 600;
    for w in 0..args.workers {
        let reg = WorkerRegistration {
            worker_id: WorkerId(w),
            dp_size: 1,
            block_size: BLOCK_SIZE,
            total_kv_blocks: args.kv_blocks as u64,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        };
        integration_tests::register_worker(&mut etcd, &subjects, &reg, ttl).await?;
    }
    daemon
        .wait_for_sum(&["kv_router_workers"], args.workers as f64)
        .await?;
    let nats = async_nats::connect(nats_server.url()).await?;

    let recent: Arc<Mutex<VecDeque<Vec<LocalBlockHash>>>> = Arc::default();
    let window: Arc<Mutex<Window>> = Arc::default();
    let mut engines: Vec<Engine> = (0..args.workers)
        .map(|w| Engine {
            id: WorkerId(w),
            next_event: 0,
            resident: VecDeque::new(),
            tail: None,
            len: 0,
            counter: 0,
        })
        .collect();
    let duration = Duration::from_secs_f64(args.minutes * 60.0);
    let events_per_tick = (args.events_per_s / 100).max(1);
    let routes_per_tick = (args.routes_per_s as f64) / 100.0;
    println!(
        "soak: {} workers × {} blocks, {} events/s, {} routes/s, {:.0} min, sampled every {} s",
        args.workers,
        args.kv_blocks,
        args.events_per_s,
        args.routes_per_s,
        args.minutes,
        args.sample_s
    );
    let header = "t_s,rss_mib,cpu_cores,events_per_s,routes,route_errors,route_p50_ms,route_p99_ms,index_blocks";
    println!("{header}");
    let mut csv = format!("{header}\n");
    let mut rows = Vec::new();

    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let (mut published, mut routes_due, mut route_n, mut next_engine) = (0u64, 0f64, 0u64, 0usize);
    let (mut last_sample, mut last_published, mut last_cpu) =
        (Instant::now(), 0u64, daemon.cpu_seconds()?);
    while start.elapsed() < duration {
        tick.tick().await;
        for _ in 0..events_per_tick {
            let count = engines.len();
            let batch = engines[next_engine].next(args.kv_blocks, &recent);
            next_engine = (next_engine + 1) % count;
            nats.publish(subjects.kv_events(batch.worker_id), encode(&batch)?.into())
                .await?;
            published += 1;
        }
        routes_due += routes_per_tick;
        while routes_due >= 1.0 {
            routes_due -= 1.0;
            route_n += 1;
            // Two in three prompts were stored recently (hits), one in three is new.
            let hashes = match (route_n % 3 != 0).then(|| {
                let recent = recent.lock().unwrap_or_else(|p| p.into_inner());
                recent.get(route_n as usize % recent.len().max(1)).cloned()
            }) {
                Some(Some(h)) => h,
                _ => (0..PROMPT_BLOCKS as u64)
                    .map(|i| LocalBlockHash(route_n << 20 | i))
                    .collect(),
            };
            tokio::spawn(one_route(
                nats.clone(),
                subjects.clone(),
                format!("soak-{route_n}"),
                hashes,
                window.clone(),
            ));
        }
        if last_sample.elapsed() >= Duration::from_secs(args.sample_s) {
            let secs = last_sample.elapsed().as_secs_f64();
            last_sample = Instant::now();
            let (lat, errors) = {
                let mut w = window.lock().unwrap_or_else(|p| p.into_inner());
                (
                    std::mem::take(&mut w.latencies_us),
                    std::mem::take(&mut w.errors),
                )
            };
            let histogram = latencies(lat.iter().map(|&us| Duration::from_micros(us)));
            let cpu = daemon.cpu_seconds()?;
            let row = chart::SoakSample {
                t_s: start.elapsed().as_secs_f64(),
                rss_mib: daemon.rss_bytes()? as f64 / f64::from(1u32 << 20),
                cpu_cores: (cpu - last_cpu) / secs,
                events_per_s: (published - last_published) as f64 / secs,
                routes: lat.len() as u64,
                route_errors: errors,
                route_p50_ms: quantile_ms(&histogram, 0.50),
                route_p99_ms: quantile_ms(&histogram, 0.99),
                index_blocks: daemon
                    .metric("kv_router_indexer_blocks")
                    .await
                    .unwrap_or(f64::NAN),
            };
            (last_cpu, last_published) = (cpu, published);
            let line = row.csv();
            println!("{line}");
            csv.push_str(&line);
            csv.push('\n');
            rows.push(row);
            std::fs::write(args.out.join("soak.csv"), &csv)?;
        }
    }
    chart::draw(&rows, &args.out.join("soak.png"))?;
    println!(
        "wrote {} and {}",
        args.out.join("soak.csv").display(),
        args.out.join("soak.png").display()
    );
    daemon.stop().await?;
    Ok(())
}
