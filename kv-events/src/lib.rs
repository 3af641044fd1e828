//! Wire protocol of kv-router: ids, KV events, load metrics, routing and lifecycle
//! messages, block hashing, the msgpack codec and NATS subject names.
//!
//! This crate is deliberately free of any async runtime so that engine integrations,
//! offline simulators and frontends can depend on it without pulling in tokio.
//! Everything that crosses a process boundary is defined here, in one place, and
//! `docs/protocol.md` documents the same shapes for clients in other languages.
//!
//! # Layout
//! - [`ids`]: newtypes for every id and hash (`WorkerId`, `DpRank`, `LocalBlockHash`, ...).
//! - [`events`]: KV cache events (`Stored`, `Removed`, `Cleared`) and the per-worker batch.
//! - [`metrics`]: per (worker, dp_rank) load metrics published by engines.
//! - [`routing`]: route request / reply (single and batch) and request lifecycle
//!   messages.
//! - [`replicas`]: sequence-sync messages between router replicas ([`RouterId`]),
//!   and the start-up snapshot of a replica's bookings.
//! - [`discovery`]: the worker registration record stored in etcd.
//! - [`disaggregation`]: prefill/decode roles, the router's pair decision, and the
//!   booking id of a prefill half.
//! - [`hashing`]: tokens → [`LocalBlockHash`] per full block (xxh3-64, seeded).
//! - [`codec`]: msgpack encode / decode with typed errors.
//! - [`limits`]: [`limits::Limits`], the bounds on every message from the network,
//!   checked before it allocates ([`limits::decode_within`]).
//! - [`recovery`]: gap recovery requests and replies, and the index snapshot format.
//! - [`journal`]: [`journal::EventJournal`], the publisher side of event numbering and
//!   recovery (ring buffer of recent events, held blocks, dumps).
//! - [`subjects`]: every NATS subject and etcd key, under one namespace.
//! - [`engines`]: decoders for vLLM and SGLang KV events (used by the relay).

pub mod codec;
pub mod disaggregation;
pub mod discovery;
pub mod engines;
pub mod events;
pub mod hashing;
pub mod ids;
pub mod journal;
pub mod limits;
pub mod metrics;
pub mod recovery;
pub mod replicas;
pub mod routing;
pub mod subjects;

pub use codec::{CodecError, decode, encode};
pub use events::{
    KvCacheEvent, KvCacheEventData, KvCacheGroup, KvEventBatch, StorageTier, StoredBlock,
};
pub use hashing::{BLOCK_HASH_SEED, compute_block_hashes, hash_block};
pub use ids::{
    DpRank, ExternalBlockHash, GroupId, LocalBlockHash, RequestId, WorkerId, WorkerRank,
};
pub use metrics::LoadMetrics;
pub use replicas::RouterId;
pub use subjects::{Namespace, NamespaceError, ROUTER_ID_HEADER, Subjects};
