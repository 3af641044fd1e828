//! The mock engine as a vLLM stand-in: `kv-mocker engines --kv-events vllm`.
//!
//! In this mode every rank publishes its KV events the way vLLM 0.33 does (ZMQ PUB
//! at `--zmq-port` + rank, tagged-map msgpack with real token ids, a replay ROUTER
//! with a bounded buffer), and the engines touch neither NATS nor etcd: a
//! `kv-router relay` per worker translates the stream, registers the worker (with
//! `--engine-url`) and scrapes the mock's vLLM-named `/metrics` for load, exactly as
//! it would for a real vLLM. That makes the relay path testable end to end with no
//! GPU and no engine changes.
//!
//! - [`encode`]: the msgpack payload, byte-identical to vLLM's;
//! - [`publisher`]: the PUB and replay sockets of one rank.
//!
//! Ports: worker `i` (0-based within the process) rank `r` binds
//! `--zmq-port + i × dp_size + r` and `--zmq-replay-port + i × dp_size + r`, so each
//! worker looks like one vLLM with a base port of its own; port 0 binds any free port
//! per socket (see [`crate::engine::EnginesHandle::zmq_endpoints`]).

pub mod encode;
pub mod publisher;

#[cfg(test)]
mod hybrid_tests;
#[cfg(test)]
mod tests;

use super::config::EngineConfigError;
use bytes::Bytes;
pub use encode::{MissingTokens, VllmEvent, VllmGroup, encode_batch, to_vllm, to_vllm_hybrid};
pub use publisher::{BindError, PublisherConfig, RankEndpoints, VllmPublisher};

/// Default `--zmq-port`: vLLM's default KV events endpoint port.
pub const DEFAULT_ZMQ_PORT: u16 = 5557;
/// Default `--zmq-replay-port`.
pub const DEFAULT_ZMQ_REPLAY_PORT: u16 = 5657;
/// Default `--zmq-buffer-steps`: vLLM's `buffer_steps`.
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;

/// Where the engines publish KV events (and, with them, who registers the workers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KvEventsMode {
    /// The router's protocol on NATS, workers registered in etcd, load metrics on NATS.
    #[default]
    Nats,
    /// vLLM 0.33's ZMQ wire per rank; nothing on NATS or in etcd (a relay does both).
    Vllm,
}

/// Flags of the KV event output (`--kv-events` and, for `vllm`, the ZMQ sockets).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct KvEventsArgs {
    /// Where KV events go: `nats` (the router's protocol; workers register in etcd)
    /// or `vllm` (ZMQ as vLLM 0.33 publishes them, for `kv-router relay`).
    #[arg(long = "kv-events", value_enum, default_value_t = KvEventsMode::Nats)]
    pub mode: KvEventsMode,
    /// Host the ZMQ sockets bind (vllm mode).
    #[arg(long, default_value = "127.0.0.1")]
    pub zmq_host: String,
    /// Base port of the PUB sockets; + worker index × dp size + rank (vllm mode; 0 =
    /// any free port).
    #[arg(long, default_value_t = DEFAULT_ZMQ_PORT)]
    pub zmq_port: u16,
    /// Base port of the replay ROUTER sockets, laid out like --zmq-port (vllm mode).
    #[arg(long, default_value_t = DEFAULT_ZMQ_REPLAY_PORT)]
    pub zmq_replay_port: u16,
    /// Batches each rank keeps for replay (vLLM's `buffer_steps`).
    #[arg(long, default_value_t = DEFAULT_BUFFER_STEPS)]
    pub zmq_buffer_steps: usize,
    /// Topic frame of every batch (vLLM's `topic`; empty by default, as vLLM's).
    #[arg(long, default_value = "")]
    pub zmq_topic: String,
}

impl Default for KvEventsArgs {
    fn default() -> Self {
        Self {
            mode: KvEventsMode::Nats,
            zmq_host: "127.0.0.1".to_owned(),
            zmq_port: DEFAULT_ZMQ_PORT,
            zmq_replay_port: DEFAULT_ZMQ_REPLAY_PORT,
            zmq_buffer_steps: DEFAULT_BUFFER_STEPS,
            zmq_topic: String::new(),
        }
    }
}

impl KvEventsArgs {
    /// vLLM-mode flags for tests and embedders: any free ports on loopback.
    pub fn vllm_on_free_ports() -> Self {
        Self {
            mode: KvEventsMode::Vllm,
            zmq_port: 0,
            zmq_replay_port: 0,
            ..Self::default()
        }
    }

    /// The socket configuration of rank `rank` of worker `index` with `dp_size` ranks.
    ///
    /// # Errors
    /// [`EngineConfigError::ZmqPortOverflow`] when a port passes 65535;
    /// [`EngineConfigError::ZeroBufferSteps`] for an empty replay buffer.
    pub fn rank_config(
        &self,
        index: u32,
        dp_size: u32,
        rank: u32,
    ) -> Result<PublisherConfig, EngineConfigError> {
        if self.zmq_buffer_steps == 0 {
            return Err(EngineConfigError::ZeroBufferSteps);
        }
        let host = if self.zmq_host.contains(':') && !self.zmq_host.starts_with('[') {
            format!("[{}]", self.zmq_host)
        } else {
            self.zmq_host.clone()
        };
        let offset = u64::from(index) * u64::from(dp_size) + u64::from(rank);
        let port = |base: u16| match base {
            0 => Ok(0),
            base => u16::try_from(u64::from(base) + offset)
                .map_err(|_| EngineConfigError::ZmqPortOverflow { base, offset }),
        };
        Ok(PublisherConfig {
            publish: format!("tcp://{host}:{}", port(self.zmq_port)?),
            replay: format!("tcp://{host}:{}", port(self.zmq_replay_port)?),
            topic: Bytes::from(self.zmq_topic.clone().into_bytes()),
            buffer_steps: self.zmq_buffer_steps,
        })
    }
}
