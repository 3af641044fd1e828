//! A gateway in front of the protocol-level engines and router of `pd.rs`, and what
//! the disaggregation tests check of it.

use super::fixture::{self, BLOCK};
use super::pd::{self, Behaviour, PairRouter, PdEngine};
use super::routed::{self, Routed};
use integration_tests::{TestCluster, eventually};
use kv_events::disaggregation::{TransferProtocol, WorkerRole};
use kv_gateway::Gateway;
use serde_json::json;
use std::time::Duration;

pub const WAIT: Duration = Duration::from_secs(20);

/// One engine of a fleet: worker id, role, behaviour.
pub type Member = (u64, WorkerRole, Behaviour);

/// A gateway in front of a [`PairRouter`] and engines of one transfer protocol.
pub struct PdStack {
    gateway: Option<Gateway>,
    engines: Vec<PdEngine>,
    /// The router, with what it heard.
    pub router: PairRouter,
    /// The gateway's base URL.
    pub base: String,
    /// A client for it.
    pub http: reqwest::Client,
    _cluster: TestCluster,
}

impl PdStack {
    /// `fleet` of `protocol`, decode workers pausing `token_pause` before each token,
    /// and a gateway with `flags`.
    pub async fn start(
        protocol: TransferProtocol,
        fleet: &[Member],
        token_pause: Duration,
        flags: &[&str],
    ) -> Self {
        let mut cluster = TestCluster::start(BLOCK).await.unwrap();
        let rooms = pd::rooms();
        let mut engines = Vec::new();
        for &(worker, role, behaviour) in fleet {
            let kind = (role, protocol);
            let engine =
                PdEngine::start(&mut cluster, worker, kind, behaviour, token_pause, &rooms).await;
            engines.push(engine);
        }
        let of = |role| {
            let members = fleet.iter().filter(move |m| m.1 == role);
            members.map(|m| kv_events::WorkerId(m.0)).collect()
        };
        let router =
            PairRouter::start(&cluster, of(WorkerRole::Prefill), of(WorkerRole::Decode)).await;
        let gateway = fixture::start_gateway(&cluster, flags).await;
        let base = format!("http://{}", gateway.local_addr());
        let http = kv_cluster::http::client().unwrap();
        fixture::wait_ready(&http, &base).await;
        eventually("the gateway to know every worker", WAIT, || async {
            let workers = gateway.workers();
            engines
                .iter()
                .all(|e| workers.endpoint(e.worker).is_some())
                .then_some(())
        })
        .await
        .unwrap();
        Self {
            gateway: Some(gateway),
            engines,
            router,
            base,
            http,
            _cluster: cluster,
        }
    }

    /// The engine of `worker`.
    pub fn engine(&self, worker: u64) -> &PdEngine {
        self.engines.iter().find(|e| e.worker.0 == worker).unwrap()
    }

    /// The gateway's metrics.
    pub fn metrics(&self) -> &kv_gateway::metrics::GatewayMetrics {
        self.gateway.as_ref().unwrap().metrics()
    }

    /// A completion of `tokens` for `max_tokens` tokens.
    pub async fn complete(&self, tokens: &[u32], stream: bool, max_tokens: u32) -> Routed {
        routed::complete(&self.http, &self.base, tokens, stream, max_tokens).await
    }

    /// Waits until the router holds no booking.
    pub async fn all_freed(&self) {
        eventually("every booking to be freed", WAIT, || async {
            (self.router.booked() == 0).then_some(())
        })
        .await
        .unwrap();
    }

    /// Stops the gateway.
    pub async fn stop(mut self) {
        if let Some(gateway) = self.gateway.take() {
            gateway.shutdown().await.unwrap();
        }
    }
}

/// A prompt of six full blocks and a partial one, from token `first`.
pub fn prompt(first: u32) -> Vec<u32> {
    (first..first + 6 * BLOCK + 5).collect()
}

/// An engine that serves.
pub const SERVE: Behaviour = Behaviour::Serve;

/// Prefill worker 11 and decode worker 21, both serving.
pub const PAIR: [Member; 2] = [
    (11, WorkerRole::Prefill, SERVE),
    (21, WorkerRole::Decode, SERVE),
];

/// Every request `decode` received carried the `kv_transfer_params` that `prefill`
/// answered to the same request id, unchanged; returns how many it received.
pub fn assert_params_forwarded(prefill: &PdEngine, decode: &PdEngine) -> usize {
    let answered = prefill.answered();
    let decoded = decode.received();
    for request in &decoded {
        let id = &request.request_id;
        let params = answered.iter().find(|(answered, _)| answered == id);
        let (_, params) = params.unwrap_or_else(|| panic!("no prefill answered {id}"));
        assert_eq!(&request.body["kv_transfer_params"], params, "{id}");
        assert_eq!(request.body["stream"], json!(true));
    }
    decoded.len()
}
