//! One adapter over every indexer implementation, for the contract suites. The
//! running front is driven only through the [`IndexerApi`] trait: each async
//! subject is an [`Indexer`] with 1 or 3 shards.

#![allow(dead_code)] // each test binary uses a different subset

use crate::common::{Numbering, q};
use indexer::{
    Indexer, IndexerApi, IndexerConfig, IndexerReport, OrderedIndex, Pruning, RadixTree,
    RecoveryNeed, ShardSettings,
};
use kv_events::recovery::{IndexSnapshot, RecoveryReply};
use kv_events::{KvEventBatch, LocalBlockHash, WorkerId, WorkerRank};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// One implementation under test.
pub enum Kind {
    /// The bare tree: no ordering, no recovery.
    Tree(RadixTree),
    /// The synchronous ordered index.
    Ordered(OrderedIndex),
    /// The running front, driven through [`IndexerApi`], with its recovery needs.
    Async(Indexer, mpsc::UnboundedReceiver<RecoveryNeed>),
}

/// An implementation plus a publisher-side event numbering.
pub struct Subject {
    /// For assertion messages.
    pub name: &'static str,
    pub kind: Kind,
    config: IndexerConfig,
    numbering: Numbering,
    /// Needs returned by the synchronous index, not yet taken.
    needs: Vec<RecoveryNeed>,
}

fn config(num_shards: usize, pruning: Pruning) -> IndexerConfig {
    IndexerConfig {
        num_shards,
        pruning,
        ..IndexerConfig::default()
    }
}

impl Subject {
    fn build(name: &'static str, config: IndexerConfig, kind: Option<Kind>) -> Self {
        let kind = kind.unwrap_or_else(|| {
            let indexer =
                Indexer::spawn(config.clone(), CancellationToken::new()).expect("valid config");
            let needs = indexer.take_recovery_needs().expect("first take");
            Kind::Async(indexer, needs)
        });
        Subject {
            name,
            kind,
            config,
            numbering: Numbering::default(),
            needs: Vec::new(),
        }
    }

    /// A fresh subject of each kind, with no memory bound.
    pub fn all() -> Vec<Subject> {
        let mut out = vec![Subject::build(
            "tree",
            config(1, Pruning::Unbounded),
            Some(Kind::Tree(RadixTree::new())),
        )];
        out.extend(Self::ordered(Pruning::Unbounded));
        out
    }

    /// A fresh subject of each kind with event ordering, bounded by `pruning`.
    pub fn ordered(pruning: Pruning) -> Vec<Subject> {
        let settings = ShardSettings {
            pruning,
            ..ShardSettings::default()
        };
        let ordered = OrderedIndex::new(settings, Arc::default());
        vec![
            Subject::build("ordered", config(1, pruning), Some(Kind::Ordered(ordered))),
            Subject::build("inline-1", config(1, pruning), None),
            Subject::build("inline-3", config(3, pruning), None),
        ]
    }

    /// A fresh, empty subject of the same kind and configuration.
    pub fn empty_like(&self) -> Subject {
        let kind = match &self.kind {
            Kind::Tree(t) => Some(Kind::Tree(RadixTree::with_pruning(t.pruning()))),
            Kind::Ordered(_) => Some(Kind::Ordered(OrderedIndex::new(
                self.config.shard_settings(),
                Arc::default(),
            ))),
            Kind::Async(..) => None,
        };
        Subject::build(self.name, self.config.clone(), kind)
    }

    /// Numbers the batch's events as its publisher would, then applies it.
    pub async fn apply(&mut self, batch: KvEventBatch) {
        let batch = self.numbering.number(batch);
        self.apply_raw(batch).await;
    }

    /// Applies a batch with its `event_id`s as given; refused events are skipped.
    pub async fn apply_raw(&mut self, batch: KvEventBatch) {
        match &mut self.kind {
            Kind::Tree(tree) => {
                for event in &batch.events {
                    let _ = tree.apply_event(batch.worker_id, event);
                }
            }
            Kind::Ordered(index) => self.needs.extend(index.apply_batch(&batch)),
            Kind::Async(indexer, _) => indexer.apply(batch).await.expect("running"),
        }
    }

    /// Recovery needs emitted so far (after every earlier call was applied).
    pub async fn take_needs(&mut self) -> Vec<RecoveryNeed> {
        match &mut self.kind {
            Kind::Tree(_) => Vec::new(),
            Kind::Ordered(_) => std::mem::take(&mut self.needs),
            Kind::Async(indexer, rx) => {
                // Stats are served after every queued event: the needs are sent.
                indexer.stats().await.expect("running");
                let mut out = Vec::new();
                while let Ok(need) = rx.try_recv() {
                    out.push(need);
                }
                out
            }
        }
    }

    /// Hands a recovery reply back.
    pub async fn recovered(&mut self, need: &RecoveryNeed, reply: RecoveryReply) {
        match &mut self.kind {
            Kind::Tree(_) => {}
            Kind::Ordered(index) => {
                let more = index.apply_recovered(need.rank, need.token, reply);
                self.needs.extend(more);
            }
            Kind::Async(indexer, _) => indexer
                .apply_recovered(need.rank, need.token, reply)
                .await
                .expect("running"),
        }
    }

    /// Gives up every pending recovery (applying buffered events past holes).
    pub async fn abandon_all_recoveries(&mut self) {
        loop {
            let needs = self.take_needs().await;
            if needs.is_empty() {
                return;
            }
            for need in needs {
                match &mut self.kind {
                    Kind::Tree(_) => {}
                    Kind::Ordered(index) => {
                        let more = index.abandon_recovery(need.rank, need.token);
                        self.needs.extend(more);
                    }
                    Kind::Async(indexer, _) => indexer
                        .abandon_recovery(need.rank, need.token)
                        .await
                        .expect("running"),
                }
            }
        }
    }

    /// Asks for a rank's full state.
    pub async fn resync(&mut self, rank: WorkerRank) {
        match &mut self.kind {
            Kind::Tree(_) => {}
            Kind::Ordered(index) => self.needs.extend(index.resync(rank)),
            Kind::Async(indexer, _) => indexer.resync(rank).await.expect("running"),
        }
    }

    pub async fn remove_worker(&mut self, worker: u64) {
        match &mut self.kind {
            Kind::Tree(tree) => {
                tree.remove_worker(WorkerId(worker));
            }
            Kind::Ordered(index) => {
                index.remove_worker(WorkerId(worker));
            }
            Kind::Async(indexer, _) => indexer
                .remove_worker(WorkerId(worker))
                .await
                .expect("running"),
        }
    }

    /// Indexes a routing decision for `ttl` on the Tokio clock.
    pub async fn insert_routed(&mut self, rank: WorkerRank, hashes: &[u64], ttl: Duration) {
        let hashes: Vec<LocalBlockHash> = q(hashes);
        match &mut self.kind {
            Kind::Tree(_) => {}
            Kind::Ordered(index) => {
                let at = tokio::time::Instant::now().into_std() + ttl;
                index.insert_routed(rank, &hashes, at);
            }
            Kind::Async(indexer, _) => indexer
                .insert_routed(rank, hashes, ttl)
                .await
                .expect("running"),
        }
    }

    /// Expires what is due on the Tokio clock: explicitly for the synchronous index;
    /// the backends' own timers do it (this yields until they did).
    pub async fn expire_due(&mut self, expected_blocks: usize) {
        match &mut self.kind {
            Kind::Tree(_) => {}
            Kind::Ordered(index) => {
                index.expire(tokio::time::Instant::now().into_std());
            }
            Kind::Async(indexer, _) => {
                // Paused clock: the timers fired when time advanced; their tasks run
                // as soon as this task yields. No wall-clock wait is involved.
                for _ in 0..100 {
                    let report = indexer.report().await.expect("running");
                    if report.approximate_blocks == expected_blocks {
                        return;
                    }
                    tokio::task::yield_now().await;
                }
            }
        }
    }

    pub async fn find(&self, hashes: &[u64]) -> Vec<(WorkerRank, u32)> {
        let scores = match &self.kind {
            Kind::Tree(tree) => tree.find_matches(&q(hashes)),
            Kind::Ordered(index) => index.find_matches(&q(hashes)),
            Kind::Async(indexer, _) => indexer.find_matches(q(hashes)).await.expect("running"),
        };
        scores.sorted()
    }

    /// The any-tier scores: ranks whose overlap on any storage tier exceeds their
    /// GPU overlap, sorted.
    pub async fn find_any_tier(&self, hashes: &[u64]) -> Vec<(WorkerRank, u32)> {
        let scores = match &self.kind {
            Kind::Tree(tree) => tree.find_matches(&q(hashes)),
            Kind::Ordered(index) => index.find_matches(&q(hashes)),
            Kind::Async(indexer, _) => indexer.find_matches(q(hashes)).await.expect("running"),
        };
        let mut pairs: Vec<_> = scores.any_tier.into_iter().collect();
        pairs.sort_unstable();
        pairs
    }

    pub async fn dump(&self) -> Vec<KvEventBatch> {
        match &self.kind {
            Kind::Tree(tree) => tree.dump(),
            Kind::Ordered(index) => index.dump(),
            Kind::Async(indexer, _) => indexer.dump().await.expect("running"),
        }
    }

    pub async fn snapshot(&self) -> IndexSnapshot {
        match &self.kind {
            Kind::Tree(tree) => IndexSnapshot {
                batches: tree.dump(),
                cursors: Vec::new(),
            },
            Kind::Ordered(index) => index.snapshot(),
            Kind::Async(indexer, _) => indexer.snapshot().await.expect("running"),
        }
    }

    pub async fn restore(&mut self, snapshot: IndexSnapshot) {
        match &mut self.kind {
            Kind::Tree(_) => {}
            Kind::Ordered(index) => {
                index.restore(&snapshot);
            }
            Kind::Async(indexer, _) => indexer.restore(snapshot).await.expect("running"),
        }
    }

    pub async fn report(&self) -> IndexerReport {
        match &self.kind {
            Kind::Tree(tree) => IndexerReport {
                stats: tree.stats(),
                blocks_per_rank: tree.blocks_per_rank(),
                ..IndexerReport::default()
            },
            Kind::Ordered(index) => index.report(),
            Kind::Async(indexer, _) => indexer.report().await.expect("running"),
        }
    }

    /// (entries, ranks): the stats every implementation agrees on.
    pub async fn entries_and_ranks(&self) -> (usize, usize) {
        let stats = self.report().await.stats;
        (stats.entries, stats.ranks)
    }
}
