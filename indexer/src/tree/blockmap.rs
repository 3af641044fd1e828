//! [`BlockMap`]: a holder's engine-hash map (engine block hash → [`BlockRef`]), an
//! open-addressing table with linear probing whose 16-byte slots hold the key and
//! the value together.
//!
//! Why not hashbrown (std's `HashMap`): at millions of entries each store of a new
//! block misses the cache twice there, once on the control bytes the probe reads and
//! once on the bucket the insert then writes, which lies elsewhere (hashbrown keeps
//! buckets apart from control bytes). The round-two profile put that second miss, the
//! cold bucket write, at 16.5 % of a bare tree's apply (`docs/studies/bare-apply.md`),
//! and hashbrown's public maps give no address to prefetch it by (and this workspace
//! forbids the `unsafe` a prefetch intrinsic needs). Here a probe reads the slots
//! themselves and stops at the first free one, which is where an insert writes: one
//! cache line per lookup or insert (two when the probe run crosses a line), which
//! `RankState::warm` fetches for all of an event's blocks at once.
//!
//! The cost: a lower maximum load than hashbrown's (3/4 against 7/8, so that probe
//! runs stay short under linear probing), for 16 bytes a slot instead of 17; both
//! double their slots when full, so a map holds the same slots as hashbrown's for
//! most entry counts and twice as many between 3/4 and 7/8 of a power of two. A free
//! slot is marked by a value no block reference takes ([`BlockId::ROOT`] at
//! generation 0: the root is never a held block). Removal shifts the following probe
//! run back (no tombstones), so lookups never slow down with churn.
//!
//! Keys are engine hashes from the network: the slot is chosen by the high bits of a
//! multiplication (Fibonacci hashing), so keys that differ anywhere spread out; like
//! the `FxHashMap` it replaces it does not resist keys chosen to collide, which slow
//! one holder's map down but cannot make it loop (a free slot always ends a probe).

use super::arena::BlockId;
use kv_events::ExternalBlockHash;

/// A rank's reference to one of its blocks: the block's stable id and the id's
/// generation when the reference was made. The reference is stale (the block was
/// pruned) when the generations differ. 8 bytes, so a map entry stays 16. Runs may
/// split and merge under it: the id keeps naming the same block position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockRef {
    pub(crate) id: BlockId,
    pub(crate) generation: u32,
}

impl BlockRef {
    /// A tombstone: a block the index chose to forget (pruned, or stored below a
    /// pruned block). Never live: the root's generation is never bumped from 0.
    pub(crate) const FORGOTTEN: BlockRef = BlockRef {
        id: BlockId::ROOT,
        generation: u32::MAX,
    };
}

/// Slots of the smallest allocated map.
const MIN_SLOTS: usize = 8;
/// 2^64 / φ: consecutive keys land far apart.
const FIBONACCI: u64 = 0x9E37_79B9_7F4A_7C15;

/// The value of a free slot (never a held block: the root is not one).
const FREE_REF: BlockRef = BlockRef {
    id: BlockId::ROOT,
    generation: 0,
};

/// One slot: 16 bytes, four to a cache line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    key: ExternalBlockHash,
    value: BlockRef,
}

impl Slot {
    const FREE: Slot = Slot {
        key: ExternalBlockHash(0),
        value: FREE_REF,
    };

    fn is_free(&self) -> bool {
        self.value == FREE_REF
    }
}

/// Where [`BlockMap::find_or_free`] found a key: its slot and value, or the free
/// slot it would go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// The key's slot and its value.
    Held(usize, BlockRef),
    /// The free slot that ends the key's probe run.
    Free(usize),
}

/// Engine block hash → block reference, one slot per entry (see the module docs).
#[derive(Debug, Clone, Default)]
pub(crate) struct BlockMap {
    /// Empty, or a power of two of at least [`MIN_SLOTS`], at most 3/4 full.
    slots: Vec<Slot>,
    len: usize,
    /// 64 − log2(slots): the product's bits that pick a slot.
    shift: u32,
}

impl BlockMap {
    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes held, by capacity.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * size_of::<Slot>()
    }

    /// The slot a key's probe starts at. The map must have slots.
    fn home(&self, key: ExternalBlockHash) -> usize {
        (key.0.wrapping_mul(FIBONACCI) >> self.shift) as usize
    }

    /// The slot of `key` (`Ok`) or the free slot that ends its probe run (`Err`).
    /// The map must have slots; one is always free (at most 3/4 are used), so the
    /// loop ends.
    fn probe(&self, key: ExternalBlockHash) -> Result<usize, usize> {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let slot = &self.slots[i];
            if slot.is_free() {
                return Err(i);
            }
            if slot.key == key {
                return Ok(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The value of `key`.
    pub(crate) fn get(&self, key: &ExternalBlockHash) -> Option<&BlockRef> {
        if self.len == 0 {
            return None;
        }
        self.probe(*key).ok().map(|i| &self.slots[i].value)
    }

    /// True when `key` has an entry.
    pub(crate) fn contains_key(&self, key: &ExternalBlockHash) -> bool {
        self.get(key).is_some()
    }

    /// Loads the slot `key`'s probe starts at, where the key or its free slot almost
    /// always is (same cache line), without branching on what it reads: the loads
    /// of many keys then overlap their cache misses, where a probe's branch on each
    /// slot would be mispredicted about half the time and discard the loads issued
    /// after it. The returned value only keeps the load from being optimised away.
    pub(crate) fn touch(&self, key: ExternalBlockHash) -> u64 {
        if self.slots.is_empty() {
            return 0;
        }
        self.slots[self.home(key)].key.0
    }

    /// Finds `key` after making room for one more entry, so that the slot found can
    /// be filled by [`BlockMap::fill`] while the map is left unchanged in between:
    /// one probe serves the lookup and the insert.
    pub(crate) fn find_or_free(&mut self, key: ExternalBlockHash) -> Found {
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.rebuild((self.slots.len() * 2).max(MIN_SLOTS));
        }
        match self.probe(key) {
            Ok(i) => Found::Held(i, self.slots[i].value),
            Err(i) => Found::Free(i),
        }
    }

    /// Sets `key`'s value to `value` in the slot `at` that
    /// [`BlockMap::find_or_free`] returned for `key`, the map unchanged since.
    pub(crate) fn fill(&mut self, at: Found, key: ExternalBlockHash, value: BlockRef) {
        debug_assert_ne!(value, FREE_REF, "the root is never held");
        match at {
            Found::Held(i, _) => self.slots[i].value = value,
            Found::Free(i) => {
                self.slots[i] = Slot { key, value };
                self.len += 1;
            }
        }
    }

    /// Sets `key`'s value, returning the previous one.
    pub(crate) fn insert(&mut self, key: ExternalBlockHash, value: BlockRef) -> Option<BlockRef> {
        let at = self.find_or_free(key);
        self.fill(at, key, value);
        match at {
            Found::Held(_, old) => Some(old),
            Found::Free(_) => None,
        }
    }

    /// Removes `key`, returning its value. The entries after it in its probe run
    /// move back into the hole where their own probes reach it.
    pub(crate) fn remove(&mut self, key: &ExternalBlockHash) -> Option<BlockRef> {
        if self.len == 0 {
            return None;
        }
        let mut hole = self.probe(*key).ok()?;
        let value = self.slots[hole].value;
        let mask = self.slots.len() - 1;
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let slot = self.slots[j];
            if slot.is_free() {
                break;
            }
            // The entry at `j` may fill the hole when the hole lies on its probe
            // path, from its home up to `j`.
            let from_home = j.wrapping_sub(self.home(slot.key)) & mask;
            if from_home >= j.wrapping_sub(hole) & mask {
                self.slots[hole] = slot;
                hole = j;
            }
        }
        self.slots[hole] = Slot::FREE;
        self.len -= 1;
        Some(value)
    }

    /// Every entry, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&ExternalBlockHash, &BlockRef)> {
        (self.slots.iter())
            .filter(|slot| !slot.is_free())
            .map(|slot| (&slot.key, &slot.value))
    }

    /// Every value, in slot order.
    pub(crate) fn values(&self) -> impl Iterator<Item = &BlockRef> {
        self.iter().map(|(_, value)| value)
    }

    /// Keeps the entries for which `keep` is true (it may change their values).
    pub(crate) fn retain(
        &mut self,
        mut keep: impl FnMut(&ExternalBlockHash, &mut BlockRef) -> bool,
    ) {
        let before = self.len;
        for slot in &mut self.slots {
            if !slot.is_free() && !keep(&slot.key, &mut slot.value) {
                *slot = Slot::FREE;
                self.len -= 1;
            }
        }
        if self.len != before {
            // Freed slots cut probe runs: reinsert what is left.
            self.rebuild(self.slots.len());
        }
    }

    /// Shrinks to the fewest slots that hold the entries (none when empty).
    pub(crate) fn shrink_to_fit(&mut self) {
        let slots = match self.len {
            0 => 0,
            n => (n * 4).div_ceil(3).next_power_of_two().max(MIN_SLOTS),
        };
        if slots != self.slots.len() {
            self.rebuild(slots);
        }
    }

    /// Moves every entry into `slots` fresh slots (a power of two holding them, or 0
    /// when empty).
    fn rebuild(&mut self, slots: usize) {
        let old = std::mem::replace(&mut self.slots, vec![Slot::FREE; slots]);
        if slots == 0 {
            self.len = 0;
            return;
        }
        self.shift = 64 - slots.trailing_zeros();
        for slot in old.into_iter().filter(|slot| !slot.is_free()) {
            if let Err(i) = self.probe(slot.key) {
                self.slots[i] = slot;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn r(n: u32) -> BlockRef {
        BlockRef {
            id: BlockId(n + 1),
            generation: n,
        }
    }

    /// Keys whose probes all start at slot `home` of an 8-slot map.
    fn colliding(home: usize, count: usize) -> Vec<ExternalBlockHash> {
        let map = BlockMap {
            shift: 61,
            ..BlockMap::default()
        };
        (0u64..)
            .map(ExternalBlockHash)
            .filter(|k| map.home(*k) == home)
            .take(count)
            .collect()
    }

    #[test]
    fn a_removal_inside_a_run_that_wraps_keeps_every_key_found() {
        let mut map = BlockMap::default();
        // Five keys from the last slot on wrap past the end; 5 of 8 slots stays
        // under 3/4, so the map does not grow.
        let keys = colliding(7, 5);
        for (n, key) in keys.iter().enumerate() {
            assert_eq!(map.insert(*key, r(n as u32)), None);
        }
        assert_eq!(map.slots.len(), 8);
        assert_eq!(map.remove(&keys[1]), Some(r(1)));
        for (n, key) in keys.iter().enumerate().filter(|(n, _)| *n != 1) {
            assert_eq!(map.get(key), Some(&r(n as u32)), "key {n}");
        }
        assert_eq!(map.get(&keys[1]), None);
        assert_eq!(map.len(), 4);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        Retain(u64),
        Shrink,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few keys, so inserts overwrite and removes hit.
        prop_oneof![
            6 => (0u64..64, 0u32..1000).prop_map(|(k, v)| Op::Insert(k, v)),
            4 => (0u64..64).prop_map(Op::Remove),
            1 => (1u64..8).prop_map(Op::Retain),
            1 => Just(Op::Shrink),
        ]
    }

    proptest! {
        /// The map answers as std's `HashMap` does under any sequence of changes.
        #[test]
        fn agrees_with_std(ops in proptest::collection::vec(op(), 0..300)) {
            let mut map = BlockMap::default();
            let mut model: HashMap<ExternalBlockHash, BlockRef> = HashMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => {
                        let k = ExternalBlockHash(k);
                        prop_assert_eq!(map.insert(k, r(v)), model.insert(k, r(v)));
                    }
                    Op::Remove(k) => {
                        let k = ExternalBlockHash(k);
                        prop_assert_eq!(map.remove(&k), model.remove(&k));
                    }
                    Op::Retain(m) => {
                        map.retain(|k, _| k.0 % m != 0);
                        model.retain(|k, _| k.0 % m != 0);
                    }
                    Op::Shrink => map.shrink_to_fit(),
                }
                prop_assert_eq!(map.len(), model.len());
                prop_assert!(map.len() * 4 <= map.slots.len() * 3);
                for k in (0..64).map(ExternalBlockHash) {
                    prop_assert_eq!(map.get(&k), model.get(&k));
                }
                let mut listed: Vec<_> = map.iter().map(|(k, v)| (*k, *v)).collect();
                let mut expected: Vec<_> = model.iter().map(|(k, v)| (*k, *v)).collect();
                listed.sort_by_key(|(k, _)| *k);
                expected.sort_by_key(|(k, _)| *k);
                prop_assert_eq!(listed, expected);
            }
        }
    }
}
