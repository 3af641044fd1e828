//! The LRU list of unreferenced cached blocks and the reference counts that move a
//! block in and out of it, shared by the dense cache ([`super::KvCache`]) and the
//! hybrid one (`crate::hybrid::HybridCache`).
//!
//! A block with references is never evicted; at its last release it joins the list
//! as the most recently used, and eviction takes the least recently released first.
//! Cost: one ordered-map entry per unreferenced block, O(log n) per move.

use std::collections::BTreeMap;

/// A cached block's references and, while it has none, its place in the [`Lru`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refs {
    refcount: u32,
    tick: Option<u64>,
}

impl Refs {
    /// A block just cached by the request that computed it: one reference.
    pub fn held() -> Self {
        Self {
            refcount: 1,
            tick: None,
        }
    }

    /// Whether no request references the block (it is in the list).
    pub fn is_unreferenced(&self) -> bool {
        self.refcount == 0
    }
}

/// Unreferenced cached blocks, keyed by `K`, by release order.
#[derive(Debug, Clone)]
pub(crate) struct Lru<K> {
    /// Smallest tick = least recently released.
    order: BTreeMap<u64, K>,
    next_tick: u64,
}

impl<K: Copy> Lru<K> {
    /// An empty list.
    pub fn new() -> Self {
        Self {
            order: BTreeMap::new(),
            next_tick: 0,
        }
    }

    /// One more reference to the block with `refs`: it leaves the list.
    pub fn acquire(&mut self, refs: &mut Refs) {
        if let Some(tick) = refs.tick.take() {
            self.order.remove(&tick);
        }
        refs.refcount += 1;
    }

    /// One reference fewer to block `key`; at none it joins the list as the most
    /// recently used.
    pub fn release(&mut self, refs: &mut Refs, key: K) {
        refs.refcount = refs.refcount.saturating_sub(1);
        if refs.refcount == 0 && refs.tick.is_none() {
            let tick = self.next_tick;
            self.next_tick += 1;
            refs.tick = Some(tick);
            self.order.insert(tick, key);
        }
    }

    /// Takes the least recently released block out of the list.
    pub fn pop_oldest(&mut self) -> Option<K> {
        self.order.pop_first().map(|(_, key)| key)
    }

    /// Blocks in the list.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Empties the list.
    pub fn clear(&mut self) {
        self.order.clear();
    }

    /// The blocks from least to most recently released.
    pub fn iter(&self) -> impl Iterator<Item = K> + '_ {
        self.order.values().copied()
    }
}
