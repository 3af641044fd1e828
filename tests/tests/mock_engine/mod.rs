//! Driving the real mock engines (`kv-mocker engines`) over NATS from a test: serve a
//! prompt, ask for a dump as the router does.

use futures::StreamExt;
use kv_events::recovery::{ChunkAssembler, RecoveryChunk, RecoveryReply, RecoveryRequest};
use kv_events::{DpRank, Subjects, WorkerId};
use mocker::protocol::{GenerateRequest, GenerateResponse, OP_GENERATE};
use std::time::Duration;

/// How long [`generate`] and [`engine_dump`] wait for each reply message.
const ENGINE_WAIT: Duration = Duration::from_secs(20);

/// Serves one prompt of `tokens` (blocks of `block_size`) on mock engine `worker`, on
/// its rank 0, over NATS as a frontend does, and waits for it to finish.
pub async fn generate(
    nats: &async_nats::Client,
    subjects: &Subjects,
    block_size: u32,
    worker: WorkerId,
    id: &str,
    tokens: &[u32],
) -> anyhow::Result<()> {
    let request = GenerateRequest {
        request_id: kv_events::RequestId::from(id),
        dp_rank: DpRank(0),
        block_hashes: kv_events::compute_block_hashes(tokens, block_size),
        num_tokens: tokens.len() as u64,
        max_tokens: 2,
    };
    let inbox = nats.new_inbox();
    let mut replies = nats.subscribe(inbox.clone()).await?;
    nats.publish_with_reply(
        subjects.engine(worker, OP_GENERATE),
        inbox,
        kv_events::encode(&request)?.into(),
    )
    .await?;
    loop {
        let msg = tokio::time::timeout(ENGINE_WAIT, replies.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("reply inbox closed"))?;
        match kv_events::decode::<GenerateResponse>(&msg.payload)? {
            GenerateResponse::Finished { .. } => return Ok(()),
            GenerateResponse::Error { message } => anyhow::bail!("engine error: {message}"),
            GenerateResponse::FirstToken { .. } => {}
        }
    }
}

/// Asks `worker` for a dump of its rank 0 over NATS, as the router does.
pub async fn engine_dump(
    nats: &async_nats::Client,
    subjects: &Subjects,
    worker: WorkerId,
) -> anyhow::Result<RecoveryReply> {
    let request = RecoveryRequest {
        dp_rank: DpRank(0),
        epoch: 0,
        start_event_id: 0,
        dump: true,
    };
    let inbox = nats.new_inbox();
    let mut replies = nats.subscribe(inbox.clone()).await?;
    nats.publish_with_reply(
        subjects.kv_recovery(worker),
        inbox,
        kv_events::encode(&request)?.into(),
    )
    .await?;
    let mut asm = ChunkAssembler::new();
    loop {
        let msg = tokio::time::timeout(ENGINE_WAIT, replies.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("reply inbox closed"))?;
        let chunk: RecoveryChunk = kv_events::decode(&msg.payload)?;
        if let Some(reply) = asm.push(chunk)? {
            return Ok(reply);
        }
    }
}
