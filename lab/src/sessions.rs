//! Sessions derived from a trace's prefix chains, for measuring session affinity on a
//! trace that carries no session ids (the Mooncake conversation trace).
//!
//! Mooncake's `hash_ids` name prefix blocks of 512 tokens: equal ids mean an equal
//! prefix up to and including that block. A conversation's next turn repeats the
//! previous turns' blocks and appends new ones, so it continues an earlier chain. But
//! every conversation also starts with shared system-prompt blocks, which continue
//! nothing of one conversation. The rule:
//!
//! 1. A block is *shared* when at least [`SHARED_FANOUT`] distinct blocks follow it
//!    somewhere in the trace (the system prompt). In the conversation trace only
//!    block 0 is: 7,373 distinct blocks follow it; the next most, 11 (a conversation
//!    whose turns branch).
//! 2. In arrival order, for request `R`: `k` is the number of its leading blocks some
//!    earlier request carried (its longest common prefix with the trace so far), `c`
//!    the number of its leading shared blocks.
//! 3. If `k > c` — `R` continues an earlier chain beyond the shared head — `R` joins
//!    the session of the latest request that carried block `k − 1`. Otherwise it
//!    starts a new session.
//!
//! Cost: two passes, one hash lookup per block, one map entry per distinct block.

use engine_model::trace::TraceRequest;
use std::collections::{HashMap, HashSet};

/// Distinct following blocks that make a block shared (a system prompt).
pub const SHARED_FANOUT: usize = 64;

/// The session number of every request of `trace` (module docs give the rule),
/// numbered from 0 in order of first arrival.
pub fn derive(trace: &[TraceRequest]) -> Vec<u32> {
    let mut followers: HashMap<u64, HashSet<u64>> = HashMap::new();
    for request in trace {
        for pair in request.hash_ids.windows(2) {
            followers.entry(pair[0]).or_default().insert(pair[1]);
        }
    }
    let shared = |id: &u64| followers.get(id).is_some_and(|f| f.len() >= SHARED_FANOUT);
    let mut latest: HashMap<u64, u32> = HashMap::new();
    let mut next = 0u32;
    trace
        .iter()
        .map(|request| {
            let ids = &request.hash_ids;
            let seen = ids.iter().take_while(|id| latest.contains_key(id)).count();
            let head = ids.iter().take_while(|id| shared(id)).count();
            let session = match seen.checked_sub(1) {
                Some(last) if seen > head => latest[&ids[last]],
                _ => {
                    next += 1;
                    next - 1
                }
            };
            for &id in ids {
                latest.insert(id, session);
            }
            session
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(hash_ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp_ms: 0,
            input_length: 512 * hash_ids.len() as u64,
            output_length: 1,
            hash_ids: hash_ids.to_vec(),
        }
    }

    #[test]
    fn turns_that_continue_a_chain_beyond_the_system_prompt_share_a_session() {
        // Block 0 is followed by SHARED_FANOUT distinct blocks: a system prompt.
        let mut trace: Vec<TraceRequest> = (0..SHARED_FANOUT as u64)
            .map(|i| req(&[0, 1_000 + i]))
            .collect();
        let first = trace.len() as u32;
        trace.extend([
            req(&[0, 1, 2]),        // conversation A, turn 1
            req(&[0, 3, 4]),        // B: shares only the system prompt block 0
            req(&[0, 1, 2, 5, 6]),  // A, turn 2
            req(&[0, 7]),           // C: only the (now shared) system prompt
            req(&[0, 3, 8]),        // B, turn 2 (diverges after B's block 3)
            req(&[9]),              // D: nothing seen
            req(&[0, 1, 2, 5, 10]), // A, turn 3
        ]);
        let sessions = derive(&trace);
        assert_eq!(
            sessions[..first as usize],
            (0..first).collect::<Vec<_>>(),
            "requests sharing only the system prompt are sessions of their own"
        );
        let f = first;
        assert_eq!(
            sessions[first as usize..],
            [f, f + 1, f, f + 2, f + 1, f + 3, f]
        );
    }
}
