//! Deterministic prefix-caching workloads.
//!
//! Every worker first stores the shared prefixes (one `Stored` event each, no
//! parent), then conversations: a conversation picks a shared prefix and appends
//! `conversation_events` chained `Stored` events of `event_blocks` fresh blocks below
//! it. Workers are interleaved one event at a time, as a router sees them. Local block
//! hashes come from a splitmix64 stream; engine block hashes are chained
//! ([`EngineHashes`]). Building costs about 16 bytes per block (plus the event
//! vectors); it happens before any timing starts.

use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    StoredBlock, WorkerId,
};

/// splitmix64: a tiny, good-enough PRNG for workload shapes.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A stream starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// `n` random block hashes.
    pub fn block_hashes(&mut self, n: u64) -> Vec<LocalBlockHash> {
        (0..n).map(|_| LocalBlockHash(self.next_u64())).collect()
    }

    /// A number in `0..n` (`0` when `n` is 0); slightly biased, fine for shapes.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// How engines name their blocks (the `ExternalBlockHash` of a `Stored` block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineHashes {
    /// Chained over the content, as vLLM and SGLang publish them without a salt:
    /// `hash(parent's engine hash, local hash)`, so identical prefixes get identical
    /// engine hashes on every worker.
    Chained,
    /// Chained and salted per worker (a per-worker cache salt, or engines hashing
    /// differently): identical prefixes get different engine hashes on every worker.
    Salted,
}

impl EngineHashes {
    /// Engine hash of a block with `local` content below `parent` on `worker`.
    pub fn block(
        self,
        worker: WorkerId,
        parent: Option<ExternalBlockHash>,
        local: LocalBlockHash,
    ) -> ExternalBlockHash {
        let salt = match self {
            EngineHashes::Chained => 0,
            EngineHashes::Salted => mix(worker.0 ^ 0x5A17_5A17),
        };
        let parent = parent.map_or(0x0123_4567_89AB_CDEF, |p| p.0);
        ExternalBlockHash(mix(parent ^ mix(local.0 ^ salt)))
    }
}

/// splitmix64's finaliser: a bijective 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Shape of a workload: workers, entries and prefix structure.
#[derive(Debug, Clone, Copy)]
pub struct WorkloadShape {
    /// Workers (ids `0..workers`, dp rank 0 each).
    pub workers: u64,
    /// (worker, block) entries to reach.
    pub entries: u64,
    /// Shared prefixes ("system prompts") every worker holds.
    pub prefixes: u64,
    /// Blocks per shared prefix.
    pub prefix_len: u64,
    /// Blocks per `Stored` event.
    pub event_blocks: u64,
    /// Events per conversation before a new one starts.
    pub conversation_events: u64,
    /// How engine hashes are formed.
    pub hashes: EngineHashes,
}

impl WorkloadShape {
    /// The apply benchmark's shape: 16-block events, conversations of 8 events
    /// below one of 16 shared 16-block prefixes.
    pub fn apply(workers: u64, entries: u64) -> Self {
        WorkloadShape {
            workers,
            entries,
            prefixes: 16,
            prefix_len: 16,
            event_blocks: 16,
            conversation_events: 8,
            hashes: EngineHashes::Salted,
        }
    }
}

/// A generated workload: event batches in publication order (workers interleaved),
/// and the conversations' block hashes for building queries.
pub struct Workload {
    /// One event per batch, in the order a router receives them.
    pub batches: Vec<KvEventBatch>,
    /// Newly stored blocks over all batches (the expected entries).
    pub blocks: u64,
    /// Full local-hash paths of some conversations (prefix included), per worker.
    pub paths: Vec<(WorkerId, Vec<LocalBlockHash>)>,
}

/// Builds the workload of `shape`, with event ids counted per worker from 0.
pub fn build(shape: WorkloadShape, seed: u64) -> Workload {
    let mut rng = Rng::new(seed);
    let prefix_hashes: Vec<Vec<LocalBlockHash>> = (0..shape.prefixes)
        .map(|_| rng.block_hashes(shape.prefix_len))
        .collect();
    let mut batches = Vec::new();
    let mut paths = Vec::new();
    let per_worker = shape.entries / shape.workers;
    let mut blocks = 0;
    // Per worker: next event id, current conversation.
    struct State {
        next_event: u64,
        stored: u64,
        parent: Option<ExternalBlockHash>,
        path: Vec<LocalBlockHash>,
        events_left: u64,
        prefix_exts: Vec<Vec<ExternalBlockHash>>,
    }
    let mut states: Vec<State> = (0..shape.workers)
        .map(|_| State {
            next_event: 0,
            stored: 0,
            parent: None,
            path: Vec::new(),
            events_left: 0,
            prefix_exts: Vec::new(),
        })
        .collect();
    let event = |id: &mut u64, data: KvCacheEventData| {
        let e = KvCacheEvent {
            event_id: *id,
            dp_rank: DpRank(0),
            data,
        };
        *id += 1;
        e
    };
    // Every worker first stores the shared prefixes.
    for (w, st) in states.iter_mut().enumerate() {
        let w = w as u64;
        for prefix in &prefix_hashes {
            let mut parent = None;
            let exts: Vec<ExternalBlockHash> = prefix
                .iter()
                .map(|l| {
                    let e = shape.hashes.block(WorkerId(w), parent, *l);
                    parent = Some(e);
                    e
                })
                .collect();
            let stored = prefix
                .iter()
                .zip(&exts)
                .map(|(l, e)| StoredBlock {
                    block_hash: *e,
                    tokens_hash: *l,
                })
                .collect();
            let data = KvCacheEventData::Stored {
                group: None,
                parent_hash: None,
                blocks: stored,
                tier: kv_events::StorageTier::Gpu,
            };
            batches.push(KvEventBatch {
                worker_id: WorkerId(w),
                epoch: 1,
                events: vec![event(&mut st.next_event, data)],
            });
            st.stored += shape.prefix_len;
            blocks += shape.prefix_len;
            st.prefix_exts.push(exts);
        }
    }
    loop {
        let mut progressed = false;
        for (w, st) in states.iter_mut().enumerate() {
            let w = w as u64;
            if st.stored >= per_worker {
                continue;
            }
            progressed = true;
            if st.events_left == 0 {
                if st.path.len() as u64 > shape.prefix_len && paths.len() < 100_000 {
                    paths.push((WorkerId(w), std::mem::take(&mut st.path)));
                }
                let p = rng.below(shape.prefixes) as usize;
                st.parent = st.prefix_exts[p].last().copied();
                st.path = prefix_hashes[p].clone();
                st.events_left = shape.conversation_events;
            }
            let parent_hash = st.parent;
            let chain: Vec<StoredBlock> = (0..shape.event_blocks)
                .map(|_| {
                    let l = LocalBlockHash(rng.next_u64());
                    st.path.push(l);
                    let block_hash = shape.hashes.block(WorkerId(w), st.parent, l);
                    st.parent = Some(block_hash);
                    StoredBlock {
                        block_hash,
                        tokens_hash: l,
                    }
                })
                .collect();
            let data = KvCacheEventData::Stored {
                group: None,
                parent_hash,
                blocks: chain,
                tier: kv_events::StorageTier::Gpu,
            };
            batches.push(KvEventBatch {
                worker_id: WorkerId(w),
                epoch: 1,
                events: vec![event(&mut st.next_event, data)],
            });
            st.stored += shape.event_blocks;
            blocks += shape.event_blocks;
            st.events_left -= 1;
        }
        if !progressed {
            break;
        }
    }
    for (w, st) in states.into_iter().enumerate() {
        if st.path.len() as u64 > shape.prefix_len {
            paths.push((WorkerId(w as u64), st.path));
        }
    }
    Workload {
        batches,
        blocks,
        paths,
    }
}

/// Flood batches for the latency benches: `n` one-event batches alternating `Stored`
/// and `Removed` of the same fresh 16-block chain (random local hashes, no parent),
/// spread over the 64 workers `1000..1064`, so the index size stays put while writes
/// keep coming and no flood block ever matches a workload query.
pub fn flood_batches(n: usize) -> Vec<KvEventBatch> {
    flood_batches_of(n, 16)
}

/// [`flood_batches`] with `batch_blocks` blocks per event instead of 16.
pub fn flood_batches_of(n: usize, batch_blocks: usize) -> Vec<KvEventBatch> {
    let mut rng = Rng::new(99);
    let mut next_id = [0u64; 64];
    (0..n)
        .map(|i| {
            let k = i / 2 % 64;
            let worker = WorkerId(1000 + k as u64);
            let base = (i / 2 * batch_blocks) as u64;
            let data = if i % 2 == 0 {
                KvCacheEventData::Stored {
                    group: None,
                    parent_hash: None,
                    blocks: (0..batch_blocks as u64)
                        .map(|b| StoredBlock {
                            block_hash: ExternalBlockHash(base + b),
                            tokens_hash: LocalBlockHash(rng.next_u64()),
                        })
                        .collect(),
                    tier: kv_events::StorageTier::Gpu,
                }
            } else {
                KvCacheEventData::Removed {
                    group: None,
                    block_hashes: (0..batch_blocks as u64)
                        .map(|b| ExternalBlockHash(base + b))
                        .collect(),
                    tier: kv_events::StorageTier::Gpu,
                }
            };
            let event_id = next_id[k];
            next_id[k] += 1;
            KvEventBatch {
                worker_id: worker,
                epoch: 1,
                events: vec![KvCacheEvent {
                    event_id,
                    dp_rank: DpRank(0),
                    data,
                }],
            }
        })
        .collect()
}
