//! The alternates of a decision ([`crate::Selection::fallbacks`]): where the request
//! would go if the chosen worker failed, for a proxy that retries down an ordered list
//! (GAIE's endpoint-picker protocol) without asking the router again.
//!
//! Ranked by the cost the choice itself used, read back from the selector after the
//! choice (`kv`, `predicted-ttft`: the candidate's cost; `kv-normalized`: its score,
//! ranks over their fair share left out, as the policy leaves them out); policies
//! without a per-rank cost (`round-robin`, `random`, `least-loaded`,
//! `cache-aware-threshold`) rank alternates by booked load, as `least-loaded` does.
//! Exact ties go to the lower (worker, dp_rank), so the list is reproducible. One
//! entry per worker (its best rank): a retry goes to another pod, never to another
//! rank of the pod that just failed. A request asking for fallbacks takes the full
//! candidate scan (`shortcut.rs`), so every alternate is priced; the ranking then
//! costs O(c log c) for `c` candidates, only when asked.

use crate::Scheduler;
use crate::policy::PolicyConfig;
use crate::policy::baseline::load_blocks;
use crate::request::{Fallback, Fallbacks, ScheduleRequest};
use kv_events::routing::MAX_FALLBACKS;

impl Scheduler {
    /// Up to `req.fallbacks` alternates to candidate `chosen` of the last selection
    /// under `policy`, best first, one per worker, none on the chosen worker.
    pub(crate) fn fallbacks(
        &self,
        policy: &PolicyConfig,
        chosen: usize,
        req: &ScheduleRequest,
    ) -> Fallbacks {
        let mut out = Fallbacks::default();
        let want = usize::from(req.fallbacks.min(MAX_FALLBACKS));
        if want == 0 {
            return out;
        }
        let block_size = req.shape().block_size;
        let by_cost = matches!(
            policy,
            PolicyConfig::Kv(_) | PolicyConfig::KvNormalized(_) | PolicyConfig::PredictedTtft(_)
        );
        let worker = self.candidates[chosen].rank.worker_id;
        let other = |i: &usize| {
            self.candidates
                .get(*i)
                .is_some_and(|c| c.rank.worker_id != worker)
        };
        let mut ranked: Vec<((f64, f64), usize)> = if by_cost {
            self.selector
                .priced(policy)
                .filter(|(i, _)| other(i))
                .map(|(i, cost)| ((cost, 0.0), i))
                .collect()
        } else {
            (0..self.candidates.len())
                .filter(other)
                .map(|i| {
                    let c = &self.candidates[i];
                    let key = (load_blocks(c, block_size), c.load.active_requests as f64);
                    (key, i)
                })
                .collect()
        };
        // Equal keys go to the lower index, which is the lower rank (candidates are
        // in rank order).
        ranked.sort_unstable_by(|a, b| {
            (a.0.0.total_cmp(&b.0.0))
                .then(a.0.1.total_cmp(&b.0.1))
                .then(a.1.cmp(&b.1))
        });
        for (_, i) in ranked {
            let c = &self.candidates[i];
            if out.iter().any(|f| f.rank.worker_id == c.rank.worker_id) {
                continue;
            }
            out.push(Fallback {
                rank: c.rank,
                overlap_blocks: c.overlap_blocks,
            });
            if out.len() == want {
                break;
            }
        }
        out
    }
}
