//! [`Children`]: the child runs of one tree node, keyed by each child's first block
//! hash.
//!
//! The common shapes cost no heap at all: a leaf has `None`, and a node with one
//! continuation keeps it inline. A short boxed, unsorted `Vec` is scanned linearly up
//! to [`FEW_CHILDREN`], and a boxed hash map takes over beyond, which is what the root
//! and other hot branching points become. Boxing the rare shapes keeps [`Children`]
//! at 16 bytes.

use kv_events::LocalBlockHash;
use rustc_hash::FxHashMap;

/// Index of a run in the arena (`tree/arena.rs`). Defined here, below the arena,
/// because child maps are made of it. The root is slot 0 (an empty run) and is
/// never freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub(crate) struct NodeIdx(pub(crate) u32);

impl NodeIdx {
    /// The root: the empty prefix, parent of every first run.
    pub(crate) const ROOT: NodeIdx = NodeIdx(0);

    pub(crate) fn slot(self) -> usize {
        self.0 as usize
    }
}

/// Most children a node keeps in a linear `Vec` before switching to a hash map.
const FEW_CHILDREN: usize = 8;
/// A hash map of children shrinks back to a `Vec` at this many entries (hysteresis,
/// so a node hovering at the limit does not convert on every store and remove).
const FEW_CHILDREN_AGAIN: usize = FEW_CHILDREN / 2;

/// The children of one node, keyed by the child's block hash.
///
/// The common shapes cost no heap at all: a leaf has `None`, and a node in the
/// middle of a chain keeps its one child inline.
#[derive(Debug, Clone, Default)]
pub(crate) enum Children {
    /// No child (a leaf).
    #[default]
    None,
    /// Exactly one child, inline.
    One(LocalBlockHash, NodeIdx),
    /// Two up to [`FEW_CHILDREN`], unsorted and sized exactly. Boxed on purpose: a
    /// thin pointer keeps `Children` (and every node) 8 bytes smaller, and few nodes
    /// branch.
    #[allow(clippy::box_collection)]
    Few(Box<Vec<(LocalBlockHash, NodeIdx)>>),
    /// More than [`FEW_CHILDREN`].
    Many(Box<FxHashMap<LocalBlockHash, NodeIdx>>),
}

impl Children {
    /// The child with block hash `hash`.
    pub(crate) fn get(&self, hash: LocalBlockHash) -> Option<NodeIdx> {
        match self {
            Children::None => None,
            Children::One(h, n) => (*h == hash).then_some(*n),
            Children::Few(few) => few.iter().find(|(h, _)| *h == hash).map(|(_, n)| *n),
            Children::Many(many) => many.get(&hash).copied(),
        }
    }

    /// True when the node has no children.
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            Children::None => true,
            Children::One(..) => false,
            Children::Few(few) => few.is_empty(),
            Children::Many(many) => many.is_empty(),
        }
    }

    /// Calls `f` on every child, in no particular order.
    pub(super) fn each(&self, mut f: impl FnMut(NodeIdx)) {
        match self {
            Children::None => {}
            Children::One(_, n) => f(*n),
            Children::Few(few) => few.iter().for_each(|(_, n)| f(*n)),
            Children::Many(many) => many.values().for_each(|n| f(*n)),
        }
    }

    /// The only child, if there is exactly one.
    pub(super) fn only(&self) -> Option<NodeIdx> {
        match self {
            Children::One(_, n) => Some(*n),
            _ => None,
        }
    }

    /// Every child, in no particular order.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> Vec<NodeIdx> {
        match self {
            Children::None => Vec::new(),
            Children::One(_, n) => vec![*n],
            Children::Few(few) => few.iter().map(|(_, n)| *n).collect(),
            Children::Many(many) => many.values().copied().collect(),
        }
    }

    /// Adds a child; the caller has checked that `hash` is not present.
    pub(super) fn insert(&mut self, hash: LocalBlockHash, child: NodeIdx) {
        match self {
            Children::None => *self = Children::One(hash, child),
            Children::One(h, n) => {
                *self = Children::Few(Box::new(vec![(*h, *n), (hash, child)]));
            }
            Children::Few(few) if few.len() < FEW_CHILDREN => {
                few.reserve_exact(1);
                few.push((hash, child));
            }
            Children::Few(few) => {
                let mut many: FxHashMap<_, _> = few.drain(..).collect();
                many.insert(hash, child);
                *self = Children::Many(Box::new(many));
            }
            Children::Many(many) => {
                many.insert(hash, child);
            }
        }
    }

    /// Removes the child with block hash `hash`, if any.
    pub(super) fn remove(&mut self, hash: LocalBlockHash) {
        match self {
            Children::None => {}
            Children::One(h, _) if *h == hash => *self = Children::None,
            Children::One(..) => {}
            Children::Few(few) => {
                if let Some(at) = few.iter().position(|(h, _)| *h == hash) {
                    few.swap_remove(at);
                    if let [(h, n)] = few.as_slice() {
                        *self = Children::One(*h, *n);
                    }
                }
            }
            Children::Many(many) => {
                many.remove(&hash);
                if many.len() <= FEW_CHILDREN_AGAIN {
                    let rest: Vec<_> = many.drain().collect();
                    *self = match rest.as_slice() {
                        [] => Children::None,
                        [(h, n)] => Children::One(*h, *n),
                        _ => Children::Few(Box::new(rest)),
                    };
                }
            }
        }
    }

    pub(super) fn heap_bytes(&self) -> usize {
        match self {
            Children::None | Children::One(..) => 0,
            Children::Few(few) => {
                size_of::<Vec<(LocalBlockHash, NodeIdx)>>()
                    + few.capacity() * size_of::<(LocalBlockHash, NodeIdx)>()
            }
            Children::Many(many) => {
                size_of::<FxHashMap<LocalBlockHash, NodeIdx>>()
                    + many.capacity() * (size_of::<(LocalBlockHash, NodeIdx)>() + 1)
            }
        }
    }
}
