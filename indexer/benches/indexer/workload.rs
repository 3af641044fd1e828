//! Deterministic prefix-caching workloads.

use kv_events::{
    DpRank, ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvEventBatch, LocalBlockHash,
    StoredBlock, WorkerId,
};

/// splitmix64: a tiny, good-enough PRNG for workload shapes.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Shape of a workload.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
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
}

impl Shape {
    /// The apply benchmark's shape: 16-block events, conversations of 8 events
    /// below one of 16 shared 16-block prefixes.
    pub fn apply(workers: u64, entries: u64) -> Self {
        Shape {
            workers,
            entries,
            prefixes: 16,
            prefix_len: 16,
            event_blocks: 16,
            conversation_events: 8,
        }
    }
}

/// A generated workload: event batches in publication order (workers interleaved),
/// and the conversations' block hashes for building queries.
pub struct Workload {
    pub batches: Vec<KvEventBatch>,
    /// Newly stored blocks over all batches (the expected entries).
    pub blocks: u64,
    /// Full local-hash paths of some conversations (prefix included), per worker.
    pub paths: Vec<(WorkerId, Vec<LocalBlockHash>)>,
}

/// Engine hash of a block: unique per (worker, sequence number).
fn ext(worker: u64, n: u64) -> ExternalBlockHash {
    ExternalBlockHash(worker << 40 ^ n)
}

/// Builds the workload of `shape`, with event ids counted per worker from 0.
pub fn build(shape: Shape, seed: u64) -> Workload {
    let mut rng = Rng::new(seed);
    let prefix_hashes: Vec<Vec<LocalBlockHash>> = (0..shape.prefixes)
        .map(|_| {
            (0..shape.prefix_len)
                .map(|_| LocalBlockHash(rng.next()))
                .collect()
        })
        .collect();
    let mut batches = Vec::new();
    let mut paths = Vec::new();
    let per_worker = shape.entries / shape.workers;
    let mut blocks = 0;
    // Per worker: next event id, next engine-hash number, current conversation.
    struct State {
        next_event: u64,
        next_ext: u64,
        stored: u64,
        parent: Option<ExternalBlockHash>,
        path: Vec<LocalBlockHash>,
        events_left: u64,
        prefix_exts: Vec<Vec<ExternalBlockHash>>,
    }
    let mut states: Vec<State> = (0..shape.workers)
        .map(|_| State {
            next_event: 0,
            next_ext: 0,
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
            let exts: Vec<ExternalBlockHash> = prefix
                .iter()
                .map(|_| {
                    st.next_ext += 1;
                    ext(w, st.next_ext)
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
                parent_hash: None,
                blocks: stored,
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
            let chain: Vec<StoredBlock> = (0..shape.event_blocks)
                .map(|_| {
                    st.next_ext += 1;
                    let l = LocalBlockHash(rng.next());
                    st.path.push(l);
                    StoredBlock {
                        block_hash: ext(w, st.next_ext),
                        tokens_hash: l,
                    }
                })
                .collect();
            let parent_hash = st.parent;
            st.parent = chain.last().map(|b| b.block_hash);
            let data = KvCacheEventData::Stored {
                parent_hash,
                blocks: chain,
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
