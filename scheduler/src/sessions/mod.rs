//! Session affinity: keep a conversation's turns on the rank that served its last
//! turn, unless another rank is cheaper by a margin.
//!
//! Why: the next turn of a conversation extends the last turn's prompt, so the rank
//! that served it holds the longest prefix. The prefix index usually sees that
//! already, but not always: KV events lag behind the engine (under load the next turn
//! arrives before the last turn's blocks are indexed), and a cache that evicted the
//! prefix — or offloaded it where the index does not look — leaves every rank level
//! on overlap. A session id says what the index cannot: these requests belong
//! together. Frontends opt in per request (`RouteRequest::session_id`, the gateway's
//! `x-session-id` header); requests without one are routed as before.
//!
//! The rule ([`SessionTable::steer`]): the policy picks a rank as usual. If the
//! session's last rank is a candidate (registered, allowed, not busy, not silent) and
//! the policy priced it, the request goes there unless the policy's pick is cheaper
//! by more than the margin: [`SessionConfig::margin_ms`] of predicted TTFT under
//! `predicted-ttft`, or the share [`SessionConfig::relative_margin`] of the last
//! rank's cost under `kv` and `kv-normalized` (and for the decode rank of a request
//! placed as a prefill/decode pair, whose cost is a KV fill level,
//! [`crate::disaggregation::decode_cost`]). Policies without per-rank costs
//! (`cache-aware-threshold` and the baselines) decide alone. The rank that serves the
//! request becomes the session's last rank. Dynamo's router pins a session to a
//! worker outright (hard affinity, later a soft mode); SGLang's model gateway hashes
//! or maps a routing-key header to a worker without looking at load. A margin keeps
//! the pin soft: a hot session cannot pile onto an overloaded rank.
//!
//! Cost: one hash lookup and one `BTreeMap` update per request with a session id.
//! Memory is bounded by [`SessionConfig::capacity`] entries, least recently used
//! evicted first; an entry holds the id twice (hash key and LRU order) plus ~100
//! bytes, so 65,536 sessions of 36-byte UUIDs hold about 11 MiB, and at most 45 MiB
//! with 256-byte ids. An entry unused for [`SessionConfig::ttl`] is forgotten. A
//! departed worker (or a vanished rank) drops its sessions, O(sessions).

use crate::duration_ms;
use crate::error::SchedulerError;
use crate::policy::Candidate;
pub use crate::request::SessionOutcome;
use kv_events::routing::{PolicyKind, SessionId};
use kv_events::{WorkerId, WorkerRank};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Settings of session affinity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    /// Whether requests with a session id prefer their session's last rank. Off, the
    /// id is ignored and no table is kept. Default true (only requests that carry a
    /// session id are affected).
    pub enabled: bool,
    /// Most sessions remembered; the least recently used is forgotten first. At least
    /// 1. Default 65,536 (about 11 MiB with UUID ids, see the module docs).
    pub capacity: usize,
    /// A session unused this long is forgotten. At least 1 ms. Default 10 min (as the
    /// request TTL; SGLang's sticky policy also idles sessions out after 10 min).
    #[serde(rename = "ttl_ms", with = "duration_ms")]
    pub ttl: Duration,
    /// `predicted-ttft`: the session's last rank is left only for a rank whose
    /// predicted TTFT is lower by more than this, in ms. Finite and ≥ 0. Default 50
    /// ms (about two 512-token blocks of prefill at the default step-time model).
    pub margin_ms: f64,
    /// `kv`, `kv-normalized`: the session's last rank is left only for a rank whose
    /// cost is lower by more than this share of the last rank's cost (dimensionless,
    /// in [0, 1]; 0 follows the policy's pick). Default 0.25: in the lab (8 workers,
    /// the conversation trace, seeds 1, 2 and 42) it beat 0.1 on mean TTFT at 1× and
    /// 4× arrivals, and on p99 in five of six runs (`docs/studies/tiers-and-sessions.md`, "Session
    /// affinity").
    pub relative_margin: f64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            capacity: 65_536,
            ttl: Duration::from_secs(600),
            margin_ms: 50.0,
            relative_margin: 0.25,
        }
    }
}

impl SessionConfig {
    /// Checks every field.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] naming the field (`sessions.<field>`).
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let invalid = |field, reason: &str| SchedulerError::InvalidConfig {
            field,
            reason: reason.into(),
        };
        if self.capacity == 0 {
            return Err(invalid("sessions.capacity", "must be at least 1"));
        }
        if self.ttl < Duration::from_millis(1) {
            return Err(invalid("sessions.ttl_ms", "must be at least 1 ms"));
        }
        if !(self.margin_ms.is_finite() && self.margin_ms >= 0.0) {
            return Err(SchedulerError::InvalidConfig {
                field: "sessions.margin_ms",
                reason: format!("must be finite and >= 0, got {}", self.margin_ms),
            });
        }
        if !(0.0..=1.0).contains(&self.relative_margin) {
            return Err(SchedulerError::InvalidConfig {
                field: "sessions.relative_margin",
                reason: format!("must be within [0, 1], got {}", self.relative_margin),
            });
        }
        Ok(())
    }
}

/// What a decision's costs measure, which picks the margin session affinity
/// compares them with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostScale {
    /// Predicted milliseconds (`predicted-ttft`): [`SessionConfig::margin_ms`].
    Ms,
    /// A cost whose ratios are meaningful (`kv`, `kv-normalized`, a disaggregated
    /// request's decode cost): [`SessionConfig::relative_margin`].
    Relative,
    /// No per-candidate costs (`cache-aware-threshold`, the baselines): the pick
    /// stands.
    Unpriced,
}

impl From<PolicyKind> for CostScale {
    fn from(kind: PolicyKind) -> Self {
        match kind {
            PolicyKind::PredictedTtft => CostScale::Ms,
            PolicyKind::Kv | PolicyKind::KvNormalized => CostScale::Relative,
            _ => CostScale::Unpriced,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    rank: WorkerRank,
    last_used: Instant,
    /// Position in the LRU order (`SessionTable::order`), unique and increasing.
    seq: u64,
}

/// The bounded session → last rank table (module docs give the rule and the cost).
#[derive(Debug)]
pub struct SessionTable {
    config: SessionConfig,
    entries: HashMap<SessionId, Entry>,
    /// Least recently used first.
    order: BTreeMap<u64, SessionId>,
    next_seq: u64,
}

impl SessionTable {
    /// An empty table.
    pub fn new(config: SessionConfig) -> Self {
        Self {
            config,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next_seq: 0,
        }
    }

    /// Sessions held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no session is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The rank that served `id` last, if the session is known and was used within
    /// the TTL at `now` (an expired entry is dropped).
    pub fn last_rank(&mut self, id: &SessionId, now: Instant) -> Option<WorkerRank> {
        let entry = *self.entries.get(id)?;
        if self.expired(&entry, now) {
            self.order.remove(&entry.seq);
            self.entries.remove(id);
            return None;
        }
        Some(entry.rank)
    }

    /// Records that `rank` served `id` at `now`: the session becomes the most
    /// recently used. Forgets expired sessions, then the least recently used ones
    /// beyond the capacity. No-op when affinity is off.
    pub fn record(&mut self, id: &SessionId, rank: WorkerRank, now: Instant) {
        if !self.config.enabled {
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = Entry {
            rank,
            last_used: now,
            seq,
        };
        match self.entries.get_mut(id) {
            Some(old) => {
                let old_seq = std::mem::replace(old, entry).seq;
                if let Some(key) = self.order.remove(&old_seq) {
                    self.order.insert(seq, key);
                }
            }
            None => {
                self.entries.insert(id.clone(), entry);
                self.order.insert(seq, id.clone());
            }
        }
        self.expire(now);
        while self.entries.len() > self.config.capacity {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.entries.remove(&oldest);
        }
    }

    /// Forgets every session unused for the TTL at `now`; returns how many. Amortized
    /// O(1) per session: the LRU order is also the order of last use.
    pub fn expire(&mut self, now: Instant) -> usize {
        let mut dropped = 0;
        while let Some((&seq, id)) = self.order.first_key_value() {
            match self.entries.get(id) {
                Some(entry) if !self.expired(entry, now) => break,
                _ => {}
            }
            if let Some(id) = self.order.remove(&seq) {
                self.entries.remove(&id);
                dropped += 1;
            }
        }
        dropped
    }

    /// Forgets the sessions whose last rank is on `worker` (its lease ended);
    /// returns how many. O(sessions).
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        self.remove_ranks(|rank| rank.worker_id == worker)
    }

    /// Forgets the sessions whose last rank satisfies `gone`; returns how many.
    pub fn remove_ranks(&mut self, gone: impl Fn(WorkerRank) -> bool) -> usize {
        let before = self.entries.len();
        let order = &mut self.order;
        self.entries.retain(|_, entry| {
            let keep = !gone(entry.rank);
            if !keep {
                order.remove(&entry.seq);
            }
            keep
        });
        before - self.entries.len()
    }

    /// Applies the affinity rule to one decision: `chosen` is the pick among
    /// `candidates`, `cost_of(i)` the cost of candidate `i` (lower is better; `None`
    /// when it is not priced) on `scale` (a [`PolicyKind`] converts to its policy's
    /// scale). Returns the index to book and what affinity did; `None` for a request
    /// without a session id or with affinity off.
    pub fn steer(
        &mut self,
        id: Option<&SessionId>,
        scale: impl Into<CostScale>,
        chosen: usize,
        candidates: &[Candidate],
        cost_of: impl Fn(usize) -> Option<f64>,
        now: Instant,
    ) -> (usize, Option<SessionOutcome>) {
        let Some(id) = id.filter(|_| self.config.enabled) else {
            return (chosen, None);
        };
        let last = self
            .last_rank(id, now)
            .and_then(|rank| candidates.iter().position(|c| c.rank == rank));
        let Some(last) = last else {
            return (chosen, Some(SessionOutcome::Miss));
        };
        if last == chosen {
            return (chosen, Some(SessionOutcome::Hit));
        }
        let (Some(kept), Some(best)) = (cost_of(last), cost_of(chosen)) else {
            return (chosen, Some(SessionOutcome::Miss));
        };
        let bar = match scale.into() {
            CostScale::Ms => kept - self.config.margin_ms,
            CostScale::Relative => kept * (1.0 - self.config.relative_margin),
            CostScale::Unpriced => return (chosen, Some(SessionOutcome::Miss)),
        };
        if best < bar {
            (chosen, Some(SessionOutcome::Override))
        } else {
            (last, Some(SessionOutcome::Hit))
        }
    }

    fn expired(&self, entry: &Entry, now: Instant) -> bool {
        now.saturating_duration_since(entry.last_used) >= self.config.ttl
    }
}

#[cfg(test)]
mod tests;
