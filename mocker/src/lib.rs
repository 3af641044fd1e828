//! Mock inference engine, Mooncake trace replay and a local-cluster quickstart.
//!
//! The mock engine stands in for vLLM / SGLang so the router can be exercised end to
//! end without GPUs: it keeps a paged KV cache with prefix reuse and LRU eviction,
//! publishes real KV events and load metrics to NATS, registers in etcd under a lease,
//! and answers generate requests on a documented timing model. The replay plays the
//! frontend's role for a real request trace, and the quickstart wires real
//! nats-server and etcd processes (from the `testbed` crate), the router daemon and
//! mock engines together. The engine model itself (KV cache, batching, timing) and the
//! trace loader are the `engine_model` crate's.
//!
//! # Layout
//! - [`protocol`]: the generate / clear request protocol between frontend and engine.
//! - [`engine`]: the engine service: M workers of the model behind NATS, etcd and HTTP.
//! - [`replay`]: the frontend role: route, generate, lifecycle, and the JSON report.
//! - [`quickstart`]: the README's first command, end to end.
//!
//! `kv-mocker lab` dispatches to the `kv_lab` crate (the offline routing-quality lab).

pub mod engine;
pub mod protocol;
pub mod quickstart;
pub mod replay;
