//! Deliberate misconfigurations of the mock workers, all off by default. Each makes a
//! worker look like a real deployment whose cache picture is wrong in one known way,
//! so the gateway's cache-parity monitor (`kv-gateway`, module `parity`) can be tested
//! against it with everything else real.

use kv_events::{LocalBlockHash, compute_block_hashes};

/// Flags of deliberate misconfigurations (none by default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::Args)]
pub struct FaultArgs {
    /// Register this block size, in tokens, in etcd instead of the engine's
    /// `--block-size`, as a publisher configured with the wrong size would (NATS
    /// mode; in vLLM mode the relay registers the size the engine's `/metrics` says).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub registered_block_size: Option<u32>,
    /// Mix this salt into the block hashes an HTTP request's prompt is cached and
    /// published by, as an engine hashing with another seed would: the engine's own
    /// prefix cache works, its KV events never match the router's hashes (NATS mode;
    /// in vLLM mode the relay hashes the events' token ids itself).
    #[arg(long)]
    pub block_hash_salt: Option<u64>,
}

impl FaultArgs {
    /// The block size to register for an engine of `block_size` tokens per block.
    pub fn registered_block_size(&self, block_size: u32) -> u32 {
        self.registered_block_size.unwrap_or(block_size)
    }

    /// The hashes of the full blocks of `tokens`: the protocol's, salted with
    /// `--block-hash-salt` when given (XOR keeps distinct blocks distinct).
    pub fn block_hashes(&self, tokens: &[u32], block_size: u32) -> Vec<LocalBlockHash> {
        let hashes = compute_block_hashes(tokens, block_size);
        match self.block_hash_salt {
            None => hashes,
            Some(salt) => hashes
                .into_iter()
                .map(|h| LocalBlockHash(h.0 ^ salt))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_off_by_default_and_a_salt_changes_every_hash() {
        let tokens: Vec<u32> = (0..40).collect();
        let off = FaultArgs::default();
        assert_eq!(
            off.block_hashes(&tokens, 16),
            compute_block_hashes(&tokens, 16)
        );
        assert_eq!(off.registered_block_size(16), 16);
        let on = FaultArgs {
            registered_block_size: Some(32),
            block_hash_salt: Some(7),
        };
        assert_eq!(on.registered_block_size(16), 32);
        let salted = on.block_hashes(&tokens, 16);
        assert_eq!(salted.len(), 2);
        for (s, h) in salted.iter().zip(compute_block_hashes(&tokens, 16)) {
            assert_ne!(*s, h);
        }
    }
}
