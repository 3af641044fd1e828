//! The router, seen from the gateway: a NATS request-reply client for
//! `{ns}.router.route` and a publisher of lifecycle messages — exactly what any other
//! frontend of the public protocol does (docs/protocol.md).
//!
//! A route reply books the request on the chosen worker (for a disaggregated request,
//! on its prefill and decode workers, one booking each in the router, both named by
//! the request id); from then on a [`Booking`] owns it and guarantees a `freed`
//! message on every path, including a client that disconnects mid-stream (the booking
//! is dropped with the response stream), which frees both halves.
//!
//! Queries that arrive while one of the gateway's is being answered wait for it and
//! leave together as one `route_batch` (module `router::grouping`): one replica then
//! places them all, each seeing the others' bookings. For a while after a replica has
//! answered, the gateway's queries go to one replica alone, by default the lowest
//! replica id it has heard from, so that gateways agree on it (module
//! `router::asker`, replica affinity).

use crate::error::ApiError;
use asker::Asker;
use async_nats::{Client, Event};
use grouping::Grouper;
use kv_events::routing::{
    LifecycleEvent, LifecycleMessage, Prompt, RouteDecision, RouteErrorCode, RouteReply,
    RouteRequest, SessionId,
};
use kv_events::{RequestId, RouterId, Subjects, WorkerId, decode, encode};
use prometheus::{Histogram, IntCounter, IntCounterVec};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;
use tracing::debug;

mod again;
mod asker;
mod grouping;
mod lifecycle;
mod roll_call;
mod stalls;

pub use grouping::{Grouping, MAX_GROUP};

/// How the gateway talks to the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterSettings {
    /// Longest a routing query may take (above the router's queue wait).
    pub timeout: Duration,
    /// Interval of `keep_alive` lifecycle messages for a booked request.
    pub keep_alive: Duration,
    /// Most lifecycle messages per NATS message, 1 to
    /// [`kv_events::limits::MAX_LIFECYCLE_BATCH`] (1 for routers older than the batch
    /// form).
    pub lifecycle_batch: usize,
    /// How route queries that arrive together are grouped (module `router::grouping`).
    pub grouping: Grouping,
    /// The router's `--max-message-bytes`, in bytes: no batch is larger.
    pub max_message_bytes: usize,
    /// Replica affinity; `None`: every query through the queue group (module
    /// `router::asker`, "replica affinity").
    pub affinity: Option<ReplicaAffinity>,
}

/// Replica affinity's settings (module `router::asker`, "replica affinity").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaAffinity {
    /// How long the gateway's queries go to the replica that answered one, before
    /// the queue group picks again.
    pub window: Duration,
    /// How long a query may go unanswered before the gateway suspects a stalled
    /// replica: a pin to the replica it went to is let go, and the replicas are
    /// pinged, each given as long; a query held by a silent one is asked again of one
    /// that answered (modules `router::stalls`, `router::again`).
    pub patience: Duration,
    /// Which replica a pin goes to once a query through the queue group is answered.
    pub target: PinTarget,
}

/// Which replica a gateway pins its queries to once a query through the queue group
/// is answered (module `router::asker`, "which replica").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PinTarget {
    /// The lowest replica id the gateway has heard from, leaving out any found gone,
    /// silent, overloaded or slow within the last window: gateways that have heard
    /// from the same replicas pin to the same one, so a burst spread over several
    /// gateways is placed by one replica that sees every booking of it.
    #[default]
    Lowest,
    /// The replica that answered: gateways spread over the replicas, and a burst
    /// spread over gateways is placed by several replicas, each blind to the others'
    /// bookings for a sync lag.
    Answered,
}

/// What the router client records, in the gateway's registry
/// ([`crate::metrics::GatewayMetrics::router`]).
#[derive(Clone)]
pub struct RouterMetrics {
    /// Route queries per NATS message (`kv_gateway_route_group_queries`).
    pub group_sizes: Histogram,
    /// Replica affinity's pins taken and let go, by `event`: `pinned`, `gone`,
    /// `overloaded`, `timed_out` (no answer within the patience), `failed`
    /// (`kv_gateway_route_affinity_total`).
    pub affinity: IntCounterVec,
    /// Stalled replicas and the queries asked again, by `event`: `silent`,
    /// `asked_again`, `again_answered` (`kv_gateway_route_stalls_total`).
    pub stalls: IntCounterVec,
}

/// The counters of `kv_gateway_route_stalls_total` a query counts (module
/// `router::again`).
#[derive(Clone)]
struct StallEvents {
    asked_again: IntCounter,
    again_answered: IntCounter,
}

/// Whether the NATS connection is up, as its events tell (the start: as the client
/// says): a task reads `events`, keeps the returned flag and passes every event on
/// through the returned receiver. When `events` ends, the flag keeps its last value.
fn watch_connection(
    nats: &Client,
    mut events: mpsc::UnboundedReceiver<Event>,
) -> (watch::Receiver<bool>, mpsc::UnboundedReceiver<Event>) {
    let up = nats.connection_state() == async_nats::connection::State::Connected;
    let (connected, watched) = watch::channel(up);
    let (forward, passed) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            let up = match event {
                Event::Connected => Some(true),
                Event::Disconnected => Some(false),
                _ => None,
            };
            if let Some(up) = up {
                connected.send_replace(up);
            }
            // The lifecycle publisher may have ended (its queue closed): nothing waits.
            let _ = forward.send(event);
        }
    });
    (watched, passed)
}

/// Routing queries and lifecycle messages over NATS.
#[derive(Clone)]
pub struct RouterClient {
    nats: Client,
    subjects: Arc<Subjects>,
    keep_alive: Duration,
    /// Sends queries alone; the grouper, when grouping is on, sends them through it.
    asker: Asker,
    grouper: Option<Grouper>,
    /// Request ids: a random per-process prefix and a counter, unique across
    /// gateway replicas without coordination.
    prefix: Arc<str>,
    next: Arc<AtomicU64>,
    /// Lifecycle messages, published in order by one task (a `freed` must not
    /// overtake the `prefill_done` before it). Unbounded so a dropped booking can send
    /// without waiting; it holds at most a few messages per request in flight.
    lifecycle: mpsc::UnboundedSender<LifecycleMessage>,
    stall_events: StallEvents,
}

impl RouterClient {
    /// A client with `settings`, recording into `metrics`; `connection` tells it of
    /// the NATS connection's events (for re-sending `freed` after an outage; module
    /// `router::lifecycle`).
    /// Must be called inside a tokio runtime: it spawns the lifecycle publisher and,
    /// with grouping, the grouping task, which end when the last clone of the client
    /// is dropped.
    pub fn new(
        nats: Client,
        subjects: Subjects,
        settings: RouterSettings,
        metrics: RouterMetrics,
        connection: mpsc::UnboundedReceiver<Event>,
    ) -> Self {
        let (lifecycle, queue) = mpsc::unbounded_channel::<LifecycleMessage>();
        let batch = settings
            .lifecycle_batch
            .clamp(1, kv_events::limits::MAX_LIFECYCLE_BATCH);
        let (connected, connection) = watch_connection(&nats, connection);
        lifecycle::spawn(nats.clone(), subjects.clone(), batch, queue, connection);
        let subjects = Arc::new(subjects);
        let asker = Asker::new(
            nats.clone(),
            connected,
            subjects.clone(),
            settings.timeout,
            settings.max_message_bytes,
            settings.affinity,
            &metrics,
        );
        let grouper = (settings.grouping.max > 1).then(|| {
            let freed = lifecycle.clone();
            Grouper::spawn(asker.clone(), settings.grouping, metrics.group_sizes, freed)
        });
        Self {
            nats,
            subjects,
            keep_alive: settings.keep_alive,
            asker,
            grouper,
            prefix: format!("gw-{:016x}", rand::random::<u64>()).into(),
            next: Arc::new(AtomicU64::new(0)),
            lifecycle,
            stall_events: StallEvents {
                asked_again: metrics.stalls.with_label_values(&["asked_again"]),
                again_answered: metrics.stalls.with_label_values(&["again_answered"]),
            },
        }
    }

    /// A request id no other request of this cluster uses.
    pub fn request_id(&self) -> RequestId {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        RequestId(format!("{}-{n}", self.prefix))
    }

    /// The NATS client (for readiness).
    pub fn nats(&self) -> &Client {
        &self.nats
    }

    /// Asks the router for a worker for `prompt` of the session `session` (if any),
    /// excluding `exclude`, and, with `allow_disaggregation`, for a prefill worker
    /// too when the router finds one worth it. On success the request is booked and
    /// the returned [`Booking`] owns it.
    ///
    /// # Errors
    /// An [`ApiError`]: 429 for `overloaded`, 503 for `no_workers` or no router
    /// answering, 400 for a request the router refuses, 500 otherwise.
    pub async fn route(
        &self,
        request_id: RequestId,
        prompt: Prompt,
        exclude: &[WorkerId],
        session: Option<&SessionId>,
        allow_disaggregation: bool,
    ) -> Result<(RouteDecision, Booking), ApiError> {
        self.route_request(&RouteRequest {
            exclude_workers: exclude.to_vec(),
            session_id: session.cloned(),
            allow_disaggregation,
            ..RouteRequest::new(request_id, prompt)
        })
        .await
    }

    /// Asks the router with `request` as given (any field of the public protocol,
    /// e.g. an eligible set and fallbacks for an endpoint picker). On success the
    /// request is booked and the returned [`Booking`] owns it.
    ///
    /// # Errors
    /// As [`RouterClient::route`].
    pub async fn route_request(
        &self,
        request: &RouteRequest,
    ) -> Result<(RouteDecision, Booking), ApiError> {
        let reply = self.ask(request).await?;
        match reply {
            RouteReply::Routed(decision) => {
                let booking = Booking::new(self, decision.request_id.clone());
                Ok((decision, booking))
            }
            RouteReply::Error(e) => Err(match e.code {
                RouteErrorCode::Overloaded => ApiError::overloaded(e.message),
                RouteErrorCode::NoWorkers | RouteErrorCode::RankUnavailable => {
                    ApiError::unavailable(e.message)
                }
                RouteErrorCode::BadRequest => ApiError::bad_request(e.message),
                RouteErrorCode::Internal => ApiError::unavailable(e.message),
            }),
        }
    }

    /// Whether a router answers on the route subject (see `probe`).
    pub async fn probe(&self) -> bool {
        probe(&self.nats, &self.subjects).await
    }

    fn publish(&self, request_id: &RequestId, event: LifecycleEvent) {
        // The receiver lives as long as any client clone; after that nothing is sent.
        let _ = self.lifecycle.send(LifecycleMessage {
            request_id: request_id.clone(),
            event,
        });
    }
}

/// Whether a router answers on the route subject within a second (see [`ping`]).
async fn probe(nats: &Client, subjects: &Subjects) -> bool {
    ping(nats, subjects.route().into(), Duration::from_secs(1))
        .await
        .is_ok()
}

/// Whether a router answers on `subject` within `wait`: a query with an empty prompt,
/// which every router refuses as `bad_request` without booking anything. `Err(true)`:
/// nothing subscribes `subject` (NATS "no responders"); `Err(false)`: no answer in
/// time, or none that decodes.
async fn ping(nats: &Client, subject: async_nats::Subject, wait: Duration) -> Result<(), bool> {
    match readiness_probe(nats, subject, wait).await {
        Ok(reply) if decode::<RouteReply>(&reply.payload).is_ok() => Ok(()),
        Ok(_) => Err(false),
        Err(e) => Err(e.kind() == async_nats::client::RequestErrorKind::NoResponders),
    }
}

/// The replica that answers a readiness probe on `subject` within `wait` (its
/// [`kv_events::ROUTER_ID_HEADER`]); `None` for no answer, or one that names no
/// replica.
async fn probe_replica(
    nats: &Client,
    subject: async_nats::Subject,
    wait: Duration,
) -> Option<RouterId> {
    named_replica(&readiness_probe(nats, subject, wait).await.ok()?)
}

/// The replica a reply names in its [`kv_events::ROUTER_ID_HEADER`], if it names one
/// that parses.
fn named_replica(reply: &async_nats::Message) -> Option<RouterId> {
    let named = reply.headers.as_ref()?.get(kv_events::ROUTER_ID_HEADER)?;
    RouterId::parse_hex(named.as_str())
}

/// A route query with an empty prompt on `subject`, which every router refuses as
/// `bad_request` without booking anything, answered within `wait`.
async fn readiness_probe(
    nats: &Client,
    subject: async_nats::Subject,
    wait: Duration,
) -> Result<async_nats::Message, async_nats::client::RequestError> {
    let request = RouteRequest::new(
        RequestId(READINESS_PROBE_ID.into()),
        Prompt::Tokens { token_ids: vec![] },
    );
    let payload = encode(&request).map_err(|e| {
        async_nats::client::RequestError::with_source(
            async_nats::client::RequestErrorKind::Other,
            e,
        )
    })?;
    let asked = nats.send_request(
        subject,
        async_nats::client::Request::new()
            .payload(payload.into())
            .timeout(Some(wait)),
    );
    asked.await
}

/// How long after a round of pings starts the replicas that have not answered are
/// judged silent (module `router::stalls`), and a roll call stops listening (module
/// `router::roll_call`), once the first answer came `first_answer` after the start:
/// eight times that, but at least a tenth of the patience and at most the patience. Why: a live
/// replica answers a ping in well under a millisecond (a readiness probe is refused
/// before any scheduling), and one that takes eight times as long as its peer while
/// queries wait on it is better asked around than waited for; a wrong verdict costs
/// one more query per slow query, whose loser is freed at once (module
/// `router::again`). The floor keeps a replica that is merely behind by a few
/// milliseconds of its queue from being judged.
fn verdict_after(first_answer: Duration, patience: Duration) -> Duration {
    (first_answer * 8).max(patience / 10).min(patience)
}

/// The request id of the gateway's readiness probes and pings.
const READINESS_PROBE_ID: &str = "gateway-readiness-probe";

/// A request booked on a worker (or a pair of them). Sends `remote_prefill_done` once
/// ([`Booking::remote_prefill_done`]), `prefill_done` once ([`Booking::prefill_done`]),
/// `keep_alive` every interval while it lives, and `freed` exactly once: when
/// [`Booking::free`] is called or, failing that, when it is dropped — so an error, a
/// timeout or a client that goes away mid-stream never leaves a booking behind.
pub struct Booking {
    router: RouterClient,
    request_id: RequestId,
    remote_prefill_done: bool,
    prefill_done: bool,
    freed: bool,
    keep_alive: AbortHandle,
}

impl Booking {
    fn new(router: &RouterClient, request_id: RequestId) -> Self {
        let keeper = router.clone();
        let id = request_id.clone();
        let every = router.keep_alive;
        let keep_alive = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.tick().await; // immediate; the booking itself is fresh
            loop {
                ticks.tick().await;
                keeper.publish(&id, LifecycleEvent::KeepAlive);
            }
        })
        .abort_handle();
        Self {
            router: router.clone(),
            request_id,
            remote_prefill_done: false,
            prefill_done: false,
            freed: false,
            keep_alive,
        }
    }

    /// The booked request's id.
    pub fn request_id(&self) -> &RequestId {
        &self.request_id
    }

    /// The prefill worker of a disaggregated request answered: the router releases
    /// its prefill load (the blocks it holds for the transfer stay booked until
    /// `prefill_done`). Sent once, and never after `prefill_done`.
    pub fn remote_prefill_done(&mut self) {
        if !self.remote_prefill_done && !self.prefill_done && !self.freed {
            self.remote_prefill_done = true;
            self.router
                .publish(&self.request_id, LifecycleEvent::RemotePrefillDone);
        }
    }

    /// The first token arrived: the request now decodes (for a disaggregated
    /// request, the transfer is over and the router frees the prefill half). Sent
    /// once.
    pub fn prefill_done(&mut self) {
        if !self.prefill_done && !self.freed {
            self.prefill_done = true;
            self.router
                .publish(&self.request_id, LifecycleEvent::PrefillDone);
        }
    }

    /// The request ended (finished, failed or abandoned): its load is released.
    pub fn free(mut self) {
        self.release();
    }

    fn release(&mut self) {
        if !self.freed {
            self.freed = true;
            self.keep_alive.abort();
            debug!(request_id = %self.request_id, "freed");
            self.router.publish(&self.request_id, LifecycleEvent::Freed);
        }
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.release();
    }
}
