//! The per-rank part of the write model: incremental aggregates over the requests
//! booked on one (worker, dp_rank), and the derived load projection.
//!
//! - Decode blocks: with KV reuse, the *chained* block ids (a block id that encodes
//!   its whole prefix, see [`chain_block_ids`]) the active requests hold, each once
//!   ([`super::in_flight`]), so a prefix shared by several active requests counts
//!   once; blocks without an id (the partial last block, or every block without KV
//!   reuse) count per request.
//! - Context blocks: every request's blocks, shared or not, counted per request (the
//!   KV that decode attention reads for each running sequence).
//! - Prefill: the in-flight prefills in booking order. Only the oldest one decays:
//!   its load falls linearly from its booked tokens to 0 over its expected duration,
//!   starting when it became the oldest. The others count in full.
//!
//! A booking or free costs one look-up and a binary search per run of its path in
//! the in-flight trie, plus one copy of the blocks no other active request holds; the
//! owner drops the aggregate whole when its last request leaves instead of stepping
//! through that request's blocks ([`RankSequences::holds_one`]), into a [`SparePool`]
//! that hands it, emptied but with its tables' capacity, to the next rank booked from
//! idle; reading the projection is O(1).

use super::in_flight::InFlightBlocks;
use crate::load::{PrefillLoadHint, RankLoad};
use kv_events::LocalBlockHash;
use std::collections::BTreeMap;

use std::time::{Duration, Instant};

/// Chained block ids of a prompt: id i identifies blocks 0..=i, so two requests share
/// id i exactly when they share the first i + 1 blocks. Each step is a bijection of
/// the previous id for a given block, and of the block (its local hash through the
/// SplitMix64 finalizer) for a given previous id: `id = (rotl(prev, 23) ^ mix(h)) ×
/// K`, K odd. So two prompts' ids differ from their first differing block on unless
/// two random-looking 64-bit values meet (2^-64 per pair); not cryptographic — a
/// collision only makes two blocks count once. Only the rotate, xor and multiply are
/// serial from block to block (the finalizers of the hashes overlap), a third of a
/// finalizer's latency: a 64-block prompt chains in ~0.1 µs instead of ~0.3.
pub fn chain_block_ids(hashes: &[LocalBlockHash]) -> Vec<u64> {
    let mut prev = 0x9e37_79b9_7f4a_7c15_u64;
    hashes
        .iter()
        .map(|h| {
            prev = (prev.rotate_left(23) ^ mix(h.0)).wrapping_mul(0xd6e8_feb8_6659_fd93);
            prev
        })
        .collect()
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Emptied aggregates, kept with their in-flight tables' capacity for the next rank
/// booked from idle. Why: at light load most ranks hold a request or two, so each
/// booking onto an idle rank allocated its tables and a second booking there grew
/// them; the two were ~4% of a route's CPU in the daemon (the route thread's
/// profile, docs/benchmarks.md). Cost: an emptied map's control bytes are cleared (1
/// byte per bucket) and its runs' ids freed; at most [`SparePool::MAX_SPARE`]
/// aggregates of at most [`SparePool::MAX_CAPACITY`] runs each are kept (~3 MiB at
/// most).
#[derive(Debug, Default)]
pub(super) struct SparePool {
    spare: Vec<RankSequences>,
}

/// A clone starts with no spares: they are capacity, not state.
impl Clone for SparePool {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl SparePool {
    /// Most aggregates kept.
    const MAX_SPARE: usize = 256;
    /// Largest in-flight tables kept, in runs; larger ones are freed.
    const MAX_CAPACITY: usize = 256;

    /// An empty aggregate: a spare one if any.
    pub(super) fn take(&mut self) -> RankSequences {
        self.spare.pop().unwrap_or_default()
    }

    /// Keeps `rank`'s aggregate, emptied, unless the pool is full or its tables large.
    pub(super) fn give(&mut self, mut rank: RankSequences) {
        if self.spare.len() < Self::MAX_SPARE && rank.blocks.capacity() <= Self::MAX_CAPACITY {
            let mut blocks = std::mem::take(&mut rank.blocks);
            blocks.clear();
            self.spare.push(RankSequences {
                blocks,
                ..RankSequences::default()
            });
        }
    }
}

/// One in-flight prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PendingPrefill {
    tokens: u64,
    duration: Option<Duration>,
}

/// Aggregates of the requests booked on one rank.
#[derive(Debug, Clone, Default)]
pub(crate) struct RankSequences {
    requests: usize,
    /// The chained block ids the active requests hold, each once.
    blocks: InFlightBlocks,
    /// Blocks held by exactly one request each.
    private_blocks: u64,
    /// Σ blocks of every request, shared prefixes counted per request.
    context_blocks: u64,
    /// Σ initial effective prefill tokens of every active request.
    uncached_tokens: u64,
    /// In-flight prefills by booking sequence number (oldest first).
    prefills: BTreeMap<u64, PendingPrefill>,
    /// Σ booked tokens of `prefills`.
    prefill_tokens: u64,
    /// When the current oldest prefill started decaying.
    head_since: Option<Instant>,
}

impl RankSequences {
    /// Adds a request booked with sequence number `seq` (increasing per booking).
    pub fn add(
        &mut self,
        seq: u64,
        block_ids: &[u64],
        private_blocks: u64,
        hint: PrefillLoadHint,
        now: Instant,
    ) {
        self.requests += 1;
        self.blocks.add(block_ids);
        // Saturating: token counts come from the network, and an absurd request must
        // not panic the daemon (it can only distort this rank's aggregate).
        self.private_blocks = self.private_blocks.saturating_add(private_blocks);
        self.context_blocks = self
            .context_blocks
            .saturating_add(block_ids.len() as u64)
            .saturating_add(private_blocks);
        let tokens = hint.initial_effective_prefill_tokens;
        self.uncached_tokens = self.uncached_tokens.saturating_add(tokens);
        if self.prefills.is_empty() {
            self.head_since = Some(now);
        }
        self.prefills.insert(
            seq,
            PendingPrefill {
                tokens,
                duration: hint.expected_prefill_duration,
            },
        );
        self.prefill_tokens = self.prefill_tokens.saturating_add(tokens);
    }

    /// The request `seq` finished its prefill; the next oldest starts decaying `now`.
    /// Returns false when it was not prefilling.
    pub fn finish_prefill(&mut self, seq: u64, now: Instant) -> bool {
        let was_head = self.prefills.keys().next() == Some(&seq);
        let Some(p) = self.prefills.remove(&seq) else {
            return false;
        };
        self.prefill_tokens = self.prefill_tokens.saturating_sub(p.tokens);
        if self.prefills.is_empty() {
            self.head_since = None;
        } else if was_head {
            self.head_since = Some(now);
        }
        true
    }

    /// Removes a request entirely (its prefill too, if still in flight).
    pub fn remove(
        &mut self,
        seq: u64,
        block_ids: &[u64],
        private_blocks: u64,
        uncached_tokens: u64,
        now: Instant,
    ) {
        self.finish_prefill(seq, now);
        self.requests = self.requests.saturating_sub(1);
        self.blocks.remove(block_ids);
        self.private_blocks = self.private_blocks.saturating_sub(private_blocks);
        self.context_blocks = self
            .context_blocks
            .saturating_sub(block_ids.len() as u64)
            .saturating_sub(private_blocks);
        self.uncached_tokens = self.uncached_tokens.saturating_sub(uncached_tokens);
    }

    /// In-flight prefill tokens that do not decay before the next change here: all
    /// but the oldest prefill when that one decays, else all of them.
    pub fn floor_prefill_tokens(&self) -> u64 {
        match self.prefills.values().next() {
            Some(head) if head.duration.is_some() => {
                self.prefill_tokens.saturating_sub(head.tokens)
            }
            _ => self.prefill_tokens,
        }
    }

    /// Every in-flight prefill token booked here, none decayed.
    pub fn total_prefill_tokens(&self) -> u64 {
        self.prefill_tokens
    }

    /// Whether no request is booked here.
    pub fn is_empty(&self) -> bool {
        self.requests == 0
    }

    /// Whether exactly one request is booked here: removing it empties every
    /// aggregate.
    pub fn holds_one(&self) -> bool {
        self.requests == 1
    }

    /// How many of a request's `request_blocks` blocks would be new decode load here:
    /// its blocks minus the leading chained ids already held by active requests.
    pub fn new_blocks(&self, block_ids: &[u64], request_blocks: u32) -> u32 {
        let held = self.blocks.held(block_ids);
        request_blocks.saturating_sub(u32::try_from(held).unwrap_or(u32::MAX))
    }

    /// The derived load at `now`.
    pub fn load(&self, now: Instant) -> RankLoad {
        RankLoad {
            active_prefill_tokens: self.projected_prefill_tokens(now),
            active_decode_blocks: (self.blocks.len() as u64).saturating_add(self.private_blocks),
            active_requests: self.requests,
            active_uncached_tokens: self.uncached_tokens,
            active_context_blocks: self.context_blocks,
        }
    }

    /// Σ in-flight prefill tokens, with the oldest decayed linearly:
    /// `tokens × (1 − elapsed / duration)`, clamped at 0, in integer nanoseconds.
    fn projected_prefill_tokens(&self, now: Instant) -> u64 {
        let Some(head) = self.prefills.values().next() else {
            return 0;
        };
        let remaining = match (head.duration, self.head_since) {
            (Some(d), Some(since)) => {
                let elapsed = now.saturating_duration_since(since);
                if elapsed >= d {
                    0
                } else {
                    let left = (d - elapsed).as_nanos();
                    // left < d, so the quotient is below head.tokens and fits in u64.
                    u64::try_from(u128::from(head.tokens) * left / d.as_nanos())
                        .unwrap_or(head.tokens)
                }
            }
            _ => head.tokens,
        };
        self.prefill_tokens - head.tokens + remaining
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hint(tokens: u64, ms: Option<u64>) -> PrefillLoadHint {
        PrefillLoadHint {
            initial_effective_prefill_tokens: tokens,
            expected_prefill_duration: ms.map(Duration::from_millis),
        }
    }

    #[test]
    fn chained_ids_depend_on_the_whole_prefix() {
        let a = chain_block_ids(&[LocalBlockHash(1), LocalBlockHash(2), LocalBlockHash(3)]);
        let b = chain_block_ids(&[LocalBlockHash(1), LocalBlockHash(2), LocalBlockHash(4)]);
        let c = chain_block_ids(&[LocalBlockHash(9), LocalBlockHash(2), LocalBlockHash(3)]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Same block hash behind a different prefix is a different block.
        assert_ne!(a[1], c[1]);
        assert_ne!(a[2], c[2]);
        assert!(chain_block_ids(&[]).is_empty());
    }

    #[test]
    fn only_the_oldest_prefill_decays_and_the_next_starts_when_it_ends() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut rank = RankSequences::default();
        rank.add(1, &[], 0, hint(1000, Some(100)), t0);
        rank.add(2, &[], 0, hint(400, Some(40)), ms(10));
        assert_eq!(rank.load(t0).active_prefill_tokens, 1400);
        // 25 ms into 100 ms: the oldest has 750 left; the second is untouched.
        assert_eq!(rank.load(ms(25)).active_prefill_tokens, 1150);
        assert_eq!(rank.load(ms(100)).active_prefill_tokens, 400);
        assert_eq!(rank.load(ms(500)).active_prefill_tokens, 400);
        // The oldest completes at 120 ms; the second starts decaying then.
        assert!(rank.finish_prefill(1, ms(120)));
        assert_eq!(rank.load(ms(120)).active_prefill_tokens, 400);
        assert_eq!(rank.load(ms(130)).active_prefill_tokens, 300);
        assert_eq!(rank.load(ms(160)).active_prefill_tokens, 0);
        assert!(!rank.finish_prefill(1, ms(200)), "already finished");
        // The uncached-token aggregate does not decay.
        assert_eq!(rank.load(ms(160)).active_uncached_tokens, 1400);
    }

    #[test]
    fn prefill_without_duration_does_not_decay() {
        let t0 = Instant::now();
        let mut rank = RankSequences::default();
        rank.add(1, &[], 0, hint(500, None), t0);
        assert_eq!(
            rank.load(t0 + Duration::from_secs(3600))
                .active_prefill_tokens,
            500
        );
        // Finishing a younger request leaves the head's clock alone.
        rank.add(2, &[], 0, hint(10, Some(1)), t0);
        rank.finish_prefill(2, t0 + Duration::from_secs(1));
        assert_eq!(rank.load(t0).active_prefill_tokens, 500);
    }

    #[test]
    fn shared_prefix_blocks_count_once_and_new_blocks_skip_held_prefix() {
        let t0 = Instant::now();
        let ids_a = chain_block_ids(&[LocalBlockHash(1), LocalBlockHash(2), LocalBlockHash(3)]);
        let ids_b = chain_block_ids(&[LocalBlockHash(1), LocalBlockHash(2), LocalBlockHash(7)]);
        let mut rank = RankSequences::default();
        // a: 3 hashed blocks + 1 partial; b shares 2 blocks with a, + 1 own + 1 partial.
        rank.add(1, &ids_a, 1, hint(0, None), t0);
        assert_eq!(rank.new_blocks(&ids_b, 4), 2);
        rank.add(2, &ids_b, 1, hint(0, None), t0);
        // Unique chained ids: a's 3 + b's own 1; private: one partial block each.
        assert_eq!(rank.load(t0).active_decode_blocks, 4 + 2);
        rank.remove(1, &ids_a, 1, 0, t0);
        assert_eq!(rank.load(t0).active_decode_blocks, 4);
        rank.remove(2, &ids_b, 1, 0, t0);
        assert!(rank.is_empty());
        assert_eq!(rank.load(t0), RankLoad::default());
        assert_eq!(rank.blocks.len(), 0);
    }
}
