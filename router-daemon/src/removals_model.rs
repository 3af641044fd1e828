//! The reference model of one rank's removals memory, for the differential test in
//! `removals_tests.rs`: every removal passes through the ring one at a time and
//! leaves its maps as it leaves the ring (no bulk path for large removals). The
//! production [`super::RankRemovals`] must answer every query as this model does.
//! The rule for one removal leaving the ring is the production one on purpose (the
//! `duplicates` tool pairs the two): what the test checks is that the bulk path ends
//! where passing each removal through the ring would.

use super::{Removal, RemovalsAnswer, RemovalsQuery};
use kv_events::routing::EventPosition;
use kv_events::{ExternalBlockHash, LocalBlockHash};
use std::collections::{HashMap, VecDeque};

#[derive(Debug)]
pub(super) struct Model {
    per_rank: usize,
    pub(super) first: EventPosition,
    pub(super) forgotten: Option<EventPosition>,
    pub(super) cleared: Option<EventPosition>,
    /// Removals oldest first, each with its number.
    pub(super) ring: VecDeque<(u64, Removal)>,
    next: u64,
    /// Live engine hashes: each with its newest removal's number, until stored again.
    pub(super) by_external: HashMap<ExternalBlockHash, u64>,
    pub(super) restored: HashMap<LocalBlockHash, EventPosition>,
}

impl Model {
    pub(super) fn new(per_rank: usize, first: EventPosition) -> Self {
        Self {
            per_rank,
            first,
            forgotten: None,
            cleared: None,
            ring: VecDeque::new(),
            next: 0,
            by_external: HashMap::new(),
            restored: HashMap::new(),
        }
    }

    pub(super) fn remove(&mut self, at: EventPosition, external: ExternalBlockHash) {
        self.ring.push_back((
            self.next,
            Removal {
                at,
                external,
                local: None,
            },
        ));
        self.by_external.insert(external, self.next);
        self.next += 1;
        if self.ring.len() > self.per_rank
            && let Some((number, old)) = self.ring.pop_front()
        {
            self.forgotten = self.forgotten.max(Some(old.at));
            if self.by_external.get(&old.external) == Some(&number) {
                self.by_external.remove(&old.external);
            }
            if let Some(local) = old.local
                && self.restored.get(&local) == Some(&old.at)
            {
                self.restored.remove(&local);
            }
        }
    }

    pub(super) fn store(&mut self, external: ExternalBlockHash, local: LocalBlockHash) {
        let Some(number) = self.by_external.remove(&external) else {
            return;
        };
        if let Some((_, removal)) = self.ring.iter_mut().find(|(n, _)| *n == number) {
            removal.local = Some(local);
            self.restored.insert(local, removal.at);
        }
    }

    pub(super) fn answer(&self, query: &RemovalsQuery) -> RemovalsAnswer {
        let after = query.after;
        RemovalsAnswer {
            removed: (query.block_hashes.iter().zip(0u32..))
                .filter(|(hash, _)| self.restored.get(hash).is_some_and(|&at| at > after))
                .map(|(_, i)| i)
                .collect(),
            complete: self.first <= after && self.forgotten.is_none_or(|f| f <= after),
            cleared: self.cleared.is_some_and(|c| c > after),
        }
    }
}
