//! The blocks of the prompts in flight on one rank, as a trie of chained block ids.
//!
//! A chained id names a block *and its whole prefix* ([`super::chain_block_ids`]), so
//! the ids held by a rank's in-flight requests form a trie: an id is held only if
//! its parent (the id before it in its prompt) is. Each node counts the requests
//! whose prompt ends there and its distinct children; a node with neither is
//! removed. So:
//!
//! - the rank's distinct decode blocks are the number of nodes;
//! - a prompt's leading blocks held in flight are found by binary search over its
//!   ids (held ids form a prefix of them), after one look-up of its first id — most
//!   prompts share nothing with a rank's in-flight requests;
//! - booking a prompt inserts only the ids past the part already held, plus one
//!   count on the node where it branches or ends; freeing it removes only the ids
//!   no other request holds, walking back from its last id.
//!
//! Why: a refcount per block made every booking and free touch every block of the
//! prompt (64 hash-map steps each at 64 blocks, 7.5% of a route's CPU in the
//! daemon; 1,000 at a 16k-token prompt), while KV-aware routing sends prompts that
//! share a prefix to the same rank, where that prefix is then held by many requests
//! at once. Now the shared part costs O(log blocks) per booking and nothing per free.
//!
//! Ids are 64-bit mixes of the hashes, so two different prefixes share an id with
//! probability 2^-64 per pair; a prompt crafted to repeat an id inside its own chain
//! (the hashes come from the network) cannot panic anything here — counts saturate
//! and look-ups that miss stop the walk — but may leave a node behind until the
//! rank's last request leaves and its aggregate goes whole.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

/// Hash maps keyed by chained block ids: already well-mixed 64-bit values, hashed on
/// every booking, free and candidate check, so the hasher is foldhash's fast one
/// (seeded per process) rather than SipHash, which dominated the scheduler's profile.
pub(super) type BlockIdMap<V> = HashMap<u64, V, foldhash::fast::RandomState>;

/// One held chained block id.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Node {
    /// In-flight requests whose prompt's last hashed block is this one.
    ends: u32,
    /// Distinct next blocks held (children in the trie).
    children: u32,
}

/// The chained block ids held by one rank's in-flight requests.
#[derive(Debug, Clone, Default)]
pub(crate) struct InFlightBlocks {
    nodes: BlockIdMap<Node>,
}

impl InFlightBlocks {
    /// Distinct blocks held.
    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Ids the map can hold without growing.
    pub(crate) fn capacity(&self) -> usize {
        self.nodes.capacity()
    }

    /// Forgets every block, keeping the map's capacity.
    pub(crate) fn clear(&mut self) {
        self.nodes.clear();
    }

    /// How many leading ids of `ids` (one prompt's chained ids) are held.
    pub(crate) fn held(&self, ids: &[u64]) -> usize {
        match ids.first() {
            Some(first) if self.nodes.contains_key(first) => {
                1 + ids[1..].partition_point(|id| self.nodes.contains_key(id))
            }
            _ => 0,
        }
    }

    /// Holds one more request's prompt, of chained ids `ids`.
    pub(crate) fn add(&mut self, ids: &[u64]) {
        let Some(&last) = ids.last() else {
            return;
        };
        let held = self.held(ids);
        if held < ids.len() {
            // The prompt branches off after its held part: a new child there.
            if let Some(parent) = held
                .checked_sub(1)
                .and_then(|p| self.nodes.get_mut(&ids[p]))
            {
                parent.children = parent.children.saturating_add(1);
            }
            if self.nodes.is_empty() {
                // A rank's first booking: one allocation instead of growing step by
                // step.
                self.nodes.reserve(ids.len());
            }
            for &id in &ids[held..ids.len() - 1] {
                let node = self.nodes.entry(id).or_default();
                node.children = node.children.saturating_add(1);
            }
        }
        let end = self.nodes.entry(last).or_default();
        end.ends = end.ends.saturating_add(1);
    }

    /// Releases one request's prompt, of chained ids `ids` (as given to
    /// [`Self::add`]): removes, from its last id back, every id no other request
    /// holds.
    pub(crate) fn remove(&mut self, ids: &[u64]) {
        let Some((&last, _)) = ids.split_last() else {
            return;
        };
        let Entry::Occupied(mut node) = self.nodes.entry(last) else {
            return;
        };
        node.get_mut().ends = node.get().ends.saturating_sub(1);
        let mut at = ids.len() - 1;
        while *node.get() == Node::default() {
            node.remove();
            let Some(parent) = at.checked_sub(1) else {
                return;
            };
            at = parent;
            let Entry::Occupied(next) = self.nodes.entry(ids[at]) else {
                return;
            };
            node = next;
            node.get_mut().children = node.get().children.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_prefix_is_held_once_and_released_with_its_last_holder() {
        let mut held = InFlightBlocks::default();
        // a = 1,2,3; b = 1,2,7; c = 1,2 (a prefix of both); ids stand for chained ids.
        held.add(&[1, 2, 3]);
        assert_eq!((held.len(), held.held(&[1, 2, 7])), (3, 2));
        held.add(&[1, 2, 7]);
        held.add(&[1, 2]);
        assert_eq!(held.len(), 4);
        assert_eq!(held.held(&[1, 2, 3, 4]), 3);
        assert_eq!(held.held(&[9, 2, 3]), 0);
        held.remove(&[1, 2, 3]);
        assert_eq!(held.len(), 3, "2 still has b below it and c ending on it");
        held.remove(&[1, 2]);
        assert_eq!(held.len(), 3, "2 still has b below it");
        held.remove(&[1, 2, 7]);
        assert_eq!(held.len(), 0);
        // Twice the same prompt: held until both leave.
        held.add(&[5, 6]);
        held.add(&[5, 6]);
        held.remove(&[5, 6]);
        assert_eq!(held.len(), 2);
        held.remove(&[5, 6]);
        assert_eq!(held.len(), 0);
    }

    #[test]
    fn a_prompt_repeating_an_id_or_freed_unknown_does_not_panic() {
        let mut held = InFlightBlocks::default();
        held.add(&[1, 2, 1, 2]);
        held.remove(&[1, 2, 1, 2]);
        held.remove(&[1, 2, 1, 2]);
        held.remove(&[8, 9]);
        held.remove(&[]);
        held.add(&[]);
        assert!(held.len() <= 2);
    }
}
