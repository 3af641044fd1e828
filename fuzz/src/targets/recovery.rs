//! Gap recovery and durability: the publisher's answer to a recovery request, the
//! router's reassembly and application of the chunked reply, and the JetStream index
//! snapshot read back at start-up.

use super::router::index;
use super::seeds::{self, WORKER};
use super::target::{Harness, Target, Verdict};
use crate::mutate::Format;
use indexer::{OrderedIndex, RecoveryNeed};
use kv_events::journal::{EventJournal, JournalConfig};
use kv_events::recovery::{ChunkAssembler, RecoveryBody, RecoveryRequest, ReplyLimits};
use kv_events::{DpRank, WorkerRank, decode, encode};
use router_daemon::handlers::StoredSnapshot;

/// A journal that has published two batches on rank 0 and one on rank 3.
fn journal() -> EventJournal {
    let mut journal = EventJournal::new(
        WORKER,
        1,
        JournalConfig {
            ring_capacity: 8,
            max_chunk_blocks: 2,
        },
    );
    for (rank, first) in [(0, 0), (0, 3), (3, 0)] {
        for event in seeds::event_batch(first, rank).events {
            journal.record(DpRank(rank), event.data);
        }
    }
    journal
}

struct Publisher {
    journal: EventJournal,
}

impl Harness for Publisher {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        let chunks = self.journal.answer(input);
        match chunks.first().map(|c| &c.body) {
            Some(RecoveryBody::Error { message }) => Verdict::Refused(message.clone()),
            Some(_) => Verdict::Accepted,
            None => Verdict::Refused("no reply chunk".into()),
        }
    }
}

fn recovery_requests() -> Vec<Vec<u8>> {
    let request = |dp_rank, epoch, start_event_id, dump| RecoveryRequest {
        dp_rank: DpRank(dp_rank),
        epoch,
        start_event_id,
        dump,
    };
    [
        request(0, 1, 2, false),
        request(0, 1, 0, true),
        request(3, 0, 0, false),
        request(9, 1, 5, false),
    ]
    .iter()
    // Plain data: encoding cannot fail.
    .map(|r| encode(r).unwrap_or_default())
    .collect()
}

pub const RECOVERY_REQUEST: Target = Target {
    name: "recovery_request",
    about: "RecoveryRequest (msgpack, NATS kv.recovery.{worker}, publisher side: relay, mock engine) → EventJournal::answer (replay or dump, chunked)",
    format: Format::Msgpack,
    seeds: recovery_requests,
    fresh: || Box::new(Publisher { journal: journal() }),
};

/// The router side: an index with a pending resync of worker 7 rank 0.
struct Router {
    index: OrderedIndex,
    need: RecoveryNeed,
}

impl Harness for Router {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        let mut assembler = ChunkAssembler::with_limits(ReplyLimits::default());
        for payload in crate::frames::split(input) {
            match assembler.push_payload(&payload) {
                Ok(None) => {}
                Ok(Some(reply)) => {
                    let _more = self
                        .index
                        .apply_recovered(self.need.rank, self.need.token, reply);
                    return Verdict::Accepted;
                }
                Err(e) => return Verdict::Refused(e.to_string()),
            }
        }
        Verdict::Refused("the reply has no last chunk".into())
    }
}

fn recovery_replies() -> Vec<Vec<u8>> {
    let journal = journal();
    let request = |epoch, start_event_id, dump| RecoveryRequest {
        dp_rank: DpRank(0),
        epoch,
        start_event_id,
        dump,
    };
    let requests = [request(0, 0, true), request(1, 1, false)];
    let mut out: Vec<Vec<u8>> = requests
        .iter()
        .map(|r| {
            let chunks: Vec<Vec<u8>> = journal
                .replay(r)
                .into_chunks(2)
                .iter()
                // Plain data: encoding cannot fail.
                .map(|c| encode(c).unwrap_or_default())
                .collect();
            crate::frames::join(&chunks)
        })
        .collect();
    // A request that does not decode gets one `error` chunk.
    out.push(crate::frames::join(&[
        encode(&journal.answer(&[0xc1])[0]).unwrap_or_default()
    ]));
    out
}

pub const RECOVERY_REPLY: Target = Target {
    name: "recovery_reply",
    about: "RecoveryChunk × n (msgpack, NATS reply inbox) → ChunkAssembler::push_payload (reply limits, decode, order) → OrderedIndex::apply_recovered",
    format: Format::Frames,
    seeds: recovery_replies,
    fresh: || {
        let mut index = index();
        let rank = WorkerRank::new(WORKER, DpRank(0));
        let need = index
            .resync(rank)
            .unwrap_or_else(|| panic!("a fresh index has no pending recovery"));
        Box::new(Router { index, need })
    },
};

struct Restore {
    index: OrderedIndex,
}

impl Harness for Restore {
    fn feed(&mut self, input: &[u8]) -> Verdict {
        match decode::<StoredSnapshot>(input) {
            Ok(stored) => {
                let _outcome = self.index.restore(&stored.snapshot);
                Verdict::Accepted
            }
            Err(e) => Verdict::Refused(e.to_string()),
        }
    }
}

fn snapshots() -> Vec<Vec<u8>> {
    let mut index = index();
    for (first, rank) in [(0, 0), (0, 2)] {
        let _needs = index.apply_batch(&seeds::event_batch(first, rank));
    }
    let stored = StoredSnapshot {
        stream_sequence: 42,
        snapshot: index.snapshot(),
    };
    // Plain data: encoding cannot fail.
    vec![encode(&stored).unwrap_or_default()]
}

pub const INDEX_SNAPSHOT: Target = Target {
    name: "index_snapshot",
    about: "StoredSnapshot (msgpack, JetStream object store, read at start-up) → OrderedIndex::restore",
    format: Format::Msgpack,
    seeds: snapshots,
    fresh: || Box::new(Restore { index: index() }),
};
