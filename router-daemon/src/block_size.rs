//! [`BlockSize`]: the tokens per KV block the router hashes prompts at — pinned by
//! `--block-size`, or adopted from the workers' registrations.
//!
//! Why: engines already publish their block size in their etcd registration, so a
//! flag that repeats it is one more place to get it wrong, and a wrong one failed
//! silently. Without `--block-size` the router takes the size of the first
//! registration it accepts, rejects registrations of any other size (logged with the
//! worker id and both sizes, counted as
//! `kv_router_messages_total{kind="registration",outcome="rejected"}`), and forgets the
//! size when its last worker leaves, so a namespace can be redeployed at another size.
//! With `--block-size` the size is pinned: never forgotten, and a registration of
//! another size is rejected even while no worker is registered.
//!
//! # Why replicas agree
//! Every replica applies the same registrations in the same order:
//! - the watch delivers puts and deletes in etcd revision order;
//! - the start-up load (and the resync after an etcd outage) puts the present
//!   registrations in key *creation* revision order (`kv_cluster::directory`), the
//!   order a replica that was watching saw them arrive; a re-put (new epoch) keeps its
//!   creation revision, so a restarted worker does not jump the queue;
//! - a registration rejected for its size is remembered by discovery while its key
//!   exists, and when the last accepted worker leaves the remembered ones are
//!   reconsidered oldest first, as a replica starting at that moment would load them.
//!
//! So while a namespace's registrations all carry one size — the only correct
//! deployment, and the case a redeploy at a new size passes through once the old
//! workers are gone — every replica adopts that size, whenever it started. Only when
//! two sizes are registered at once (an operator error, rejected and counted on every
//! replica) can a replica that started late disagree: if the adopted size's oldest
//! workers left while younger ones of the same size stayed, a replica loading now
//! takes the size of the oldest registration left. Pin `--block-size` where that must
//! never happen.
//!
//! # The index across a size change
//! The size changes only after every worker left, and discovery drops a leaving
//! worker's blocks from every indexer shard, so nothing indexed at the old size is
//! left to match. A JetStream snapshot records block hashes, not a size; a block
//! hash covers exactly one block's tokens, so a prompt hashed at one size matches no
//! block stored at another (short of a 64-bit hash collision): blocks a snapshot
//! restores for workers registered at another size score no overlap and are dropped
//! with their worker.
//!
//! Cost on the route path: one atomic load.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};

/// Where the router's block size comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockSizeSource {
    /// `--block-size`: fixed for the daemon's life.
    Pinned,
    /// The first accepted registration; forgotten when no worker is registered.
    Adopted,
}

/// A registration whose block size the router cannot take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("block_size {registered} differs from the router's {router} tokens ({})", match .origin {
    BlockSizeSource::Pinned => "pinned by --block-size",
    BlockSizeSource::Adopted => "adopted from the registered workers",
})]
pub(crate) struct BlockSizeMismatch {
    /// The registration's block size, in tokens.
    pub registered: u32,
    /// The router's block size, in tokens.
    pub router: u32,
    /// Where the router's size came from.
    pub origin: BlockSizeSource,
}

/// The router's tokens per KV block, shared lock-free between discovery (the only
/// writer) and the route path.
#[derive(Debug)]
pub struct BlockSize {
    /// The size in tokens; 0 encodes "none yet" (a block size is at least 1 token)
    /// and never leaves this type.
    size: AtomicU32,
    source: BlockSizeSource,
}

impl BlockSize {
    /// A size fixed at `tokens` (`--block-size`).
    pub(crate) fn pinned(tokens: NonZeroU32) -> Self {
        Self {
            size: AtomicU32::new(tokens.get()),
            source: BlockSizeSource::Pinned,
        }
    }

    /// No size yet: the first registration accepted sets it.
    pub(crate) fn adopted() -> Self {
        Self {
            size: AtomicU32::new(0),
            source: BlockSizeSource::Adopted,
        }
    }

    /// The size in tokens, or `None` while none is known (adopted, no worker
    /// registered).
    pub fn get(&self) -> Option<NonZeroU32> {
        NonZeroU32::new(self.size.load(Ordering::Acquire))
    }

    /// Where the size comes from.
    pub fn source(&self) -> BlockSizeSource {
        self.source
    }

    /// Whether a registration of `tokens` per block could ever be accepted: only a
    /// pinned size refuses for good.
    ///
    /// # Errors
    /// [`BlockSizeMismatch`] when pinned to another size.
    pub(crate) fn check_pinned(&self, tokens: u32) -> Result<(), BlockSizeMismatch> {
        match self.source {
            BlockSizeSource::Pinned => self.check(tokens),
            BlockSizeSource::Adopted => Ok(()),
        }
    }

    /// Accepts a registration of `tokens` per block: adopts it when no size is known,
    /// otherwise it must equal the router's.
    ///
    /// # Errors
    /// [`BlockSizeMismatch`] naming both sizes.
    pub(crate) fn accept(&self, tokens: NonZeroU32) -> Result<(), BlockSizeMismatch> {
        if self.source == BlockSizeSource::Adopted && self.get().is_none() {
            // Discovery is the only writer, so nothing changed since the load.
            self.size.store(tokens.get(), Ordering::Release);
            return Ok(());
        }
        self.check(tokens.get())
    }

    /// Forgets an adopted size (the last worker left); a pinned size stays. Returns
    /// whether a size was forgotten.
    pub(crate) fn forget(&self) -> bool {
        self.source == BlockSizeSource::Adopted && self.size.swap(0, Ordering::AcqRel) != 0
    }

    fn check(&self, tokens: u32) -> Result<(), BlockSizeMismatch> {
        match self.get() {
            Some(router) if router.get() != tokens => Err(BlockSizeMismatch {
                registered: tokens,
                router: router.get(),
                origin: self.source,
            }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).expect("test sizes are positive")
    }

    #[test]
    fn adopted_takes_the_first_size_and_refuses_others_until_forgotten() {
        let b = BlockSize::adopted();
        assert_eq!(b.get(), None);
        assert_eq!(b.check_pinned(32), Ok(()));
        assert_eq!(b.accept(tokens(16)), Ok(()));
        assert_eq!(b.get(), Some(tokens(16)));
        assert_eq!(b.accept(tokens(16)), Ok(()));
        let err = b.accept(tokens(32)).unwrap_err();
        assert_eq!(
            err,
            BlockSizeMismatch {
                registered: 32,
                router: 16,
                origin: BlockSizeSource::Adopted
            }
        );
        assert!(err.to_string().contains("block_size 32"), "{err}");
        assert!(err.to_string().contains("router's 16"), "{err}");
        // Adopted sizes never refuse for good.
        assert_eq!(b.check_pinned(32), Ok(()));
        assert!(b.forget());
        assert!(!b.forget());
        assert_eq!(b.get(), None);
        assert_eq!(b.accept(tokens(32)), Ok(()));
        assert_eq!(b.get(), Some(tokens(32)));
    }

    #[test]
    fn pinned_refuses_other_sizes_even_with_no_worker_and_is_never_forgotten() {
        let b = BlockSize::pinned(tokens(64));
        assert_eq!(b.source(), BlockSizeSource::Pinned);
        assert_eq!(b.get(), Some(tokens(64)));
        let err = b.check_pinned(16).unwrap_err();
        assert_eq!(err.origin, BlockSizeSource::Pinned);
        assert!(err.to_string().contains("--block-size"), "{err}");
        assert!(b.accept(tokens(16)).is_err());
        assert!(!b.forget());
        assert_eq!(b.get(), Some(tokens(64)));
        assert_eq!(b.accept(tokens(64)), Ok(()));
    }
}
