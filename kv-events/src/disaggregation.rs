//! Prefill/decode disaggregation on the wire: a worker's role in discovery, the
//! router's decision for one request, and the booking of a request's prefill half.
//!
//! A disaggregated fleet runs a prompt's prefill on one engine (a *prefill* worker)
//! and its decode on another (a *decode* worker), which loads the prompt's KV blocks
//! from the first over a transfer (vLLM's NIXL or another KV connector, SGLang's
//! Mooncake or NIXL backends). The router picks both: the prefill worker by KV
//! overlap and prefill load, the decode worker by decode load and free KV capacity.
//! It may also decide that the decode worker prefills the prompt itself
//! (*conditional disaggregation*): when the part it does not cache is short, or it
//! already holds most of the prefix, a transfer costs more than it saves.
//!
//! Everything here is optional on the wire and compatible both ways: a registration
//! without `role` is `both` (an aggregated worker, as before), a route request that
//! does not set `allow_disaggregation` is routed to one worker as before, and a reply
//! without `disaggregation` names one worker.
//!
//! # The two bookings of a disaggregated request
//! The router books the decode half under the request's own id and the prefill half
//! under [`prefill_booking_id`] (the id followed by [`PREFILL_BOOKING_SUFFIX`]), so
//! each half has its own load and lifecycle in the router's write model and in the
//! sequence sync between replicas, which carry bookings by id. The frontend sends
//! lifecycle messages for the request's own id only; the router applies them to both
//! halves:
//!
//! | lifecycle event | decode half (`{id}`) | prefill half (`{id}#prefill`) |
//! |---|---|---|
//! | `remote_prefill_done` (the prefill worker answered) | — | prefill tokens released, blocks held |
//! | `prefill_done` (first token from the decode worker: the transfer is over) | prefill done | freed |
//! | `keep_alive` | refreshed | refreshed |
//! | `freed` | freed | freed |
//!
//! A frontend's request id must therefore not end with [`PREFILL_BOOKING_SUFFIX`];
//! the router refuses one that does (`bad_request`).

use crate::ids::{DpRank, RequestId, WorkerId};
use serde::{Deserialize, Serialize};

/// What a worker does in a disaggregated fleet. On the wire `"prefill"`, `"decode"`
/// or `"both"`; absent means `both`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    /// Prefill and decode in one engine (an aggregated worker, the default). It serves
    /// whole requests; the router never makes it one half of a pair.
    #[default]
    Both,
    /// Prefill only: it computes prompts' KV and hands it to a decode worker. Whole
    /// requests are never routed to it.
    Prefill,
    /// Decode, loading the prompt's KV from a prefill worker; it also serves a whole
    /// request when the router decides the prompt is not worth a transfer.
    Decode,
}

impl WorkerRole {
    /// Whether whole requests, and decode halves, may be routed to this worker.
    pub fn decodes(self) -> bool {
        matches!(self, WorkerRole::Both | WorkerRole::Decode)
    }

    /// The wire name (`both`, `prefill`, `decode`).
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Both => "both",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a frontend joins the two halves of a disaggregated request: the protocol of
/// the engines' KV connector, as the frontend sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferProtocol {
    /// vLLM's KV connectors (NIXL, Mooncake, ...): first the prompt goes to the
    /// prefill worker with `kv_transfer_params: {"do_remote_decode": true}` and
    /// `max_tokens` 1; its answer's `kv_transfer_params` then go with the request to
    /// the decode worker.
    Vllm,
    /// SGLang's disaggregation: the request goes to both workers at once, each with
    /// `bootstrap_host`, `bootstrap_port` (the prefill worker's) and `bootstrap_room`
    /// (one random id per request); the decode worker's answer is the client's.
    Sglang,
}

impl TransferProtocol {
    /// The wire name (`vllm`, `sglang`).
    pub fn as_str(self) -> &'static str {
        match self {
            TransferProtocol::Vllm => "vllm",
            TransferProtocol::Sglang => "sglang",
        }
    }
}

/// What a frontend needs to run a transfer with a prefill or decode worker.
/// `{"protocol": "vllm"}` or `{"protocol": "sglang", "bootstrap_port": 8998}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvTransfer {
    /// The connector's protocol; the router pairs only workers of one protocol.
    pub protocol: TransferProtocol,
    /// SGLang prefill workers: the port of their bootstrap server (on the host of
    /// the registration's `url`). Required for an SGLang prefill worker, absent
    /// otherwise (not serialized when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

/// Why the router placed a request the way it did. On the wire in snake case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DisaggregationReason {
    /// Disaggregated: the decode worker would have to prefill more tokens than the
    /// router's local-prefill limit, and it does not hold enough of the prefix.
    LongUncached,
    /// Prefilled on the decode worker: the part it does not cache is at most the
    /// local-prefill limit (tokens).
    ShortUncached,
    /// Prefilled on the decode worker: it already holds at least the router's
    /// threshold fraction of the prompt's blocks.
    DecodeHoldsPrefix,
    /// Prefilled on the decode worker: prefill workers are registered, but none is
    /// eligible (busy, silent, excluded, of another transfer protocol, or without
    /// the pinned dp_rank).
    NoPrefillWorker,
}

impl DisaggregationReason {
    /// Every reason, in documentation order.
    pub const ALL: [DisaggregationReason; 4] = [
        DisaggregationReason::LongUncached,
        DisaggregationReason::ShortUncached,
        DisaggregationReason::DecodeHoldsPrefix,
        DisaggregationReason::NoPrefillWorker,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            DisaggregationReason::LongUncached => "long_uncached",
            DisaggregationReason::ShortUncached => "short_uncached",
            DisaggregationReason::DecodeHoldsPrefix => "decode_holds_prefix",
            DisaggregationReason::NoPrefillWorker => "no_prefill_worker",
        }
    }
}

/// The prefill half of a disaggregated request: where its prompt is prefilled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillPlacement {
    /// The prefill worker.
    pub worker_id: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
    /// Leading prompt blocks already cached there (prefix match), in blocks.
    pub overlap_blocks: u32,
}

/// The router's disaggregation decision for one request, in a route reply when the
/// request allowed disaggregation and at least one prefill worker is registered.
/// `{"reason": "long_uncached", "prefill": {"worker_id": 3, "dp_rank": 0,
/// "overlap_blocks": 12}}`, or `{"reason": "short_uncached"}` when the decode worker
/// prefills the prompt itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disaggregation {
    /// Why.
    pub reason: DisaggregationReason,
    /// Where the prompt is prefilled; absent when the decode worker (the reply's
    /// `worker_id`) prefills it itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill: Option<PrefillPlacement>,
}

/// The suffix of the id under which a disaggregated request's prefill half is
/// booked: `{request_id}#prefill`. Frontends' request ids must not end with it.
pub const PREFILL_BOOKING_SUFFIX: &str = "#prefill";

/// The id under which the prefill half of request `id` is booked (`{id}#prefill`).
pub fn prefill_booking_id(id: &RequestId) -> RequestId {
    RequestId(format!("{}{PREFILL_BOOKING_SUFFIX}", id.0))
}

/// Whether `id` is reserved for a prefill half (ends with [`PREFILL_BOOKING_SUFFIX`]),
/// so a frontend may not use it.
pub fn is_prefill_booking_id(id: &RequestId) -> bool {
    id.0.ends_with(PREFILL_BOOKING_SUFFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_defaults_to_both_and_reads_its_wire_names() {
        assert_eq!(WorkerRole::default(), WorkerRole::Both);
        for role in [WorkerRole::Both, WorkerRole::Prefill, WorkerRole::Decode] {
            let json = serde_json::to_string(&role).unwrap();
            assert_eq!(json, format!("\"{}\"", role.as_str()));
        }
        assert!(serde_json::from_str::<WorkerRole>("\"encode\"").is_err());
        assert!(!WorkerRole::Prefill.decodes());
        assert!(WorkerRole::Decode.decodes() && WorkerRole::Both.decodes());
    }

    #[test]
    fn decision_round_trips_and_omits_a_local_prefill() {
        let local = Disaggregation {
            reason: DisaggregationReason::ShortUncached,
            prefill: None,
        };
        assert_eq!(
            serde_json::to_string(&local).unwrap(),
            r#"{"reason":"short_uncached"}"#
        );
        let remote = Disaggregation {
            reason: DisaggregationReason::LongUncached,
            prefill: Some(PrefillPlacement {
                worker_id: WorkerId(3),
                dp_rank: DpRank(1),
                overlap_blocks: 12,
            }),
        };
        let bytes = crate::encode(&remote).unwrap();
        assert_eq!(crate::decode::<Disaggregation>(&bytes).unwrap(), remote);
        for reason in DisaggregationReason::ALL {
            let json = serde_json::to_string(&reason).unwrap();
            assert_eq!(json, format!("\"{}\"", reason.as_str()));
        }
    }

    #[test]
    fn prefill_booking_ids_are_reserved() {
        let id = RequestId::from("req-7");
        let half = prefill_booking_id(&id);
        assert_eq!(half.0, "req-7#prefill");
        assert!(is_prefill_booking_id(&half));
        assert!(!is_prefill_booking_id(&id));
    }
}
