//! Choosing the endpoints of one request: tokenize the body as the gateway does, ask
//! the router with the proxy's subset as the eligible set and for `--fallbacks`
//! alternates, and name their pods, primary first (`primary,fb1,fb2`: the list the
//! protocol lets a proxy retry down). Only the primary is booked; [`crate::rebook`]
//! moves the booking when the proxy served an alternate.

use crate::metrics::EppMetrics;
use crate::pods::{Pods, pod_of};
use crate::rebook::{Held, Reroute};
use kv_events::DpRank;
use kv_events::routing::RouteRequest;
use kv_gateway::error::ApiError;
use kv_gateway::flow::{BodyKind, Flow};
use kv_gateway::router::RouterClient;
use kv_gateway::session::session_of;
use kv_gateway::workers::WorkerUrls;
use tracing::warn;

/// A request's endpoints and its booking.
pub struct Pick {
    /// The booking on the primary's worker.
    pub held: Held,
    /// Pod addresses (`ip:port`), the primary first, then the alternates in the
    /// router's cost order (those without an engine URL left out).
    pub endpoints: Vec<String>,
    /// The primary's dp_rank (the dp-rank header).
    pub dp_rank: DpRank,
    /// What moving the booking needs; taken by the first served report.
    pub reroute: Option<Reroute>,
}

impl Pick {
    /// The proxy reported the endpoint it `served` (`None`: no report): counted
    /// (`match`, `mismatch`, `absent`), and when it is another registered worker's
    /// pod than the booked one, the booking moves there ([`Held::move_to`]).
    pub fn served(
        &mut self,
        served: Option<String>,
        workers: &WorkerUrls,
        router: &RouterClient,
        metrics: &EppMetrics,
    ) {
        let primary = &self.endpoints[0];
        let Some(served) = served else {
            metrics.served("absent");
            return;
        };
        if served == *primary {
            metrics.served("match");
            return;
        }
        metrics.served("mismatch");
        warn!(picked = %primary, %served, "the proxy served another endpoint");
        let Some(worker) = Pods::of(workers).worker(&served) else {
            return; // not a registered worker's pod: nothing to book there
        };
        if let Some(reroute) = self.reroute.take().filter(|_| worker != self.held.worker()) {
            self.held
                .move_to(worker, reroute, router.clone(), metrics.clone());
        }
    }
}

/// Tokenizes `body` (of `kind`, with `headers`) and routes it inside `subset` (pod
/// addresses; `None`: every pod), asking for `fallbacks` alternates.
///
/// # Errors
/// 400 for a path or body that is not an OpenAI completion or chat request, 503
/// when nothing in the subset is registered (or more workers than a route query may
/// name) or the picked worker has no engine URL, and the router's refusals as
/// [`kv_gateway::router::RouterClient::route`] maps them.
pub async fn choose(
    flow: &Flow,
    fallbacks: u8,
    kind: Option<BodyKind>,
    headers: &axum::http::HeaderMap,
    subset: Option<&[String]>,
    body: &[u8],
) -> Result<Pick, ApiError> {
    let kind = kind.ok_or_else(|| {
        ApiError::bad_request("the path is neither /v1/completions nor /v1/chat/completions")
    })?;
    let session = session_of(headers)?;
    let tokenized = flow.tokenize_body(kind, body, session).await?;
    let eligible = match subset {
        None => Vec::new(),
        Some(subset) => Pods::of(&flow.workers).eligible_in(subset)?,
    };
    let request = RouteRequest {
        eligible_workers: eligible,
        fallbacks,
        session_id: tokenized.session,
        ..RouteRequest::new(flow.router.request_id(), tokenized.prompt)
    };
    let (decision, booking) = flow.router.route_request(&request).await?;
    let Some(primary) = pod_of(&flow.workers, decision.worker_id) else {
        // Registered without an engine URL: the proxy cannot name its pod.
        return Err(ApiError::unavailable(format!(
            "worker {} has no engine URL to name its pod",
            decision.worker_id
        )));
    };
    let endpoints = std::iter::once(primary)
        .chain(
            decision
                .fallbacks
                .iter()
                .filter_map(|f| pod_of(&flow.workers, f.worker_id)),
        )
        .collect();
    Ok(Pick {
        held: Held::new(booking, decision.worker_id),
        endpoints,
        dp_rank: decision.dp_rank,
        reroute: Some(Reroute {
            prompt: request.prompt,
            session: request.session_id,
            dp_rank: decision.dp_rank,
        }),
    })
}
