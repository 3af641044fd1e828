//! [`RankSet`]: the worker ranks holding one tree node, as a compact sorted set.
//!
//! Most nodes are held by one rank (a prefix only one worker has seen) or by a
//! handful, so the set stores a single rank inline and spills to a boxed, sorted
//! `Vec` of 4-byte interned indices beyond that. Sorted order lets the prefix match
//! intersect two sets in one linear pass and compare them with one `memcmp`. The type
//! is 16 bytes (the box keeps it small: most nodes are held by one rank) and
//! allocates nothing for zero or one holder.

/// Interned index of a [`kv_events::WorkerRank`] inside one tree (assigned by
/// `RankTable`, in `tree/ranks.rs`). Defined here, below both the arena and the rank
/// table, because holder sets are made of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct RankIdx(pub(crate) u32);

/// A sorted set of interned worker ranks.
///
/// Stored as raw `u32` rank indices so that comparing two sets is a plain `memcmp`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) enum RankSet {
    /// No holder.
    #[default]
    Empty,
    /// Exactly one holder, stored inline.
    One(u32),
    /// Two or more holders, sorted ascending, no duplicates. Boxed on purpose: a thin
    /// pointer keeps the set (and every node) 8 bytes smaller, and most nodes have
    /// one holder.
    #[allow(clippy::box_collection)]
    Sorted(Box<Vec<u32>>),
}

const _: () = assert!(size_of::<RankSet>() == 16);

impl RankSet {
    /// The holders' raw indices in ascending order (see [`RankIdx`]).
    pub(crate) fn as_raw(&self) -> &[u32] {
        match self {
            RankSet::Empty => &[],
            RankSet::One(rank) => std::slice::from_ref(rank),
            RankSet::Sorted(ranks) => ranks,
        }
    }

    /// The holders in ascending order.
    #[cfg(test)]
    pub(crate) fn to_vec(&self) -> Vec<RankIdx> {
        self.as_raw().iter().map(|r| RankIdx(*r)).collect()
    }

    /// True when no rank holds the node.
    pub(crate) fn is_empty(&self) -> bool {
        matches!(self, RankSet::Empty)
    }

    /// True when `rank` holds the node. O(log n).
    pub(crate) fn contains(&self, rank: RankIdx) -> bool {
        self.as_raw().binary_search(&rank.0).is_ok()
    }

    /// Adds `rank`; returns false when it was already present. O(n) worst case.
    pub(crate) fn insert(&mut self, rank: RankIdx) -> bool {
        let rank = rank.0;
        match self {
            RankSet::Empty => {
                *self = RankSet::One(rank);
                true
            }
            RankSet::One(existing) if *existing == rank => false,
            RankSet::One(existing) => {
                let (a, b) = if *existing < rank {
                    (*existing, rank)
                } else {
                    (rank, *existing)
                };
                *self = RankSet::Sorted(Box::new(vec![a, b]));
                true
            }
            RankSet::Sorted(ranks) => match ranks.binary_search(&rank) {
                Ok(_) => false,
                Err(at) => {
                    ranks.insert(at, rank);
                    true
                }
            },
        }
    }

    /// Removes `rank`; returns false when it was absent. A set left with one holder
    /// goes back inline and frees its buffer.
    pub(crate) fn remove(&mut self, rank: RankIdx) -> bool {
        let rank = rank.0;
        match self {
            RankSet::Empty => false,
            RankSet::One(existing) if *existing == rank => {
                *self = RankSet::Empty;
                true
            }
            RankSet::One(_) => false,
            RankSet::Sorted(ranks) => match ranks.binary_search(&rank) {
                Err(_) => false,
                Ok(at) => {
                    ranks.remove(at);
                    if let [only] = ranks.as_slice() {
                        *self = RankSet::One(*only);
                    }
                    true
                }
            },
        }
    }

    /// Heap bytes owned by the set (by capacity).
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            RankSet::Empty | RankSet::One(_) => 0,
            RankSet::Sorted(ranks) => size_of::<Vec<u32>>() + ranks.capacity() * size_of::<u32>(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_sorted_and_goes_inline_at_one() {
        let mut set = RankSet::default();
        assert!(set.is_empty());
        assert!(set.insert(RankIdx(5)));
        assert!(matches!(set, RankSet::One(5)));
        assert!(!set.insert(RankIdx(5)));
        assert!(set.insert(RankIdx(2)));
        assert!(set.insert(RankIdx(9)));
        assert!(set.insert(RankIdx(7)));
        assert_eq!(
            set.to_vec(),
            vec![RankIdx(2), RankIdx(5), RankIdx(7), RankIdx(9)]
        );
        assert!(set.contains(RankIdx(7)) && !set.contains(RankIdx(3)));
        assert!(!set.remove(RankIdx(3)));
        for r in [2, 9, 7] {
            assert!(set.remove(RankIdx(r)));
        }
        assert!(matches!(set, RankSet::One(5)));
        assert_eq!(set.heap_bytes(), 0);
        assert!(set.remove(RankIdx(5)));
        assert!(set.is_empty());
        assert!(!set.remove(RankIdx(5)));
    }
}
