//! Workloads for the indexer benches, shared by `indexer`'s own bench
//! (`indexer/benches/indexer`) and the side-by-side bench against Dynamo's indexer
//! (`benches/peer-dynamo`), so both measure the same traffic.
//!
//! - [`synthetic`]: deterministic prefix-caching traffic (shared system-prompt
//!   prefixes, chains of `Stored` events continuing them), with engine hashes chained
//!   as vLLM/SGLang publish them, optionally salted per worker ([`EngineHashes`]);
//!   plus the `Stored`/`Removed` flood of the latency benches.
//! - [`measure`]: latency percentiles and the resident set size.
//! - [`reference`](mod@reference): [`Reference`], a deliberately simple model of "which worker holds
//!   which prefix" (hash maps keyed by the whole prefix), which the benches check every
//!   query answer against.
//!
//! Not part of the product: nothing here is published or used by the daemon.

pub mod measure;
pub mod reference;
pub mod synthetic;

pub use measure::{latencies, percentiles, quantile_ms, rss_bytes};
pub use reference::Reference;
pub use synthetic::{
    EngineHashes, Rng, Workload, WorkloadShape, build, flood_batches, flood_batches_of,
};
