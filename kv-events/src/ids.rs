//! Newtypes for ids and hashes.
//!
//! Every id that crosses the wire has its own type so that a worker id can never be
//! passed where a block hash is expected. All of them serialize transparently: a
//! `WorkerId(7)` is the msgpack integer `7`, which keeps the protocol easy to speak
//! from any language.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! int_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl From<$inner> for $name {
            fn from(value: $inner) -> Self {
                Self(value)
            }
        }
    };
}

int_newtype! {
    /// Identity of one engine instance (a worker). Chosen by the worker, unique in a
    /// namespace, and the key under which it registers in etcd.
    WorkerId(u64)
}

int_newtype! {
    /// Data-parallel rank inside one worker. Workers without data parallelism use rank 0.
    DpRank(u32)
}

int_newtype! {
    /// Hash of the tokens of one full KV block, computed on the router side with
    /// [`crate::hashing::hash_block`]. It does not chain over the prefix: the position
    /// of a block in the radix tree supplies the prefix.
    LocalBlockHash(u64)
}

int_newtype! {
    /// A KV cache group of a hybrid-attention model, as the engine numbers it (vLLM's
    /// `group_idx`): the layers of one attention kind whose KV blocks the engine
    /// allocates, caches and evicts together. Unique per worker rank.
    GroupId(u32)
}

int_newtype! {
    /// The engine's own (usually chained) hash of a block. Opaque to the router; used
    /// only to find a block's parent on `Stored` and the block itself on `Removed`.
    ExternalBlockHash(u64)
}

/// A (worker, dp_rank) pair: the unit the indexer scores and the scheduler selects.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
pub struct WorkerRank {
    /// The worker.
    pub worker_id: WorkerId,
    /// The data-parallel rank inside that worker.
    pub dp_rank: DpRank,
}

impl WorkerRank {
    /// Builds the pair.
    pub fn new(worker_id: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }
}

impl fmt::Display for WorkerRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}

/// Identity of one inference request, chosen by the frontend (for example a UUID).
/// It ties a route decision to its later lifecycle messages.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub String);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestId {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl From<String> for RequestId {
    fn from(value: String) -> Self {
        Self(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    fn round_trip<T>(value: T)
    where
        T: Serialize + for<'de> Deserialize<'de> + PartialEq + fmt::Debug,
    {
        let bytes = encode(&value).expect("encode");
        let back: T = decode(&bytes).expect("decode");
        assert_eq!(back, value);
    }

    #[test]
    fn newtypes_round_trip_through_msgpack() {
        round_trip(WorkerId(u64::MAX));
        round_trip(DpRank(3));
        round_trip(LocalBlockHash(0x8000_0000_0000_0001));
        round_trip(ExternalBlockHash(u64::MAX - 1));
        round_trip(WorkerRank::new(WorkerId(9), DpRank(2)));
        round_trip(RequestId::from("req-1"));
    }

    #[test]
    fn newtypes_are_transparent_on_the_wire() {
        // A WorkerId is a plain msgpack integer, so other languages can send `7`.
        assert_eq!(
            encode(&WorkerId(7)).unwrap(),
            rmp_serde::to_vec(&7u64).unwrap()
        );
        assert_eq!(
            encode(&RequestId::from("a")).unwrap(),
            rmp_serde::to_vec("a").unwrap()
        );
    }
}
