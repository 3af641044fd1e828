//! Service tests against real nats-server and etcd processes on free loopback ports.

use super::*;
use crate::engine::{ConnectionArgs, FleetArgs, RuntimeArgs};
use crate::protocol::{ClearReply, GenerateRequest, GenerateResponse};
use bytes::Bytes;
use engine_model::{EngineModelConfig, HybridConfig};
use futures::StreamExt;
use kv_events::{
    KvCacheEventData, KvEventBatch, LoadMetrics, LocalBlockHash, Namespace, RequestId,
};
use std::collections::HashSet;
use testbed::{EtcdServer, NatsServer};

pub(super) const WAIT: Duration = Duration::from_secs(20);

pub(super) struct Harness {
    // Field order: engines stop before the servers they talk to.
    handle: Option<EnginesHandle>,
    pub(super) nats: async_nats::Client,
    etcd: etcd_client::Client,
    pub(super) subjects: Subjects,
    _nats_server: NatsServer,
    _etcd_server: EtcdServer,
}

async fn start(fleet: FleetArgs, model: EngineModelConfig, time_scale: f64) -> Harness {
    start_shaped(fleet, model, time_scale, HybridConfig::default()).await
}

/// Engines of `fleet` running `model` shaped by `hybrid`, on a fresh NATS and etcd.
pub(super) async fn start_shaped(
    fleet: FleetArgs,
    model: EngineModelConfig,
    time_scale: f64,
    hybrid: HybridConfig,
) -> Harness {
    let nats_server = NatsServer::start().await.expect("nats-server starts");
    let etcd_server = EtcdServer::start().await.expect("etcd starts");
    let namespace = Namespace::new("enginetest").expect("valid");
    let args = EngineArgs {
        connection: ConnectionArgs::local(&nats_server.url(), &etcd_server.endpoint(), &namespace),
        fleet,
        model,
        runtime: RuntimeArgs {
            time_scale,
            lease_ttl_secs: 5,
            metrics_interval_ms: 20,
            shutdown: Default::default(),
        },
        http: Default::default(),
        cpu_tier: Default::default(),
        hybrid,
        kv_events: Default::default(),
        disaggregation: Default::default(),
    };
    let handle = spawn_engines(args, CancellationToken::new())
        .await
        .expect("engines start");
    let nats = async_nats::connect(nats_server.url()).await.expect("nats");
    let etcd = etcd_client::Client::connect([etcd_server.endpoint()], None)
        .await
        .expect("etcd");
    Harness {
        handle: Some(handle),
        nats,
        etcd,
        subjects: Subjects::new(namespace),
        _nats_server: nats_server,
        _etcd_server: etcd_server,
    }
}

impl Harness {
    /// Sends a generate request and returns the inbox its responses arrive on.
    pub(super) async fn generate(
        &self,
        worker: WorkerId,
        req: &GenerateRequest,
    ) -> async_nats::Subscriber {
        let payload = Bytes::from(kv_events::encode(req).expect("encodes"));
        self.send_raw(worker, payload).await
    }

    async fn send_raw(&self, worker: WorkerId, payload: Bytes) -> async_nats::Subscriber {
        let inbox = self.nats.new_inbox();
        let sub = self.nats.subscribe(inbox.clone()).await.expect("subscribe");
        self.nats
            .publish_with_reply(self.subjects.engine(worker, OP_GENERATE), inbox, payload)
            .await
            .expect("publish");
        sub
    }

    async fn clear(&self, worker: WorkerId) -> ClearReply {
        let reply = tokio::time::timeout(
            WAIT,
            self.nats
                .request(self.subjects.engine(worker, OP_CLEAR), Bytes::new()),
        )
        .await
        .expect("clear answered in time")
        .expect("clear request");
        kv_events::decode(&reply.payload).expect("clear reply decodes")
    }

    pub(super) async fn registered_workers(&mut self) -> Vec<WorkerRegistration> {
        let prefix = self.subjects.etcd_worker_prefix();
        let resp = self
            .etcd
            .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
            .await
            .expect("etcd get");
        let mut regs: Vec<WorkerRegistration> = resp
            .kvs()
            .iter()
            .map(|kv| serde_json::from_slice(kv.value()).expect("json registration"))
            .collect();
        regs.sort_by_key(|r| r.worker_id);
        regs
    }

    pub(super) async fn stop(&mut self) {
        let handle = self.handle.take().expect("running");
        handle.shutdown();
        tokio::time::timeout(WAIT, handle.wait())
            .await
            .expect("stops in time")
            .expect("clean stop");
    }
}

pub(super) async fn next_response(sub: &mut async_nats::Subscriber) -> GenerateResponse {
    let msg = tokio::time::timeout(WAIT, sub.next())
        .await
        .expect("response in time")
        .expect("inbox open");
    kv_events::decode(&msg.payload).expect("response decodes")
}

pub(super) fn request(
    id: &str,
    dp: u32,
    hashes: &[u64],
    tokens: u64,
    max_tokens: u64,
) -> GenerateRequest {
    GenerateRequest {
        request_id: RequestId::from(id),
        dp_rank: DpRank(dp),
        block_hashes: hashes.iter().map(|&h| LocalBlockHash(h)).collect(),
        num_tokens: tokens,
        max_tokens,
    }
}

pub(super) fn small_model() -> EngineModelConfig {
    EngineModelConfig {
        block_size: 16,
        num_gpu_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
    }
}

#[tokio::test]
async fn engines_register_serve_publish_and_revoke() {
    let fleet = FleetArgs {
        workers: 2,
        first_worker_id: 7,
        dp_size: 2,
    };
    let mut h = start(fleet, small_model(), 50.0).await;
    assert_eq!(
        h.handle.as_ref().map(|x| x.worker_ids().to_vec()),
        Some(vec![WorkerId(7), WorkerId(8)])
    );
    let regs = h.registered_workers().await;
    let urls = h
        .handle
        .as_ref()
        .map(|x| x.http_urls().to_vec())
        .unwrap_or_default();
    assert_eq!(urls.len(), 2);
    assert!(
        urls.iter().all(|u| u.starts_with("http://127.0.0.1:")),
        "{urls:?}"
    );
    // Every engine registers the epoch of its event stream, so the router follows it.
    let epoch = regs.first().map_or(0, |r| r.epoch);
    assert!(epoch > 0, "the registered epoch is the engines' start time");
    assert_eq!(
        regs,
        vec![
            WorkerRegistration {
                worker_id: WorkerId(7),
                dp_size: 2,
                block_size: 16,
                total_kv_blocks: 64,
                url: Some(urls[0].clone()),
                epoch,
                // No --max-model-len: one rank's cache, 64 blocks of 16 tokens.
                max_model_len: Some(1024),
                role: Default::default(),
                kv_transfer: None,
            },
            WorkerRegistration {
                worker_id: WorkerId(8),
                dp_size: 2,
                block_size: 16,
                total_kv_blocks: 64,
                url: Some(urls[1].clone()),
                epoch,
                max_model_len: Some(1024),
                role: Default::default(),
                kv_transfer: None,
            },
        ]
    );

    let mut events = h
        .nats
        .subscribe(h.subjects.kv_events(WorkerId(8)))
        .await
        .expect("sub");
    let mut metrics = h
        .nats
        .subscribe(h.subjects.load_metrics_all())
        .await
        .expect("sub");
    kv_cluster::barrier::server_barrier(&h.nats)
        .await
        .expect("subscribed at the server");

    // 40 tokens at block size 16: 2 full blocks are stored, the partial third is not.
    let mut inbox = h
        .generate(WorkerId(8), &request("a", 1, &[1, 2, 3], 40, 3))
        .await;
    assert_eq!(
        next_response(&mut inbox).await,
        GenerateResponse::FirstToken {
            cached_tokens: 0,
            prompt_tokens: 40
        }
    );
    assert_eq!(
        next_response(&mut inbox).await,
        GenerateResponse::Finished { output_tokens: 3 }
    );
    let batch: KvEventBatch = kv_events::decode(
        &tokio::time::timeout(WAIT, events.next())
            .await
            .expect("event")
            .expect("open")
            .payload,
    )
    .expect("batch decodes");
    assert_eq!(batch.worker_id, WorkerId(8));
    assert_eq!(batch.epoch, epoch, "events carry the registered epoch");
    assert_eq!(batch.events.len(), 1);
    assert_eq!(
        (batch.events[0].event_id, batch.events[0].dp_rank),
        (0, DpRank(1))
    );
    let KvCacheEventData::Stored {
        parent_hash: None,
        blocks,
        ..
    } = &batch.events[0].data
    else {
        panic!(
            "expected a root stored event, got {:?}",
            batch.events[0].data
        );
    };
    assert_eq!(
        blocks.iter().map(|b| b.tokens_hash.0).collect::<Vec<_>>(),
        vec![1, 2]
    );

    // Same prefix on the same rank: a prefix hit of 2 blocks.
    let mut inbox = h
        .generate(WorkerId(8), &request("b", 1, &[1, 2, 9], 40, 1))
        .await;
    assert_eq!(
        next_response(&mut inbox).await,
        GenerateResponse::FirstToken {
            cached_tokens: 32,
            prompt_tokens: 40
        }
    );
    assert_eq!(
        next_response(&mut inbox).await,
        GenerateResponse::Finished { output_tokens: 1 }
    );

    // Malformed payload, bad dp_rank and an oversized request are answered with errors.
    let mut inbox = h
        .send_raw(WorkerId(7), Bytes::from_static(b"\xc1garbage"))
        .await;
    assert!(matches!(
        next_response(&mut inbox).await,
        GenerateResponse::Error { .. }
    ));
    let mut inbox = h.generate(WorkerId(7), &request("c", 5, &[], 10, 1)).await;
    assert!(
        matches!(next_response(&mut inbox).await, GenerateResponse::Error { message } if message.contains("dp_rank"))
    );
    let mut inbox = h
        .generate(WorkerId(7), &request("d", 0, &[], 16 * 64, 1))
        .await;
    assert!(
        matches!(next_response(&mut inbox).await, GenerateResponse::Error { message } if message.contains("kv blocks"))
    );

    // Clear an idle worker: one Cleared event per rank, continuing the event ids.
    assert_eq!(h.clear(WorkerId(8)).await, ClearReply::Cleared);
    let mut cleared = HashSet::new();
    while cleared.len() < 2 {
        let msg = tokio::time::timeout(WAIT, events.next())
            .await
            .expect("event")
            .expect("open");
        let batch: KvEventBatch = kv_events::decode(&msg.payload).expect("decodes");
        for e in batch.events {
            if e.data == KvCacheEventData::Cleared {
                // Rank 1 used id 0 for a's blocks (b stored nothing new); rank 0 none.
                let expected = u64::from(e.dp_rank == DpRank(1));
                assert_eq!(e.event_id, expected, "{e:?}");
                cleared.insert(e.dp_rank);
            }
        }
    }

    // Metrics arrive for every (worker, rank) with the configured capacity.
    let mut seen = HashSet::new();
    while seen.len() < 4 {
        let msg = tokio::time::timeout(WAIT, metrics.next())
            .await
            .expect("metrics")
            .expect("open");
        let m: LoadMetrics = kv_events::decode(&msg.payload).expect("decodes");
        assert_eq!(m.kv_total_blocks, 64);
        seen.insert((m.worker_id, m.dp_rank));
    }

    h.stop().await;
    assert!(
        h.registered_workers().await.is_empty(),
        "leases revoked on shutdown"
    );
}

#[tokio::test]
async fn clear_is_refused_while_busy_and_shutdown_fails_in_flight_requests() {
    let fleet = FleetArgs {
        workers: 1,
        first_worker_id: 1,
        dp_size: 1,
    };
    // Real time and a million decode steps (hours at ~9 ms each): the request stays busy
    // for the whole test.
    let model = EngineModelConfig {
        num_gpu_blocks: 100_000,
        ..small_model()
    };
    let mut h = start(fleet, model, 1.0).await;
    let mut inbox = h
        .generate(WorkerId(1), &request("long", 0, &[1], 16, 1_000_000))
        .await;
    assert!(matches!(
        next_response(&mut inbox).await,
        GenerateResponse::FirstToken { .. }
    ));
    assert_eq!(
        h.clear(WorkerId(1)).await,
        ClearReply::Busy { active_requests: 1 }
    );
    // The same id again while active is rejected.
    let mut dup = h
        .generate(WorkerId(1), &request("long", 0, &[1], 16, 1))
        .await;
    assert!(
        matches!(next_response(&mut dup).await, GenerateResponse::Error { message } if message.contains("already active"))
    );
    h.stop().await;
    assert_eq!(
        next_response(&mut inbox).await,
        GenerateResponse::Error {
            message: "engine shutting down".to_owned()
        }
    );
}
