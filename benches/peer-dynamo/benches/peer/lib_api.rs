//! The one shape both libraries are driven through, so every figure is measured by the
//! same code: a bare tree (built and queried on one thread) and a production front
//! (shared by tasks on a 2-thread runtime).

use kv_events::{KvEventBatch, LocalBlockHash, WorkerId};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

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
    fn build(events: Vec<Self::Event>) -> (Self::Tree, Duration);
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
