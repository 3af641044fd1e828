//! The flood of events the front query p99 is measured under (issue 29, item 4).
//!
//! A flood is `Stored` then `Removed` batches of `batch_blocks` fresh blocks each (64
//! workers that no query matches), sent at [`RATE`] blocks per second in 1 ms ticks.
//! Two knobs, so that both ways a front can make a query wait are seen:
//! - the batch size: 16 blocks (a decode step's worth) or [`BIG_BATCH`] blocks (an
//!   engine publishing a long prefill or an eviction sweep at once), which is where a
//!   front that applies a batch under one write lock makes queries wait longest;
//! - the length: *short* floods start with the timed queries and stop with them, *long*
//!   ones run [`LONG_LEAD`] before, so a front whose queue or memory grows under the
//!   flood is measured in that state.
//!
//! The timed queries are asked in a closed loop (each right after the previous
//! answer) or, with `--pace open`, open-loop at [`OPEN_QUERY_RATE`] (latency from
//! when each was due). A closed loop asks one query during a writer's long hold and
//! hides the ones a router would have received meanwhile; an open loop counts them
//! all, which is the shape of a router's traffic. It needs a quiet host: on a loaded
//! one it measures the query task waiting for a core.

use bench_workload::flood_batches_of;
use kv_events::KvEventBatch;
use std::time::Duration;

/// Flood rate: Stored and Removed blocks per second.
pub const RATE: u64 = 1_000_000;

/// Blocks of one big flood batch.
pub const BIG_BATCH: usize = 4096;

/// How long a long flood runs before the timed queries start.
pub const LONG_LEAD: Duration = Duration::from_secs(2);

/// Blocks generated per flood: enough for the lead and a query phase of several
/// seconds at [`RATE`]; the flood stops early if they run out (its achieved rate shows).
const BLOCKS: usize = 6_000_000;

/// Timed queries per second under an open-loop flood (`--pace open`): well under what
/// either front answers, so that the queue stays empty unless a writer holds it up.
pub const OPEN_QUERY_RATE: u32 = 10_000;

/// How the timed queries under a flood are asked: `--pace closed|open`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// Each query right after the previous answer; latency from its start.
    Closed,
    /// One query due every 1 / [`OPEN_QUERY_RATE`] s; latency from when it was due.
    Open,
}

impl Pace {
    /// Parses `closed` or `open`.
    pub fn parse(s: &str) -> Pace {
        match s {
            "closed" => Pace::Closed,
            "open" => Pace::Open,
            other => panic!("--pace takes closed or open, not {other:?}"),
        }
    }

    /// The period between two due queries, for an open loop.
    pub fn period(self) -> Option<Duration> {
        match self {
            Pace::Closed => None,
            Pace::Open => Some(Duration::from_secs(1) / OPEN_QUERY_RATE),
        }
    }
}

/// Which floods to measure: `--flood short|long|both`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lengths {
    /// Only floods lasting the timed queries.
    Short,
    /// Only floods starting [`LONG_LEAD`] before the timed queries.
    Long,
    /// Both.
    Both,
}

impl Lengths {
    /// Parses `short`, `long` or `both`.
    pub fn parse(s: &str) -> Lengths {
        match s {
            "short" => Lengths::Short,
            "long" => Lengths::Long,
            "both" => Lengths::Both,
            other => panic!("--flood takes short, long or both, not {other:?}"),
        }
    }

    /// The floods to measure, in table order, their queries asked at `pace`.
    pub fn floods(self, pace: Pace) -> Vec<Flood> {
        let long = match self {
            Lengths::Short => vec![false],
            Lengths::Long => vec![true],
            Lengths::Both => vec![false, true],
        };
        long.into_iter()
            .flat_map(|long| {
                [16, BIG_BATCH].map(|batch_blocks| Flood {
                    long,
                    batch_blocks,
                    pace,
                })
            })
            .collect()
    }
}

/// One flood to measure under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flood {
    /// Starts [`LONG_LEAD`] before the timed queries.
    pub long: bool,
    /// Blocks per batch.
    pub batch_blocks: usize,
    /// How the timed queries are asked.
    pub pace: Pace,
}

impl Flood {
    /// Row title, e.g. `short flood, 16-block batches`.
    pub fn title(self) -> String {
        let pace = match self.pace {
            Pace::Closed => String::new(),
            Pace::Open => format!(", {}k queries/s open loop", OPEN_QUERY_RATE / 1000),
        };
        format!(
            "front query p99, {} 1M blocks/s flood, {}-block batches{pace}",
            if self.long { "long" } else { "short" },
            self.batch_blocks
        )
    }

    /// The flood's batches in sending order, each one event.
    pub fn batches(self) -> Vec<KvEventBatch> {
        flood_batches_of(BLOCKS / self.batch_blocks, self.batch_blocks)
    }
}
