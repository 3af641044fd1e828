use super::*;
use crate::codec::{decode, encode};
use crate::ids::LocalBlockHash;

fn block(h: u64) -> StoredBlock {
    StoredBlock {
        block_hash: ExternalBlockHash(h),
        tokens_hash: LocalBlockHash(h + 1000),
    }
}

fn dump_reply(chains: Vec<StoredChain>) -> RecoveryReply {
    RecoveryReply {
        worker_id: WorkerId(4),
        dp_rank: DpRank(1),
        epoch: 9,
        next_event_id: 77,
        body: RecoveryBody::Dump {
            unheld_in_groups: Vec::new(),
            chains,
            unheld: vec![ExternalBlockHash(3)],
        },
    }
}

fn assemble(chunks: Vec<RecoveryChunk>) -> RecoveryReply {
    let mut asm = ChunkAssembler::new();
    let n = chunks.len();
    for (i, chunk) in chunks.into_iter().enumerate() {
        // Every chunk crosses the wire.
        let chunk: RecoveryChunk = decode(&encode(&chunk).unwrap()).unwrap();
        let out = asm.push(chunk).unwrap();
        assert_eq!(out.is_some(), i + 1 == n, "only the last chunk completes");
        if let Some(reply) = out {
            return reply;
        }
    }
    unreachable!("the last chunk completes the reply")
}

/// Flattens a dump into (parent, block) pairs: the relation chunking must keep.
fn links(reply: &RecoveryReply) -> Vec<(Option<u64>, u64)> {
    let RecoveryBody::Dump { chains, .. } = &reply.body else {
        panic!("not a dump")
    };
    let mut out = Vec::new();
    for chain in chains {
        let mut parent = chain.parent_hash.map(|p| p.0);
        for b in &chain.blocks {
            out.push((parent, b.block_hash.0));
            parent = Some(b.block_hash.0);
        }
    }
    out
}

#[test]
fn dumps_split_into_bounded_chunks_and_reassemble_with_the_same_links() {
    let reply = dump_reply(vec![
        StoredChain {
            group: None,
            parent_hash: None,
            blocks: (1..=7).map(block).collect(),
            tier: StorageTier::Gpu,
        },
        StoredChain {
            group: None,
            parent_hash: Some(ExternalBlockHash(3)),
            blocks: (20..=22).map(block).collect(),
            tier: StorageTier::Gpu,
        },
    ]);
    let chunks = reply.clone().into_chunks(3);
    assert_eq!(chunks.len(), 4);
    // Exactly full chunks: the unheld list rides on the last one.
    assert_eq!(reply.clone().into_chunks(5).len(), 2);
    for chunk in &chunks {
        assert!(chunk.body.block_count() <= 3);
    }
    for chunk in &chunks[..3] {
        assert!(
            matches!(&chunk.body, RecoveryBody::Dump { unheld, .. } if unheld.is_empty()),
            "unheld blocks travel last"
        );
    }
    let back = assemble(chunks);
    assert_eq!(links(&back), links(&reply));
    assert!(
        matches!(&back.body, RecoveryBody::Dump { unheld, .. } if unheld == &[ExternalBlockHash(3)])
    );
    // One chunk when everything fits; an empty dump is one empty chunk.
    assert_eq!(reply.clone().into_chunks(100).len(), 1);
    let empty = dump_reply(vec![]);
    let chunks = empty.clone().into_chunks(5);
    assert_eq!(chunks.len(), 1);
    assert_eq!(assemble(chunks), empty);
}

#[test]
fn empty_chains_of_known_groups_survive_chunking_in_order() {
    use crate::events::KvCacheGroup;
    let chain = |blocks: Vec<StoredBlock>, group| StoredChain {
        group,
        parent_hash: None,
        blocks,
        tier: StorageTier::Gpu,
    };
    let reply = dump_reply(vec![
        chain((1..=4).map(block).collect(), Some(KvCacheGroup::full(3))),
        chain(vec![], KvCacheGroup::windowed(0, 4)),
        chain(vec![block(9)], KvCacheGroup::windowed(1, 4)),
    ]);
    let back = assemble(reply.clone().into_chunks(2));
    let groups = |r: &RecoveryReply| match &r.body {
        RecoveryBody::Dump { chains, .. } => chains
            .iter()
            .map(|c| (c.group.map(|g| g.id.0), c.blocks.len()))
            .collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        groups(&back),
        vec![(Some(3), 2), (Some(3), 2), (Some(0), 0), (Some(1), 1)]
    );
    assert_eq!(links(&back), links(&reply));
}

#[test]
fn events_split_between_events_and_reassemble_in_order() {
    let events: Vec<KvCacheEvent> = (0..5)
        .map(|i| KvCacheEvent {
            event_id: 10 + i,
            dp_rank: DpRank(1),
            data: KvCacheEventData::Stored {
                group: None,
                parent_hash: None,
                blocks: vec![block(i), block(i + 50)],
                tier: StorageTier::Gpu,
            },
        })
        .collect();
    let reply = RecoveryReply {
        body: RecoveryBody::Events {
            events: events.clone(),
        },
        ..dump_reply(vec![])
    };
    let chunks = reply.clone().into_chunks(3);
    assert_eq!(
        chunks.len(),
        5,
        "two 2-block events never share a 3-block chunk"
    );
    assert_eq!(assemble(chunks), reply);
}

#[test]
fn out_of_order_and_foreign_chunks_are_errors() {
    let reply = dump_reply(vec![StoredChain {
        group: None,
        parent_hash: None,
        blocks: (1..=4).map(block).collect(),
        tier: StorageTier::Gpu,
    }]);
    let chunks = reply.into_chunks(2);
    let mut asm = ChunkAssembler::new();
    assert_eq!(
        asm.push(chunks[1].clone()),
        Err(AssemblyError::OutOfOrder {
            expected: 0,
            got: 1
        })
    );
    let mut asm = ChunkAssembler::new();
    asm.push(chunks[0].clone()).unwrap();
    let foreign = RecoveryChunk {
        epoch: 10,
        ..chunks[1].clone()
    };
    assert_eq!(asm.push(foreign), Err(AssemblyError::Mismatch(1)));
}

#[test]
fn request_fields_are_optional_on_the_wire() {
    #[derive(Serialize)]
    struct Empty {}
    let request: RecoveryRequest = decode(&encode(&Empty {}).unwrap()).unwrap();
    assert_eq!(
        request,
        RecoveryRequest {
            dp_rank: DpRank(0),
            epoch: 0,
            start_event_id: 0,
            dump: false
        }
    );
}

#[test]
fn replies_past_the_limits_are_refused_before_decoding() {
    let reply = dump_reply(vec![StoredChain {
        group: None,
        parent_hash: None,
        blocks: (1..=6).map(block).collect(),
        tier: StorageTier::Gpu,
    }]);
    let wire: Vec<Vec<u8>> = reply
        .clone()
        .into_chunks(2)
        .iter()
        .map(|c| encode(c).unwrap())
        .collect();
    assert_eq!(wire.len(), 3);
    let total: usize = wire.iter().map(Vec::len).sum();

    // Exactly at the limits: assembled.
    let exact = ReplyLimits {
        max_chunks: 3,
        max_bytes: total,
    };
    let mut asm = ChunkAssembler::with_limits(exact);
    let mut out = None;
    for payload in &wire {
        out = asm.push_payload(payload).unwrap();
    }
    assert_eq!(links(&out.expect("complete")), links(&reply));

    // One chunk too many: the third is refused whatever it holds (even garbage,
    // which proves it is not decoded).
    let mut asm = ChunkAssembler::with_limits(ReplyLimits {
        max_chunks: 2,
        ..exact
    });
    asm.push_payload(&wire[0]).unwrap();
    asm.push_payload(&wire[1]).unwrap();
    let err = asm.push_payload(&[0xc1]).unwrap_err();
    assert_eq!(err, AssemblyError::TooManyChunks { limit: 2 });
    assert_eq!(err.reason(), "too_many_chunks");
    assert!(err.is_oversized());
    assert_eq!(err.to_string(), "recovery reply has more than 2 chunks");

    // One byte too many: refused at the chunk that crosses it.
    let mut asm = ChunkAssembler::with_limits(ReplyLimits {
        max_bytes: total - 1,
        ..exact
    });
    asm.push_payload(&wire[0]).unwrap();
    asm.push_payload(&wire[1]).unwrap();
    let err = asm.push_payload(&wire[2]).unwrap_err();
    assert_eq!(err, AssemblyError::TooLarge { limit: total - 1 });
    assert_eq!(err.reason(), "too_large");

    // Decoded chunks count toward the chunk limit too.
    let mut asm = ChunkAssembler::with_limits(ReplyLimits {
        max_chunks: 1,
        ..exact
    });
    let chunks = reply.into_chunks(2);
    asm.push(chunks[0].clone()).unwrap();
    assert!(matches!(
        asm.push(chunks[1].clone()),
        Err(AssemblyError::TooManyChunks { limit: 1 })
    ));

    // A payload that is not a chunk is malformed, not a panic.
    let err = ChunkAssembler::new().push_payload(&[0xc1]).unwrap_err();
    assert_eq!(err.reason(), "malformed");
    assert!(!err.is_oversized());
}
