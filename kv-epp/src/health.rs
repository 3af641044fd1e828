//! gRPC health (`grpc.health.v1.Health/Check`), answered on demand: `liveness` (and
//! any unknown name is refused) is always serving while the process answers;
//! `readiness`, the empty name and the ext_proc service name are serving when a router
//! answers a probe route query and the worker directory names at least one worker.
//! Computed per check (one NATS round trip, at most 1 s) rather than by a background
//! loop: kubelet and the proxy probe every few seconds at most. `Watch` is not
//! offered (clients fall back to `Check`).

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::SERVICE_NAME;
use kv_gateway::router::RouterClient;
use kv_gateway::workers::WorkerUrls;
use std::pin::Pin;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// The health service name kubelet's liveness probe asks for.
pub const LIVENESS: &str = "liveness";
/// The health service name kubelet's readiness probe asks for.
pub const READINESS: &str = "readiness";

/// The picker's health, from its router client and worker directory.
#[derive(Clone)]
pub struct Health {
    router: RouterClient,
    workers: WorkerUrls,
}

impl Health {
    /// Health from `router` (probed) and `workers` (at least one known).
    pub fn new(router: RouterClient, workers: WorkerUrls) -> Self {
        Self { router, workers }
    }

    /// The tonic service.
    pub fn service(self) -> HealthServer<Self> {
        HealthServer::new(self)
    }

    async fn ready(&self) -> bool {
        !self.workers.is_empty() && self.router.probe().await
    }
}

type WatchStream = Pin<Box<dyn futures::Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl tonic_health::pb::health_server::Health for Health {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = request.into_inner().service;
        let serving = match service.as_str() {
            LIVENESS => true,
            "" | READINESS | SERVICE_NAME => self.ready().await,
            other => return Err(Status::not_found(format!("unknown service {other:?}"))),
        };
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        Ok(Response::new(HealthCheckResponse {
            status: status.into(),
        }))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("use Check"))
    }
}
