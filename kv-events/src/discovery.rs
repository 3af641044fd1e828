//! The worker registration record kept in etcd.
//!
//! A worker writes one key, `kv-router/{ns}/workers/{worker_id}` (see
//! [`crate::subjects::Subjects::etcd_worker_key`]), bound to an etcd lease that it keeps
//! alive. The value is this record as JSON, so operators can read it with `etcdctl`.
//! When the lease expires or is revoked, the key disappears and every router drops
//! the worker's cached blocks and in-flight load.
//!
//! The optional `url` (the engine's OpenAI HTTP base URL) lets a frontend forward a
//! routed request without a directory of its own. It is optional on the wire so that
//! registrations written before it existed still decode; a router that does not forward
//! ignores it. Its length is bounded by [`MAX_URL_BYTES`] in [`WorkerRegistration::validate`].
//!
//! The optional `max_model_len` (the engine's context length, in tokens, as vLLM
//! publishes it on `GET /v1/models`) lets a gateway refuse a prompt the engine would
//! refuse, before it is routed, and accept every prompt it would take. Optional for
//! the same reason as `url`; a reader that does not know the field ignores it (no
//! reader of registrations refuses unknown fields).
//!
//! The optional `role` and `kv_transfer` place the worker in a disaggregated fleet
//! ([`crate::disaggregation`]); absent, the worker is an aggregated one (`both`).

use crate::disaggregation::{KvTransfer, TransferProtocol, WorkerRole};
use crate::ids::WorkerId;
use serde::{Deserialize, Serialize};

/// Longest accepted [`WorkerRegistration::url`], in bytes. Comfortably above any real
/// `scheme://host:port/prefix`, small enough that a directory of thousands of workers
/// stays in the megabytes.
pub const MAX_URL_BYTES: usize = 2048;

/// Largest accepted [`WorkerRegistration::max_model_len`], in tokens: 2^32, 400× the
/// longest context of models today (10M tokens), so a value above it is a broken
/// writer, not a model.
pub const MAX_MODEL_LEN: u64 = 1 << 32;

/// What a worker tells the cluster about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRegistration {
    /// The worker's id; must match the id in the key.
    pub worker_id: WorkerId,
    /// Number of data-parallel ranks (ranks are `0..dp_size`); at least 1.
    pub dp_size: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV cache capacity of each rank, in blocks.
    pub total_kv_blocks: u64,
    /// The engine's OpenAI-compatible HTTP base URL (`http://host:port`, no trailing
    /// `/v1`), where a gateway forwards `POST /v1/completions`. Absent in registrations
    /// of workers that serve no HTTP (and in every registration older than the field);
    /// not serialized when absent. At most [`MAX_URL_BYTES`] bytes, scheme `http` or
    /// `https`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The epoch of the worker's KV event stream (the `epoch` of its
    /// `KvEventBatch`es): a publisher that numbers its events from 0 again after a
    /// restart registers the new epoch before (or as) it publishes under it. The
    /// router applies a worker's events only up to its registered epoch, so an
    /// ordinary event cannot move a worker to a new epoch (and wipe its index); a
    /// batch of a newer epoch waits a short grace for the registration, then is
    /// dropped. 0 (the default, not serialized): the publisher does not use epochs.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u64,
    /// The engine's context length, in tokens: the longest prompt plus `max_tokens`
    /// it serves (vLLM's `max_model_len`). Absent when unknown (the engine does not
    /// publish it, it was not read yet, or the registration is older than the field);
    /// not serialized when absent. When present, 1 to [`MAX_MODEL_LEN`]: 0 is
    /// invalid, not "unknown".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u64>,
    /// The worker's role in a disaggregated fleet; `both` (the default, not
    /// serialized) for an aggregated worker.
    #[serde(default, skip_serializing_if = "is_both")]
    pub role: WorkerRole,
    /// How a frontend runs a KV transfer with this worker: required for a `prefill`
    /// or `decode` worker, ignored for `both`; absent (not serialized) by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer: Option<KvTransfer>,
}

fn is_both(role: &WorkerRole) -> bool {
    *role == WorkerRole::Both
}

fn is_zero(epoch: &u64) -> bool {
    *epoch == 0
}

/// Why a registration record is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistrationError {
    /// `dp_size` was 0.
    #[error("worker {0} registered dp_size 0")]
    ZeroDpSize(WorkerId),
    /// `block_size` was 0.
    #[error("worker {0} registered block_size 0")]
    ZeroBlockSize(WorkerId),
    /// `url` was longer than [`MAX_URL_BYTES`].
    #[error("worker {worker_id} registered a url of {len} bytes (at most {MAX_URL_BYTES})")]
    UrlTooLong {
        /// The worker.
        worker_id: WorkerId,
        /// The url's length, in bytes.
        len: usize,
    },
    /// `url` is not an `http://` or `https://` URL with a host.
    #[error("worker {0} registered a url that is not http:// or https://")]
    UrlScheme(WorkerId),
    /// `max_model_len` was 0 or over [`MAX_MODEL_LEN`].
    #[error(
        "worker {worker_id} registered max_model_len {value} (1 to {MAX_MODEL_LEN} tokens, \
         or absent when unknown)"
    )]
    MaxModelLen {
        /// The worker.
        worker_id: WorkerId,
        /// The value registered, in tokens.
        value: u64,
    },
    /// A `prefill` or `decode` worker registered no `kv_transfer`, or an SGLang
    /// prefill worker no `bootstrap_port` (or port 0).
    #[error("worker {worker_id} registered role {role} {detail}")]
    KvTransfer {
        /// The worker.
        worker_id: WorkerId,
        /// Its role.
        role: WorkerRole,
        /// What is missing, lowercase.
        detail: &'static str,
    },
}

impl WorkerRegistration {
    /// Checks the invariants a router relies on: `dp_size` and `block_size` at least 1,
    /// a `url`, if present, of at most [`MAX_URL_BYTES`] bytes with an `http` or
    /// `https` scheme and a non-empty rest (the rest is not parsed further), and a
    /// `max_model_len`, if present, of 1 to [`MAX_MODEL_LEN`] tokens, and a
    /// `kv_transfer` for a `prefill` or `decode` role (with a non-zero
    /// `bootstrap_port` for an SGLang prefill worker).
    ///
    /// # Errors
    /// [`RegistrationError`] naming the offending field.
    pub fn validate(&self) -> Result<(), RegistrationError> {
        if self.dp_size == 0 {
            return Err(RegistrationError::ZeroDpSize(self.worker_id));
        }
        if self.block_size == 0 {
            return Err(RegistrationError::ZeroBlockSize(self.worker_id));
        }
        if let Some(url) = &self.url {
            if url.len() > MAX_URL_BYTES {
                return Err(RegistrationError::UrlTooLong {
                    worker_id: self.worker_id,
                    len: url.len(),
                });
            }
            let web = url::Url::parse(url).is_ok_and(|u| {
                matches!(u.scheme(), "http" | "https")
                    && u.host_str().is_some_and(|h| !h.is_empty())
            });
            if !web {
                return Err(RegistrationError::UrlScheme(self.worker_id));
            }
        }
        if let Some(value) = self.max_model_len
            && !(1..=MAX_MODEL_LEN).contains(&value)
        {
            return Err(RegistrationError::MaxModelLen {
                worker_id: self.worker_id,
                value,
            });
        }
        self.validate_kv_transfer()
    }

    /// Whether the worker prefills and decodes a whole request itself: a `both`
    /// worker, or a vLLM `decode` worker (vLLM serves a request without
    /// `kv_transfer_params` locally). An SGLang `decode` server refuses a request
    /// without a bootstrap (it cannot prefill: sgl-project/sglang#14284), and a
    /// `prefill` worker only prefills, so neither gets whole requests.
    pub fn serves_whole_requests(&self) -> bool {
        match self.role {
            WorkerRole::Both => true,
            WorkerRole::Prefill => false,
            WorkerRole::Decode => self
                .kv_transfer
                .is_some_and(|t| t.protocol != TransferProtocol::Sglang),
        }
    }

    fn validate_kv_transfer(&self) -> Result<(), RegistrationError> {
        let missing = |detail| {
            Err(RegistrationError::KvTransfer {
                worker_id: self.worker_id,
                role: self.role,
                detail,
            })
        };
        match (self.role, self.kv_transfer) {
            (WorkerRole::Both, _) => Ok(()),
            (_, None) => missing("without kv_transfer"),
            (
                WorkerRole::Prefill,
                Some(KvTransfer {
                    protocol: TransferProtocol::Sglang,
                    bootstrap_port: None | Some(0),
                }),
            ) => missing("with sglang kv_transfer but no bootstrap_port"),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_field() {
        let ok = WorkerRegistration {
            worker_id: WorkerId(1),
            dp_size: 2,
            block_size: 16,
            total_kv_blocks: 100,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        };
        assert!(ok.validate().is_ok());
        assert_eq!(
            WorkerRegistration {
                dp_size: 0,
                ..ok.clone()
            }
            .validate(),
            Err(RegistrationError::ZeroDpSize(WorkerId(1)))
        );
        assert_eq!(
            WorkerRegistration {
                block_size: 0,
                ..ok
            }
            .validate(),
            Err(RegistrationError::ZeroBlockSize(WorkerId(1)))
        );
    }

    fn with_url(url: &str) -> WorkerRegistration {
        WorkerRegistration {
            worker_id: WorkerId(3),
            dp_size: 1,
            block_size: 16,
            total_kv_blocks: 10,
            url: Some(url.to_owned()),
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        }
    }

    #[test]
    fn url_is_bounded_and_needs_an_http_scheme() {
        assert!(with_url("http://10.0.0.5:8000").validate().is_ok());
        assert!(with_url("https://engine.example/prefix").validate().is_ok());
        let long = format!("http://{}", "a".repeat(MAX_URL_BYTES));
        assert_eq!(
            with_url(&long).validate(),
            Err(RegistrationError::UrlTooLong {
                worker_id: WorkerId(3),
                len: MAX_URL_BYTES + 7
            })
        );
        for bad in ["", "http://", "ftp://host", "10.0.0.5:8000"] {
            assert_eq!(
                with_url(bad).validate(),
                Err(RegistrationError::UrlScheme(WorkerId(3))),
                "{bad}"
            );
        }
    }

    #[test]
    fn registration_without_url_still_decodes() {
        let old = r#"{"worker_id": 7, "dp_size": 1, "block_size": 64, "total_kv_blocks": 16384}"#;
        let reg: WorkerRegistration = serde_json::from_str(old).unwrap();
        assert_eq!(reg.url, None);
        assert_eq!(reg.max_model_len, None);
        assert_eq!(reg.worker_id, WorkerId(7));
        // And an absent url is not written, so older readers see the old shape.
        assert_eq!(
            serde_json::to_string(&reg).unwrap(),
            r#"{"worker_id":7,"dp_size":1,"block_size":64,"total_kv_blocks":16384}"#
        );
    }

    #[test]
    fn registration_with_url_round_trips() {
        let reg = with_url("http://127.0.0.1:8100");
        let json = serde_json::to_string(&reg).unwrap();
        assert!(json.contains(r#""url":"http://127.0.0.1:8100""#), "{json}");
        assert_eq!(
            serde_json::from_str::<WorkerRegistration>(&json).unwrap(),
            reg
        );
    }

    #[test]
    fn max_model_len_is_one_to_the_cap_or_absent() {
        let with_len = |max_model_len| WorkerRegistration {
            max_model_len,
            ..with_url("http://10.0.0.5:8000")
        };
        for ok in [None, Some(1), Some(4096), Some(MAX_MODEL_LEN)] {
            assert_eq!(with_len(ok).validate(), Ok(()), "{ok:?}");
        }
        for bad in [0, MAX_MODEL_LEN + 1, u64::MAX] {
            let err = with_len(Some(bad)).validate().unwrap_err();
            assert_eq!(
                err,
                RegistrationError::MaxModelLen {
                    worker_id: WorkerId(3),
                    value: bad
                }
            );
            assert!(err.to_string().contains("max_model_len"), "{err}");
        }
    }

    /// Both directions of the upgrade: a record with `max_model_len` round-trips
    /// here, and the decoder of the previous version (the record without the field,
    /// which like this one refuses no unknown field) still reads it.
    #[test]
    fn max_model_len_round_trips_and_older_readers_ignore_it() {
        let reg = WorkerRegistration {
            max_model_len: Some(32_768),
            ..with_url("http://127.0.0.1:8100")
        };
        let json = serde_json::to_string(&reg).unwrap();
        assert!(json.contains(r#""max_model_len":32768"#), "{json}");
        assert_eq!(
            serde_json::from_str::<WorkerRegistration>(&json).unwrap(),
            reg
        );

        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Previous {
            worker_id: WorkerId,
            dp_size: u32,
            block_size: u32,
            total_kv_blocks: u64,
            #[serde(default)]
            url: Option<String>,
            #[serde(default)]
            epoch: u64,
        }
        let old: Previous = serde_json::from_str(&json).unwrap();
        assert_eq!((old.worker_id, old.block_size), (WorkerId(3), 16));
        // And an absent length is not written at all.
        let unknown = serde_json::to_string(&with_url("http://a:1")).unwrap();
        assert!(!unknown.contains("max_model_len"), "{unknown}");
    }

    #[test]
    fn a_disaggregated_role_needs_its_transfer() {
        let both = with_url("http://10.0.0.5:8000");
        let prefill = |kv_transfer| WorkerRegistration {
            role: WorkerRole::Prefill,
            kv_transfer,
            ..both.clone()
        };
        let vllm = KvTransfer {
            protocol: TransferProtocol::Vllm,
            bootstrap_port: None,
        };
        let sglang = |bootstrap_port| KvTransfer {
            protocol: TransferProtocol::Sglang,
            bootstrap_port,
        };
        assert_eq!(both.validate(), Ok(()));
        assert_eq!(prefill(Some(vllm)).validate(), Ok(()));
        assert_eq!(prefill(Some(sglang(Some(8998)))).validate(), Ok(()));
        for bad in [None, Some(sglang(None)), Some(sglang(Some(0)))] {
            let err = prefill(bad).validate().unwrap_err();
            assert!(
                matches!(
                    err,
                    RegistrationError::KvTransfer {
                        role: WorkerRole::Prefill,
                        ..
                    }
                ),
                "{err}"
            );
        }
        let decode = WorkerRegistration {
            role: WorkerRole::Decode,
            kv_transfer: Some(sglang(None)),
            ..both.clone()
        };
        assert_eq!(decode.validate(), Ok(()));
        // An SGLang decode server cannot prefill a whole request; a vLLM one can.
        assert!(!decode.serves_whole_requests());
        let vllm_decode = WorkerRegistration {
            kv_transfer: Some(vllm),
            ..decode.clone()
        };
        assert!(vllm_decode.serves_whole_requests());
        assert!(both.serves_whole_requests() && !prefill(Some(vllm)).serves_whole_requests());
        let json = serde_json::to_string(&decode).unwrap();
        assert!(
            json.ends_with(r#""role":"decode","kv_transfer":{"protocol":"sglang"}}"#),
            "{json}"
        );
        assert_eq!(
            serde_json::from_str::<WorkerRegistration>(&json).unwrap(),
            decode
        );
        // An aggregated worker writes neither field.
        let json = serde_json::to_string(&both).unwrap();
        assert!(
            !json.contains("role") && !json.contains("kv_transfer"),
            "{json}"
        );
    }
}
