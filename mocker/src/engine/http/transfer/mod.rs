//! The two halves of a disaggregated request, as an engine in the `prefill` or
//! `decode` role sees them: the request's transfer fields are checked against the
//! worker's role and protocol and turned into a [`Plan`], which `run` carries out.
//!
//! - **vLLM** (`--kv-transfer vllm`, the proxy protocol of vLLM's NIXL connector): a
//!   prefill worker given `kv_transfer_params.do_remote_decode: true` prefills as
//!   usual (its blocks stored and published) and answers with the
//!   `kv_transfer_params` a decode worker needs (`do_remote_prefill: true`, its
//!   engine id, address and the prompt's block ids). A decode worker given those
//!   does not prefill: it waits the transfer time of the blocks it does not cache,
//!   stores them (`BlockStored`, as vLLM's decode instance publishes them) and
//!   decodes.
//! - **SGLang** (`--kv-transfer sglang`): both workers get `bootstrap_host`,
//!   `bootstrap_port` and `bootstrap_room`. The prefill worker prefills (one token,
//!   whatever `max_tokens` says) and marks the room ready on its bootstrap server
//!   ([`rooms`]); the decode worker long-polls that room (up to
//!   `--bootstrap-timeout-ms`), then pulls and decodes as above.
//!
//! A worker in role `both` ignores every transfer field, as vLLM without a KV
//! connector does; prefill and decode workers serve requests without them as
//! ordinary requests (the router's conditional disaggregation). Everything else is
//! a 400 naming the field: wrong types, arrays longer than the prompt, strings over
//! [`MAX_FIELD_BYTES`], a half sent to the wrong role or in the other protocol, or
//! `remote_block_ids` (or a room) of another prompt: the mock's block ids are the
//! prompt's chained block hashes, so a decode worker can tell (a real vLLM sends
//! its physical block numbers and cannot). Nothing here panics on input.
//!
//! Cost: the fields are parsed once per request (bounded by the 4 MiB body limit);
//! a decode worker's wait is one timer, an SGLang decode's one HTTP long-poll.

mod parse;
pub(in crate::engine) mod rooms;
mod run;

pub(super) use run::serve;

use engine_model::KvTransferConfig;
use kv_cluster::args::WorkerPlacement;
use rooms::Rooms;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use crate::engine::config::RuntimeArgs;

/// Longest string a transfer field may hold, in bytes (engine ids, host names).
pub const MAX_FIELD_BYTES: usize = 256;

/// What one worker's HTTP front end needs to serve its half of disaggregated
/// requests.
#[derive(Debug)]
pub(in crate::engine) struct TransferSide {
    /// The worker's registered role and transfer (`kv_transfer` is `None` for role
    /// `both`: every transfer field ignored); an SGLang prefill worker's own
    /// bootstrap port is its `kv_transfer.bootstrap_port`.
    pub placement: WorkerPlacement,
    /// The rooms its bootstrap server serves (SGLang prefill workers).
    pub rooms: Option<Arc<Rooms>>,
    /// What a transfer costs.
    pub cost: KvTransferConfig,
    /// Model time to wall time.
    pub runtime: RuntimeArgs,
    /// An SGLang decode worker's wait for its room.
    pub bootstrap_timeout: Duration,
    /// The worker's advertised host and HTTP port (`remote_host`/`remote_port`).
    pub host: String,
    /// See `host`.
    pub port: u16,
    /// The client an SGLang decode worker polls bootstrap servers with (none for
    /// other workers).
    pub client: Option<reqwest::Client>,
    /// Cancelled when the engines stop: waits end with 503.
    pub shutdown: CancellationToken,
}

/// What to do with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Plan {
    /// Prefill and decode here, as an aggregated engine does.
    Local,
    /// vLLM prefill for a remote decode: answer with `kv_transfer_params`.
    RemoteDecode,
    /// vLLM decode of a prompt prefilled elsewhere, whose block ids are these.
    RemotePrefill {
        /// `kv_transfer_params.remote_block_ids`.
        block_ids: Vec<u64>,
    },
    /// SGLang prefill: one token, then the room is ready.
    BootstrapPrefill {
        /// `bootstrap_room`.
        room: u64,
    },
    /// SGLang decode: wait for the room on the prefill worker's bootstrap server.
    BootstrapDecode {
        /// `bootstrap_host`.
        host: String,
        /// `bootstrap_port`.
        port: u16,
        /// `bootstrap_room`.
        room: u64,
    },
}

/// The id a prefill worker's answer gives its engine: worker and dp rank, as vLLM
/// suffixes its engine id per data-parallel rank.
pub(super) fn engine_id(worker: kv_events::WorkerId, rank: usize) -> String {
    format!("kv-mocker-{worker}_dp{rank}")
}

/// The block ids of a prompt of `tokens` at `block_size` tokens per block, one per
/// block, the partial last one too: the chained hashes of its blocks, the ids a
/// prefill worker names and a decode worker checks.
pub(super) fn block_ids(tokens: &[u32], block_size: u32) -> Vec<u64> {
    let mut hashes = kv_events::compute_block_hashes(tokens, block_size);
    let tail = &tokens[hashes.len() * block_size as usize..];
    if !tail.is_empty() {
        hashes.push(kv_events::hash_block(tail));
    }
    engine_model::chain_block_hashes(&hashes)
        .iter()
        .map(|b| b.block_hash.0)
        .collect()
}
