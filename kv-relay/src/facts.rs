//! What the relay knows of the engine's KV cache, learned from the engine itself so
//! that no operator flag holds a number the engine already publishes.
//!
//! - **Block size** (tokens per KV block): from the engine's metrics page
//!   (`vllm:cache_config_info{block_size}`, `sglang:page_size`, see
//!   [`crate::scrape::page`]) or, when the page says nothing, from the `block_size` of
//!   the first stored-block event. The first source to speak fixes it for the life of
//!   the relay; a later source that disagrees is an error naming both values, and
//!   events of another size are refused (counted as `bad_blocks`). A router whose
//!   block size differs refuses the registration, naming both values.
//! - **KV capacity** (blocks per rank): only from the metrics page
//!   (`num_gpu_blocks`, SGLang's pool size). A data-parallel vLLM states its engines'
//!   total under every engine label; the page reader divides it per rank
//!   ([`crate::scrape::page`]). The smallest rank's figure is registered; unknown
//!   stays 0 ("unknown" in [`WorkerRegistration`]).
//! - **Context length** (`max_model_len`, tokens): from the engine's `GET /v1/models`
//!   ([`crate::models`]), read with the metrics page until the engine answers once;
//!   the smallest of its models' figures is registered, so a gateway refuses what the
//!   engine would refuse before routing it. Unknown (no
//!   `--engine-url`, an engine that publishes none, or not read yet) is left out of
//!   the registration; it never holds the registration back.
//!
//! The worker registers once the engine is connected, the block size is known, and
//! the metrics page was read once (or failed once, or there is none), so a worker
//! is never registered with a capacity a moment later corrected. A fact learned
//! later rewrites the registration under the same lease.
//!
//! Written by the scraper and the publishing task, read by the lease task, through
//! one `watch` channel: a few copies of this small struct per change, nothing on the
//! event path.

use kv_cluster::args::WorkerPlacement;
use kv_events::WorkerId;
use kv_events::discovery::WorkerRegistration;

/// The engine's KV cache facts as learned so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineFacts {
    /// Tokens per KV block, once known.
    pub block_size: Option<u32>,
    /// KV cache capacity of each rank (the smallest), in blocks, once known.
    pub kv_blocks: Option<u64>,
    /// The engine's context length, in tokens, once read from its `/v1/models`.
    pub max_model_len: Option<u64>,
    /// The metrics page was read or tried once, or the relay has none to read.
    pub scraped: bool,
}

/// Who the worker is, apart from the facts: fixed for the relay's life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerIdentity {
    /// The worker id registered and published under.
    pub worker_id: WorkerId,
    /// Data-parallel ranks.
    pub dp_size: u32,
    /// The engine's OpenAI HTTP base URL, registered for the gateway.
    pub url: Option<String>,
    /// The epoch of the relay's event stream.
    pub epoch: u64,
    /// Its role in a disaggregated fleet and its transfer protocol (`--role`,
    /// `--kv-transfer`, `--bootstrap-port`).
    pub placement: WorkerPlacement,
}

impl EngineFacts {
    /// The registration to write, once the facts allow one: `None` until the block
    /// size is known and the metrics page was read or tried.
    pub fn registration(&self, who: &WorkerIdentity) -> Option<WorkerRegistration> {
        let block_size = self.block_size.filter(|_| self.scraped)?;
        Some(WorkerRegistration {
            worker_id: who.worker_id,
            dp_size: who.dp_size,
            block_size,
            total_kv_blocks: self.kv_blocks.unwrap_or(0),
            url: who.url.clone(),
            epoch: who.epoch,
            max_model_len: self.max_model_len,
            role: who.placement.role,
            kv_transfer: who.placement.kv_transfer,
        })
    }

    /// Records a block size from `source`; returns the size already fixed when it
    /// differs (the caller reports the conflict), `None` when accepted or equal.
    pub fn offer_block_size(&mut self, size: u32) -> Option<u32> {
        match self.block_size {
            None => {
                self.block_size = Some(size);
                None
            }
            Some(fixed) if fixed != size => Some(fixed),
            Some(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who() -> WorkerIdentity {
        WorkerIdentity {
            worker_id: WorkerId(7),
            dp_size: 2,
            url: None,
            epoch: 9,
            placement: WorkerPlacement::default(),
        }
    }

    #[test]
    fn registers_only_with_a_block_size_and_after_the_first_scrape() {
        let mut f = EngineFacts::default();
        assert_eq!(f.registration(&who()), None);
        assert_eq!(f.offer_block_size(16), None);
        assert_eq!(f.registration(&who()), None, "the page was not read yet");
        f.scraped = true;
        let reg = f.registration(&who()).expect("registrable");
        assert_eq!((reg.block_size, reg.total_kv_blocks, reg.epoch), (16, 0, 9));
        f.kv_blocks = Some(2048);
        assert_eq!(
            f.registration(&who()).map(|r| r.total_kv_blocks),
            Some(2048)
        );
        assert_eq!(reg.max_model_len, None, "unknown until read");
        f.max_model_len = Some(4096);
        assert_eq!(
            f.registration(&who()).and_then(|r| r.max_model_len),
            Some(4096)
        );
    }

    #[test]
    fn the_registration_carries_the_role_and_transfer() {
        use kv_events::disaggregation::{KvTransfer, TransferProtocol, WorkerRole};
        let f = EngineFacts {
            block_size: Some(16),
            scraped: true,
            ..EngineFacts::default()
        };
        let reg = f.registration(&who()).expect("registrable");
        assert_eq!((reg.role, reg.kv_transfer), (WorkerRole::Both, None));
        let transfer = KvTransfer {
            protocol: TransferProtocol::Sglang,
            bootstrap_port: Some(8998),
        };
        let prefill = WorkerIdentity {
            placement: WorkerPlacement {
                role: WorkerRole::Prefill,
                kv_transfer: Some(transfer),
            },
            ..who()
        };
        let reg = f.registration(&prefill).expect("registrable");
        assert_eq!(
            (reg.role, reg.kv_transfer),
            (WorkerRole::Prefill, Some(transfer))
        );
    }

    #[test]
    fn the_first_block_size_stays_and_a_different_one_is_reported() {
        let mut f = EngineFacts::default();
        assert_eq!(f.offer_block_size(16), None);
        assert_eq!(f.offer_block_size(16), None);
        assert_eq!(f.offer_block_size(32), Some(16));
        assert_eq!(f.block_size, Some(16));
    }
}
