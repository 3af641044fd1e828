//! One NATS request to the router's route service, single or batch, with the
//! gateway's deadline and its errors mapped to what the client is told; and the
//! replica affinity that decides where it goes.
//!
//! Replica affinity, why: router replicas answer from one NATS queue group and learn
//! each other's bookings over NATS a sync lag later (p50 under 1 ms, p99 25–50 ms
//! with 8 replicas on one 2-core host). Route grouping (module `router::grouping`)
//! places the queries that arrive together with one replica, but a burst that reaches
//! the gateway spread over tens of ms still leaves in several messages, and the queue
//! group gives each to a random replica, which places it without the bookings the
//! others just made. So the gateway sends its queries to one replica alone
//! (`{ns}.router.at.{id}.route`, and `….route_batch`) for `window`: the replica then
//! places every query of the gateway seeing the gateway's earlier bookings at once, as
//! one replica would (a session's read-your-writes, the usual way to get it from
//! replicas without consensus).
//!
//! Which replica (`--route-affinity-target`): by default the lowest replica id the
//! gateway has heard from ([`PinTarget::Lowest`]; a replica names itself in every
//! reply's [`kv_events::ROUTER_ID_HEADER`]), leaving out replicas found gone
//! (forgotten), silent, or let go within the last window (`overloaded`, no answer in
//! time, an error). So gateways that have heard from the same replicas pin to the
//! same one: a burst that a load balancer spreads over several gateways is placed by
//! one replica that sees every booking of it, as one replica places it. Spread over
//! replicas blind to each other for a sync lag, the same-instant bursts of the
//! Mooncake trace cost 1.17×, 1.35× and 1.57× the mean TTFT of one replica at 2, 4
//! and 8 replicas (`kv-mocker lab replicas`, docs/benchmarks.md "Blind replicas").
//! The gateway hears of replicas from the answers to its queries and from roll calls
//! (one request every replica answers, naming itself; module `router::roll_call`):
//! when it starts, when an answer comes from a replica it did not know, and each
//! time a window passes. A pin that holds moves at once to a lower replica heard of
//! since. Routers from before the roll call do not answer it; the gateway then sends
//! readiness probes through the queue group instead (each reaches a replica at
//! random, and every router answers it without booking): 16 when it starts, 2 at
//! each later call. When a window passes the pin is renewed to the lowest usable
//! replica known, with no query through the queue group; a query goes through the
//! queue group only while none is known, and the gateway then pins to the lowest of
//! those it knows and the one that answered. The cost is that one replica decides while it
//! is healthy and the others keep its bookings and stand by; one replica decides
//! tens of thousands of routes per second, and one that answers `overloaded` is left
//! out for a window. [`PinTarget::Answered`] pins to the replica that answered a
//! query through the queue group, once per window, spreading gateways over
//! replicas, and calls no roll.
//!
//! The pin is dropped at once when that replica is gone (NATS "no responders": the
//! query is asked again through the queue group, so no query fails for it), answers
//! `overloaded` (its queue is full: others should take the load), or leaves a query
//! unanswered for the affinity's `patience` (250 ms by default). The last is a
//! replica that stalls (a process stopped or starved, a partition that resets no
//! connection): NATS still delivers to it, and without the patience every query of
//! the gateway would wait on it up to the route timeout (10 s), as long as it
//! stalls. The queries it already holds are asked again of a live replica if pings
//! show it stalled (modules `router::stalls` and `router::again`); a slow query may
//! instead be waiting in a live replica's queue for a busy fleet, and is then left
//! there. Replicas that set no header (older routers, stand-ins), and
//! a replica that answers `overloaded` through the queue group, are not pinned.
//! Each pin taken and each let go is counted by `event` in
//! `kv_gateway_route_affinity_total` (`pinned`; `gone`, `overloaded`, `timed_out`
//! for the patience run out, `failed` for any other error of the request): a steady
//! rate of `gone` or `timed_out` means replicas come and go, or stall.
//!
//! Outages: a query is handed to the NATS client only while it is connected; while
//! it is not, the query waits for the connection within the route timeout, then
//! fails. async-nats would otherwise hold a query sent during an outage and send it
//! on reconnect, also one whose caller has given up by then: a router would book it
//! with nobody left to free it, for the router's request TTL (10 minutes). A single
//! query that NATS says no router subscribes ("no responders": just after a NATS
//! restart, before the routers have subscribed again, or while a lone replica
//! restarts) is asked again with backoff within the route timeout.
//!
//! Cost: one mutex lock per query to read the pin, one per answer to note the
//! replica that sent it, and one timer per query to the pinned replica; about 45
//! bytes of header per reply.

use super::stalls::Stalls;
use super::{PinTarget, ReplicaAffinity, RouterMetrics};
use crate::error::ApiError;
use async_nats::client::{RequestError, RequestErrorKind};
use async_nats::{Client, Message, Subject};
use backon::BackoffBuilder as _;
use events::{Events, Release};
use kv_events::routing::{RouteBatchReply, RouteErrorCode, RouteReply};
use kv_events::{RouterId, Subjects, decode};
use serde::de::DeserializeOwned;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::debug;

mod events;
mod pin;

use pin::{Affinity, Pin};

/// Readiness probes through the queue group when the gateway starts, under
/// [`PinTarget::Lowest`]: each reaches a replica at random, so 16 hear from about 7
/// of 8 replicas.
const STARTUP_PROBES: usize = 16;

/// The first wait before a query that found no router subscribed is asked again.
const NO_ROUTER_FIRST_WAIT: Duration = Duration::from_millis(5);

/// The longest wait between two asks of a query that finds no router subscribed.
const NO_ROUTER_MAX_WAIT: Duration = Duration::from_millis(250);

/// Sends route queries; cheap to clone (clones share the pin).
#[derive(Clone)]
pub(super) struct Asker {
    nats: Client,
    /// Whether `nats` is connected (module docs, "outages").
    connected: watch::Receiver<bool>,
    subjects: Arc<Subjects>,
    /// The queue group's subjects.
    shared: Services,
    timeout: Duration,
    /// The router's `--max-message-bytes` as the gateway knows it (its own flag).
    max_message_bytes: usize,
    /// `None`: every query goes through the queue group.
    affinity: Option<Arc<Affinity>>,
    /// The replicas heard from, pinged when a query waits out the patience (module
    /// `router::stalls`); with affinity only.
    stalls: Option<Arc<Stalls>>,
}

/// A replica's answer, and the pinned replica it came from (`None`: through the
/// queue group).
struct Answer {
    message: Message,
    pinned: Option<RouterId>,
}

/// Which route service a request is for.
#[derive(Clone, Copy)]
enum Service {
    Single,
    Batch,
}

/// The subjects of the route and batch route services: the queue group's, or one
/// replica's own.
#[derive(Clone)]
struct Services {
    route: Subject,
    route_batch: Subject,
}

impl Services {
    fn subject(&self, service: Service) -> Subject {
        match service {
            Service::Single => self.route.clone(),
            Service::Batch => self.route_batch.clone(),
        }
    }
}

impl Asker {
    /// Asks on `subjects`' route and batch route subjects, waiting at most `timeout`
    /// per request; with `affinity`, pinned for its window to the replica that
    /// answered, counting pins and releases by event in `metrics.affinity`, and
    /// pinging the replicas when a query waits out the patience, counting those
    /// silent in `metrics.stalls` (module docs, module `router::stalls`).
    pub(super) fn new(
        nats: Client,
        connected: watch::Receiver<bool>,
        subjects: Arc<Subjects>,
        timeout: Duration,
        max_message_bytes: usize,
        affinity: Option<ReplicaAffinity>,
        metrics: &RouterMetrics,
    ) -> Self {
        let stalls = affinity.map(|a| {
            let (nats, silent) = (nats.clone(), metrics.stalls.with_label_values(&["silent"]));
            let stalls = Arc::new(Stalls::new(nats, subjects.clone(), a.patience, silent));
            // The replicas there are, before the first query (`Asker::pinned`).
            if a.target == PinTarget::Lowest && tokio::runtime::Handle::try_current().is_ok() {
                stalls.discover(STARTUP_PROBES);
            }
            stalls
        });
        let affinity = affinity.map(|settings| {
            Arc::new(Affinity {
                settings,
                pin: Mutex::new(None),
                counted: Events::new(&metrics.affinity),
            })
        });
        Self {
            nats,
            connected,
            shared: Services {
                route: subjects.route().into(),
                route_batch: subjects.route_batch().into(),
            },
            subjects,
            timeout,
            max_message_bytes,
            affinity,
            stalls,
        }
    }

    /// The replicas heard from, to look for a stalled one among; `None` without
    /// replica affinity.
    pub(super) fn stalls(&self) -> Option<&Stalls> {
        self.stalls.as_deref()
    }

    /// Asks one encoded `RouteRequest` of replica `router` (on its own subject), or
    /// through the queue group if it is gone.
    ///
    /// # Errors
    /// As [`Asker::single`].
    pub(super) async fn single_at(
        &self,
        router: RouterId,
        payload: Vec<u8>,
    ) -> Result<RouteReply, ApiError> {
        let payload = bytes::Bytes::from(payload);
        let deadline = Instant::now() + self.timeout;
        let subject: Subject = self.subjects.route_at(router).into();
        let message = match self.send(subject, payload.clone(), deadline).await {
            Err(e) if e.kind() == RequestErrorKind::NoResponders => {
                if let Some(stalls) = &self.stalls {
                    stalls.forget(router);
                }
                let shared = self.shared.subject(Service::Single);
                self.send_until_answered(shared, payload, deadline).await
            }
            sent => sent,
        };
        let answer = Answer {
            message: message.map_err(refused)?,
            pinned: None,
        };
        let reply: RouteReply = decoded(&answer.message)?;
        self.settle(&answer, is_overloaded(&reply));
        Ok(reply)
    }

    /// Largest payload a batch may have, in bytes: what the NATS server takes (its
    /// `max_payload`, 1 MiB by default) and the router reads.
    pub(super) fn max_payload(&self) -> usize {
        match self.nats.server_info().max_payload {
            0 => self.max_message_bytes,
            server => server.min(self.max_message_bytes),
        }
    }

    /// Asks one encoded `RouteRequest`.
    ///
    /// # Errors
    /// 503 when no router answers, or not within the timeout; 500 for a reply that
    /// does not decode.
    pub(super) async fn single(&self, payload: Vec<u8>) -> Result<RouteReply, ApiError> {
        let answer = self.request(Service::Single, payload).await;
        let answer = answer.map_err(refused)?;
        let reply: RouteReply = decoded(&answer.message)?;
        self.settle(&answer, is_overloaded(&reply));
        Ok(reply)
    }

    /// Asks one encoded `RouteBatchRequest`; `None` when nothing subscribes the batch
    /// subject (a router, or a stand-in, that serves only single queries).
    ///
    /// # Errors
    /// As [`Asker::single`].
    pub(super) async fn batch(
        &self,
        payload: Vec<u8>,
    ) -> Result<Option<RouteBatchReply>, ApiError> {
        match self.request(Service::Batch, payload).await {
            Ok(answer) => {
                let reply: RouteBatchReply = decoded(&answer.message)?;
                let overloaded = match &reply {
                    RouteBatchReply::Answered { replies } => replies.iter().any(is_overloaded),
                    RouteBatchReply::Error(e) => e.code == RouteErrorCode::Overloaded,
                };
                self.settle(&answer, overloaded);
                Ok(Some(reply))
            }
            Err(e) if e.kind() == RequestErrorKind::NoResponders => Ok(None),
            Err(e) => Err(refused(e)),
        }
    }

    /// Sends to the pinned replica if there is one, else (or if it is gone) through
    /// the queue group; the caller then [`Asker::settle`]s the pin.
    async fn request(&self, service: Service, payload: Vec<u8>) -> Result<Answer, RequestError> {
        let payload = bytes::Bytes::from(payload);
        let deadline = Instant::now() + self.timeout;
        if let Some((pin, patience)) = self.pinned() {
            let asked = self.send(pin.services.subject(service), payload.clone(), deadline);
            match self.patiently(&pin, patience, asked).await {
                Ok(message) => {
                    return Ok(Answer {
                        message,
                        pinned: Some(pin.router),
                    });
                }
                Err(e) => {
                    let why = Release::of(&e);
                    self.unpin(pin.router, why);
                    if !matches!(why, Release::Gone) {
                        return Err(e);
                    }
                    debug!(router = %pin.router, "the pinned router replica is gone; asking the queue group");
                }
            }
        }
        let subject = self.shared.subject(service);
        let message = match service {
            Service::Single => self.send_until_answered(subject, payload, deadline).await?,
            // No responder to a batch may be a router that serves only single queries:
            // the caller then asks each query alone.
            Service::Batch => self.send(subject, payload, deadline).await?,
        };
        Ok(Answer {
            message,
            pinned: None,
        })
    }

    /// Sends a single query through the queue group, and again (waits of
    /// [`NO_ROUTER_FIRST_WAIT`], doubling up to [`NO_ROUTER_MAX_WAIT`]) while NATS
    /// says no router subscribes, until `deadline`: routers re-subscribe a moment
    /// after a NATS restart, and a fleet of one replica has none while it restarts.
    /// A query nobody received booked nothing, so asking it again is safe.
    async fn send_until_answered(
        &self,
        subject: Subject,
        payload: bytes::Bytes,
        deadline: Instant,
    ) -> Result<Message, RequestError> {
        let mut waits = backon::ExponentialBuilder::new()
            .with_min_delay(NO_ROUTER_FIRST_WAIT)
            .with_max_delay(NO_ROUTER_MAX_WAIT)
            .with_factor(2.0)
            .without_max_times()
            .build();
        loop {
            match self.send(subject.clone(), payload.clone(), deadline).await {
                Err(e) if e.kind() == RequestErrorKind::NoResponders => {
                    let wait = waits.next().unwrap_or(NO_ROUTER_MAX_WAIT);
                    if Instant::now() + wait >= deadline {
                        return Err(e);
                    }
                    debug!(
                        ?wait,
                        "no router subscribes the route subject; asking again"
                    );
                    tokio::time::sleep(wait).await;
                }
                answered => return answered,
            }
        }
    }

    /// Waits for `asked`, the pinned replica's answer; if it has not come within
    /// `patience`, lets the pin go (the replica may have stalled) and waits on.
    async fn patiently(
        &self,
        pin: &Pin,
        patience: Duration,
        asked: impl Future<Output = Result<Message, RequestError>>,
    ) -> Result<Message, RequestError> {
        let mut asked = std::pin::pin!(asked);
        tokio::select! {
            biased;
            answer = &mut asked => return answer,
            () = tokio::time::sleep(patience) => {}
        }
        debug!(router = %pin.router, ?patience, "the pinned router replica is slow to answer; letting it go");
        self.unpin(pin.router, Release::TimedOut);
        asked.await
    }

    /// One request answered by `deadline`, handed to the client only while it is
    /// connected (module docs, "outages").
    async fn send(
        &self,
        subject: Subject,
        payload: bytes::Bytes,
        deadline: Instant,
    ) -> Result<Message, RequestError> {
        if !*self.connected.borrow() {
            let mut connected = self.connected.clone();
            let up = tokio::time::timeout_at(deadline, connected.wait_for(|up| *up)).await;
            if !matches!(up, Ok(Ok(_))) {
                return Err(RequestError::with_source(
                    RequestErrorKind::TimedOut,
                    "no NATS connection within the route timeout",
                ));
            }
        }
        let request = async_nats::client::Request::new()
            .payload(payload)
            .timeout(Some(deadline.saturating_duration_since(Instant::now())));
        self.nats.send_request(subject, request).await
    }
}

fn is_overloaded(reply: &RouteReply) -> bool {
    matches!(reply, RouteReply::Error(e) if e.code == RouteErrorCode::Overloaded)
}

fn refused(e: RequestError) -> ApiError {
    match e.kind() {
        RequestErrorKind::NoResponders => ApiError::unavailable("no router is answering"),
        RequestErrorKind::TimedOut => ApiError::unavailable("the router did not answer in time"),
        _ => ApiError::unavailable(format!("cannot reach the router: {e}")),
    }
}

fn decoded<T: DeserializeOwned>(reply: &Message) -> Result<T, ApiError> {
    decode::<T>(&reply.payload)
        .map_err(|e| ApiError::internal(format!("malformed route reply: {e}")))
}
