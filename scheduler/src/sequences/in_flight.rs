//! The blocks of the prompts in flight on one rank, as a path-compressed trie of
//! chained block ids.
//!
//! A chained id names a block *and its whole prefix* ([`super::chain_block_ids`]), so
//! the ids held by a rank's in-flight requests form a trie: an id is held only if
//! its parent (the id before it in its prompt) is. The trie is stored as *runs*:
//! stretches of consecutive ids that the same requests cover, each with the number
//! of requests covering it, found by their first id. So:
//!
//! - the rank's distinct decode blocks are the sum of the runs' lengths, kept as a
//!   counter;
//! - a prompt's leading blocks held in flight are found by one look-up per run on
//!   its path and a binary search of where the run's ids and the prompt's part;
//! - booking a prompt adds one to each run on its held path (splitting the run where
//!   it branches off or ends) and stores the rest, the part no other request holds,
//!   as one new run; freeing it subtracts one along the same path and drops the runs
//!   no request covers any more (they are its tail: a request covering a run covers
//!   its parent).
//!
//! Why: a node per id made every booking insert, and every free remove, one hash-map
//! entry per block no other request held. KV-aware routing books long prompts whose
//! tail is the request's own (a Mooncake prompt is ~1,000 blocks of 16 tokens, half of
//! them new), and every replica books every route: at 1,024-block prompts half new,
//! booking and freeing was 36% of a peer replica's CPU (docs/benchmarks.md, round
//! 35). Now a prompt costs one look-up and a binary search per run on its path and
//! one allocation for its own tail.
//!
//! Ids are 64-bit mixes of the hashes, so two different prefixes share an id with
//! probability 2^-64 per pair; a prompt crafted to repeat ids (the hashes come from
//! the network) cannot panic or loop anything here — every walk moves forward by at
//! least one id per step and counts saturate — but may leave a run behind until the
//! rank's last request leaves and its aggregate goes whole.

use std::collections::HashMap;

/// Hash maps keyed by chained block ids: already well-mixed 64-bit values, hashed on
/// every booking, free and candidate check, so the hasher is foldhash's fast one
/// (seeded per process) rather than SipHash, which dominated the scheduler's profile.
pub(super) type BlockIdMap<V> = HashMap<u64, V, foldhash::fast::RandomState>;

/// Consecutive held ids that the same requests cover.
#[derive(Debug, Clone, Default)]
struct Run {
    /// The ids, in prompt order; never empty while the run is live.
    ids: Vec<u64>,
    /// In-flight requests whose prompt covers the whole run.
    count: u32,
}

/// The chained block ids held by one rank's in-flight requests.
#[derive(Debug, Clone, Default)]
pub(crate) struct InFlightBlocks {
    /// Live runs by their first id.
    starts: BlockIdMap<u32>,
    /// Runs by index; freed ones are listed in `free` and reused.
    runs: Vec<Run>,
    free: Vec<u32>,
    /// Σ lengths of the live runs: the distinct ids held.
    held_ids: usize,
}

impl InFlightBlocks {
    /// Distinct blocks held.
    pub(crate) fn len(&self) -> usize {
        self.held_ids
    }

    /// Runs the tables can hold without growing.
    pub(crate) fn capacity(&self) -> usize {
        self.starts.capacity().max(self.runs.capacity())
    }

    /// Forgets every block, keeping the tables' capacity.
    pub(crate) fn clear(&mut self) {
        self.starts.clear();
        self.runs.clear();
        self.free.clear();
        self.held_ids = 0;
    }

    /// The run starting at `ids[0]`, and how many leading ids of `ids` it holds (at
    /// least 1). Chained ids that agree at a position agree at every one before it,
    /// so the shared length is found by binary search (a shared prompt may be held by
    /// many ranks, each checked per decision).
    fn run_at(&self, ids: &[u64]) -> Option<(u32, usize)> {
        let &r = self.starts.get(ids.first()?)?;
        // `starts` names live runs only (`drop_run` removes a run's key), never empty
        // ones; the check keeps a walk moving forward even if that were broken.
        let run = &self.runs.get(r as usize)?.ids;
        if run.is_empty() {
            return None;
        }
        let both = run.len().min(ids.len());
        // run[0] == ids[0] (the key); find the first position from which they differ.
        let (mut same, mut differs) = (1, both);
        while same < differs {
            let mid = same + (differs - same) / 2;
            if run[mid] == ids[mid] {
                same = mid + 1;
            } else {
                differs = mid;
            }
        }
        Some((r, same))
    }

    /// How many leading ids of `ids` (one prompt's chained ids) are held.
    pub(crate) fn held(&self, ids: &[u64]) -> usize {
        let mut at = 0;
        while let Some((r, same)) = self.run_at(&ids[at..]) {
            at += same;
            if same < self.runs[r as usize].ids.len() {
                break;
            }
        }
        at
    }

    /// Holds one more request's prompt, of chained ids `ids`.
    pub(crate) fn add(&mut self, ids: &[u64]) {
        let mut at = 0;
        while at < ids.len() {
            let Some((r, same)) = self.run_at(&ids[at..]) else {
                let tail = ids[at..].to_vec();
                self.held_ids += tail.len();
                self.insert(Run {
                    ids: tail,
                    count: 1,
                });
                return;
            };
            if same < self.runs[r as usize].ids.len() {
                self.split(r, same);
            }
            let run = &mut self.runs[r as usize];
            run.count = run.count.saturating_add(1);
            at += same;
        }
    }

    /// Releases one request's prompt, of chained ids `ids` (as given to
    /// [`Self::add`]): one less request on every run of its path; runs no request
    /// covers any more are dropped.
    pub(crate) fn remove(&mut self, ids: &[u64]) {
        let mut at = 0;
        while at < ids.len() {
            let Some((r, same)) = self.run_at(&ids[at..]) else {
                return;
            };
            let run = &mut self.runs[r as usize];
            if same < run.ids.len() {
                // Not a path this prompt was added along: nothing of it to release.
                return;
            }
            run.count = run.count.saturating_sub(1);
            if run.count == 0 {
                self.drop_run(r);
            }
            at += same;
        }
    }

    /// Stores a new run, keyed by its first id (which no live run starts with, unless
    /// crafted ids collide: then the older run is left unreachable until `clear`). An
    /// empty run is not stored.
    fn insert(&mut self, run: Run) {
        let Some(&first) = run.ids.first() else {
            return;
        };
        let r = match self.free.pop() {
            Some(r) => {
                self.runs[r as usize] = run;
                r
            }
            None => {
                self.runs.push(run);
                u32::try_from(self.runs.len() - 1).unwrap_or(u32::MAX)
            }
        };
        self.starts.insert(first, r);
    }

    /// Cuts run `r` after its first `at` ids (0 < `at` < its length); the rest becomes
    /// a run of its own, covered by the same requests.
    fn split(&mut self, r: u32, at: usize) {
        let run = &mut self.runs[r as usize];
        let rest = Run {
            ids: run.ids.split_off(at),
            count: run.count,
        };
        self.insert(rest);
    }

    /// Frees run `r`.
    fn drop_run(&mut self, r: u32) {
        let run = std::mem::take(&mut self.runs[r as usize]);
        self.held_ids = self.held_ids.saturating_sub(run.ids.len());
        if let Some(&first) = run.ids.first()
            && self.starts.get(&first) == Some(&r)
        {
            self.starts.remove(&first);
        }
        self.free.push(r);
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

    /// Live runs.
    fn runs(held: &InFlightBlocks) -> usize {
        held.starts.len()
    }

    #[test]
    fn a_prompts_own_tail_is_one_run_split_where_another_branches_off() {
        let mut held = InFlightBlocks::default();
        let long: Vec<u64> = (1..=1000).collect();
        held.add(&long);
        assert_eq!((held.len(), runs(&held)), (1000, 1));
        // Branches off after 600 ids: the run splits there, the new tail is one run.
        let mut branch: Vec<u64> = (1..=600).collect();
        branch.extend(5000..5400);
        assert_eq!(held.held(&branch), 600);
        held.add(&branch);
        assert_eq!((held.len(), runs(&held)), (1400, 3));
        assert_eq!(held.held(&branch), 1000);
        assert_eq!(held.held(&long), 1000);
        // Ends inside the shared part: one more split, no new ids.
        held.add(&long[..300]);
        assert_eq!((held.len(), runs(&held)), (1400, 4));
        held.remove(&long);
        assert_eq!(held.len(), 1000, "the branch keeps the shared 600");
        assert_eq!(held.held(&long), 600);
        held.remove(&branch);
        assert_eq!((held.len(), held.held(&long)), (300, 300));
        held.remove(&long[..300]);
        assert_eq!((held.len(), runs(&held)), (0, 0));
        // Two requests of one prompt, split by a third: both still cover the tail.
        held.add(&long);
        held.add(&long);
        held.add(&branch);
        held.remove(&long);
        assert_eq!(held.held(&long), 1000);
        held.remove(&long);
        held.remove(&branch);
        assert_eq!(held.len(), 0);
        // Freed slots are reused, not grown.
        let slots = held.runs.len();
        held.add(&long);
        held.add(&branch);
        assert_eq!(held.runs.len(), slots);
    }

    #[test]
    fn a_prompt_repeating_an_id_or_freed_unknown_does_not_panic() {
        let mut held = InFlightBlocks::default();
        held.add(&[1, 2, 1, 2]);
        held.add(&[1, 2, 1, 3]);
        held.add(&[2, 1, 3]);
        assert!(held.held(&[1, 2, 1, 2, 1, 2]) <= 6);
        held.remove(&[1, 2, 1, 3]);
        held.remove(&[2, 1, 3]);
        held.remove(&[1, 2, 1, 2]);
        held.remove(&[1, 2, 1, 2]);
        held.remove(&[8, 9]);
        held.remove(&[]);
        held.add(&[]);
        assert!(held.len() <= 8);
        held.clear();
        assert_eq!((held.len(), held.held(&[1, 2])), (0, 0));
    }
}
