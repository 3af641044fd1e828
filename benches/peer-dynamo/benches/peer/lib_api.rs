//! The one shape both libraries are driven through, so every figure is measured by the
//! same code: a bare tree (built and queried on one thread) and a production front
//! (shared by tasks on a 2-thread runtime).

use kv_events::{KvEventBatch, LocalBlockHash, WorkerId};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Per-worker leading-block counts of one answer, zero counts left out.
pub type Scores = BTreeMap<WorkerId, u32>;

/// One library under test.
pub trait Library: 'static {
    /// Display name.
    const NAME: &'static str;
    /// An event in the library's own types (converted before timing starts).
    type Event: Clone + Send + 'static;
    /// A query in the library's own types.
    type Query: Send + Sync + 'static;
    /// The single-threaded core.
    type Tree;
    /// A query answer before conversion to [`Scores`] (converted after timing).
    type Answer;
    /// The production front.
    type Front: Front<Event = Self::Event, Query = Self::Query, Answer = Self::Answer>;

    /// Converts our batches (one or more events each).
    fn events(batches: &[KvEventBatch]) -> Vec<Self::Event>;
    /// The worker that published `event` (fronts shard by it).
    fn worker(event: &Self::Event) -> u64;
    /// Converts a query.
    fn query(hashes: &Arc<[LocalBlockHash]>) -> Self::Query;
    /// Builds a bare tree from `events` on this thread; the time covers applying only.
    fn build(events: Vec<Self::Event>) -> (Self::Tree, Took);
    /// Queries the bare tree.
    fn find(tree: &Self::Tree, query: &Self::Query) -> Self::Answer;
    /// Converts an answer.
    fn scores(answer: Self::Answer) -> Scores;
    /// Starts the production front (2 shards / 2 threads) on the current runtime.
    fn front() -> Self::Front;
    /// Bytes the bare tree occupies, as the process's resident set grows, after
    /// applying `events` (fed so that queues stay small).
    fn bare_rss(events: Vec<Self::Event>) -> u64;
}

/// A production front: events and queries from any task.
pub trait Front: Clone + Send + Sync + 'static {
    /// Event type.
    type Event: Send + 'static;
    /// Query type.
    type Query: Send + Sync + 'static;
    /// Answer type.
    type Answer: Send + 'static;
    /// Hands one event to the front (applied, or enqueued for its worker's thread).
    fn apply(&self, event: Self::Event) -> impl Future<Output = ()> + Send;
    /// Waits until everything handed over is applied.
    fn settle(&self) -> impl Future<Output = ()> + Send;
    /// Asks the front.
    fn find(&self, query: &Self::Query) -> impl Future<Output = Self::Answer> + Send;
    /// Stops the front.
    fn stop(self);
}

/// How long one timed section took: wall-clock time, and the calling thread's time on
/// a CPU (`None` where `/proc/thread-self/schedstat` is missing). On a shared host the
/// CPU time leaves out the time the thread waited for a core.
#[derive(Debug, Clone, Copy)]
pub struct Took {
    /// Wall-clock time.
    pub wall: Duration,
    /// Time the thread ran on a CPU.
    pub cpu: Option<Duration>,
}

/// Starts timing a section on the calling thread.
pub struct Timer {
    wall: Instant,
    cpu: Option<Duration>,
}

impl Timer {
    /// Starts now.
    pub fn start() -> Self {
        Timer {
            cpu: thread_cpu(),
            wall: Instant::now(),
        }
    }

    /// The time since [`Timer::start`]; call it on the same thread.
    pub fn stop(&self) -> Took {
        let wall = self.wall.elapsed();
        let cpu = thread_cpu()
            .zip(self.cpu)
            .map(|(now, then)| now.saturating_sub(then));
        Took { wall, cpu }
    }
}

/// The calling thread's time on a CPU so far: the first field of
/// `/proc/thread-self/schedstat`, in ns.
fn thread_cpu() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}
