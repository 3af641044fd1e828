//! Inputs from outside the NATS protocol: etcd registrations, engine ZMQ frames (the
//! relay), OpenAI request bodies (the gateway) and the router's replies as a client
//! (gateway, frontends) reads them.

use super::router::scheduler;
use super::seeds::{self, BLOCK_SIZE, WORKER};
use super::target::{Harness, Target, Verdict};
use crate::mutate::Format;
use bytes::Bytes;
use kv_cluster::directory::{EtcdStatus, Registered, Registrations, Rejection, registration};
use kv_events::discovery::WorkerRegistration;
use kv_events::engines::decode_batch;
use kv_events::journal::{EventJournal, JournalConfig};
use kv_events::limits::Limits;
use kv_events::routing::{RouteBatchReply, RouteReply};
use kv_events::{DpRank, Namespace, Subjects, WorkerId, decode};
use kv_relay::EngineFormat;
use kv_relay::frames::{ReplayItem, SeqStep, SeqTracker, parse_live, parse_replay};
use kv_relay::translate::Translator;
use scheduler::Scheduler;

/// Ranks the relay under test registers (`--dp-size`).
const RELAY_DP_SIZE: u32 = 4;

/// The daemon's check on registrations: the router's block size.
struct BlockSize;

impl Registrations for BlockSize {
    fn check(&self, reg: &WorkerRegistration) -> Result<(), String> {
        if reg.block_size == BLOCK_SIZE {
            Ok(())
        } else {
            Err(format!("block_size {} differs", reg.block_size))
        }
    }
    async fn put(&mut self, _worker: Registered) {}
    async fn delete(&mut self, _worker_id: WorkerId) {}
    fn rejected(&mut self, _key: &str, _rejection: &Rejection) {}
    fn status(&mut self, _status: EtcdStatus) {}
}

struct Registration {
    subjects: Subjects,
    key: String,
    scheduler: Scheduler,
}

impl Harness for Registration {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        match registration(
            &self.subjects,
            &Limits::default(),
            &self.key,
            input,
            &BlockSize,
        ) {
            Ok(reg) => Verdict::of(self.scheduler.add_worker(reg)),
            Err(Rejection::Malformed(e) | Rejection::Refused(e)) => Verdict::Refused(e),
        }
    }
}

pub const REGISTRATION: Target = Target {
    name: "registration",
    about: "WorkerRegistration (JSON, etcd workers/{id}) → kv_cluster::directory::registration (size, key, validate, limits, block size) → Scheduler::add_worker",
    format: Format::Json,
    seeds: seeds::registration_json,
    fresh: || {
        // A constant, valid namespace.
        let ns = Namespace::new("fuzz").unwrap_or_else(|e| panic!("namespace: {e}"));
        let subjects = Subjects::new(ns);
        Box::new(Registration {
            key: subjects.etcd_worker_key(WORKER),
            subjects,
            scheduler: scheduler(),
        })
    },
};

/// The relay's pure path: sequence tracking, engine decoding, translation to our
/// events and their numbering in the journal.
struct Relay {
    translator: Translator,
    journal: EventJournal,
    tracker: SeqTracker,
}

impl Relay {
    fn new() -> Self {
        let mut translator = Translator::new(EngineFormat::Auto);
        // As when the engine's metrics page stated the size before any event.
        translator.learn_block_size(BLOCK_SIZE);
        Self {
            translator,
            journal: EventJournal::new(WORKER, 1, JournalConfig::default()),
            tracker: SeqTracker::new(),
        }
    }

    /// What `Source::deliver` and `Publisher::run` do with one payload.
    fn deliver(&mut self, seq: u64, payload: &[u8]) -> Verdict {
        self.tracker.applied(seq);
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => return Verdict::Refused(e.to_string()),
        };
        let rank = batch.dp_rank.unwrap_or(DpRank(0));
        if rank.0 >= RELAY_DP_SIZE {
            return Verdict::Refused(format!("rank {rank} outside --dp-size"));
        }
        let recorded: Vec<_> = self
            .translator
            .apply_batch(rank, &batch.events)
            .into_iter()
            .filter_map(|outcome| outcome.result.ok())
            .flatten()
            .map(|data| self.journal.record(rank, data))
            .collect();
        let _batch = self.journal.batch(recorded);
        Verdict::Accepted
    }
}

struct EngineBatch(Relay);

impl Harness for EngineBatch {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        self.0.deliver(0, input)
    }
}

pub const ENGINE_BATCH: Target = Target {
    name: "engine_batch",
    about: "vLLM / SGLang KV event batch (msgpack, third ZMQ frame) → engines::decode_batch → Translator::apply_batch (local block hashes, KV cache groups) → EventJournal::record",
    format: Format::Msgpack,
    seeds: seeds::engine_payloads,
    fresh: || Box::new(EngineBatch(Relay::new())),
};

struct Frames(Relay);

impl Harness for Frames {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        let frames: Vec<Bytes> = crate::frames::split(input)
            .into_iter()
            .map(Bytes::from)
            .collect();
        let live = match parse_live(frames.clone()) {
            Ok(frame) => match self.0.tracker.observe(frame.seq) {
                SeqStep::Apply => self.0.deliver(frame.seq, &frame.payload),
                other => Verdict::Refused(format!("{other:?}")),
            },
            Err(e) => Verdict::Refused(e.to_string()),
        };
        let replay = match parse_replay(frames) {
            Ok(ReplayItem::Batch { seq, payload }) => self.0.deliver(seq, &payload),
            Ok(ReplayItem::End) => Verdict::Accepted,
            Err(e) => Verdict::Refused(e.to_string()),
        };
        if live == Verdict::Accepted {
            live
        } else {
            replay
        }
    }
}

pub const RELAY_FRAMES: Target = Target {
    name: "relay_frames",
    about: "ZMQ multipart (live [topic, seq, payload], replay [\"\", (topic,) seq, payload]) → frames::parse_live / parse_replay → SeqTracker → the engine_batch path",
    format: Format::Frames,
    seeds: seeds::relay_frames,
    fresh: || Box::new(Frames(Relay::new())),
};

struct Parse(fn(&[u8]) -> Verdict);

impl Harness for Parse {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        (self.0)(input)
    }
}

pub const GATEWAY_COMPLETION: Target = Target {
    name: "gateway_completion",
    about: "POST /v1/completions body (JSON, HTTP) → kv_gateway::openai::parse_completion",
    format: Format::Json,
    seeds: seeds::completion_bodies,
    fresh: || {
        Box::new(Parse(|b| {
            Verdict::of(kv_gateway::openai::parse_completion(b).map(drop))
        }))
    },
};

pub const GATEWAY_CHAT: Target = Target {
    name: "gateway_chat",
    about: "POST /v1/chat/completions body (JSON, HTTP) → kv_gateway::openai::parse_chat",
    format: Format::Json,
    seeds: seeds::chat_bodies,
    fresh: || {
        Box::new(Parse(|b| {
            Verdict::of(kv_gateway::openai::parse_chat(b).map(drop))
        }))
    },
};

pub const ROUTE_REPLY: Target = Target {
    name: "route_reply",
    about: "RouteReply / RouteBatchReply (msgpack, NATS reply read by the gateway and frontends) → decode",
    format: Format::Msgpack,
    seeds: seeds::route_replies,
    fresh: || {
        Box::new(Parse(|b| match decode::<RouteReply>(b) {
            Ok(_) => Verdict::Accepted,
            Err(_) => Verdict::of(decode::<RouteBatchReply>(b).map(drop)),
        }))
    },
};
