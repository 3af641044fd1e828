//! The quickstart's fleet: one group of aggregated workers (`--workers`, the
//! default), or a disaggregated one (`--prefill-engines N --decode-engines M`): N
//! prefill workers then M decode workers of one transfer protocol (`--kv-transfer`),
//! each group one `kv-mocker engines` process started in its role, and in vLLM mode
//! each worker's relay registering that role.

use super::QuickstartArgs;
use kv_cluster::args::TransferFlag;

/// The first worker id of the fleet (`kv-mocker engines`' `--first-worker-id` default).
const FIRST_WORKER_ID: u64 = 1;

/// A worker's role in the quickstart's fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// Whole requests.
    Aggregated,
    /// Prefill halves, joined by `protocol`.
    Prefill(TransferFlag),
    /// Decode halves, joined by `protocol`.
    Decode(TransferFlag),
}

/// One `kv-mocker engines` process: its workers and their role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Group {
    /// Its log label and its workers' name prefix (`engine`, `prefill`, `decode`).
    pub label: &'static str,
    /// How many workers.
    pub workers: u32,
    /// The first worker's id; the others follow.
    pub first_worker_id: u64,
    /// Their role.
    pub role: Role,
}

impl Group {
    /// Whether its workers serve SGLang bootstrap rooms (one port each).
    pub fn bootstrap(&self) -> bool {
        self.role == Role::Prefill(TransferFlag::Sglang)
    }

    /// The role flags of `kv-mocker engines` (`bootstrap_port` the first worker's)
    /// or of the relay of one worker (`bootstrap_port` its own): none for an
    /// aggregated worker.
    pub fn role_flags(&self, bootstrap_port: Option<u16>) -> Vec<String> {
        let (role, protocol) = match self.role {
            Role::Aggregated => return Vec::new(),
            Role::Prefill(protocol) => ("prefill", protocol),
            Role::Decode(protocol) => ("decode", protocol),
        };
        let protocol = match protocol {
            TransferFlag::Vllm => "vllm",
            TransferFlag::Sglang => "sglang",
        };
        let mut flags = ["--role", role, "--kv-transfer", protocol]
            .map(str::to_owned)
            .to_vec();
        if let Some(port) = bootstrap_port.filter(|_| self.bootstrap()) {
            flags.extend(["--bootstrap-port".to_owned(), port.to_string()]);
        }
        flags
    }
}

/// The groups `args` ask for, in worker-id order.
pub(super) fn groups(args: &QuickstartArgs) -> Vec<Group> {
    match (args.prefill_engines, args.decode_engines) {
        (Some(prefill), Some(decode)) => vec![
            Group {
                label: "prefill",
                workers: prefill,
                first_worker_id: FIRST_WORKER_ID,
                role: Role::Prefill(args.kv_transfer),
            },
            Group {
                label: "decode",
                workers: decode,
                first_worker_id: FIRST_WORKER_ID + u64::from(prefill),
                role: Role::Decode(args.kv_transfer),
            },
        ],
        _ => vec![Group {
            label: "engine",
            workers: args.workers,
            first_worker_id: FIRST_WORKER_ID,
            role: Role::Aggregated,
        }],
    }
}
