//! The gateway's replica affinity against a real nats-server and a scripted replica:
//! a reply's `Kv-Router-Id` pins the gateway to that replica's own subject, and the
//! pin is let go when the replica answers `overloaded` or does not answer in time;
//! a replica that leaves a query unanswered past the patience gets no more queries
//! while that one still waits; a header that does not parse, or `overloaded`
//! through the queue group, pins nothing. With real replicas (a pin held,
//! a replica gone, a pin expiring), see `replicas/affinity.rs`.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

use futures::StreamExt as _;
use integration_tests::router_client::{ask, decision, one_by_one, router_client_with};
use kv_events::routing::{RouteError, RouteErrorCode, RouteReply, RouteRequest};
use kv_events::{Namespace, ROUTER_ID_HEADER, RouterId, Subjects, WorkerId, decode, encode};
use kv_gateway::error::ApiError;
use kv_gateway::router::{PinTarget, ReplicaAffinity, RouterClient, RouterMetrics};
use std::time::Duration;
use testbed::NatsServer;
use tokio::task::JoinHandle;

/// Bounds a wait that must end (a failing test must not hang), not a timing claim.
const WAIT: Duration = Duration::from_secs(30);

/// How long the gateway waits for a route answer: the timeout case waits it out.
const ROUTE_TIMEOUT: Duration = Duration::from_millis(500);

const REPLICA: RouterId = RouterId(0xa);

/// Where a query arrived: the queue group's subject or the replica's own.
#[derive(Debug, PartialEq, Eq)]
enum Via {
    QueueGroup,
    Pinned,
}

struct Setup {
    _server: NatsServer,
    nats: async_nats::Client,
    asked: futures::stream::SelectAll<async_nats::Subscriber>,
    pinned_subject: String,
    client: RouterClient,
    metrics: RouterMetrics,
}

impl Setup {
    /// A scripted replica and a gateway pinned to it for an hour once it answers,
    /// letting it go after `patience` without an answer.
    async fn start(patience: Duration) -> Self {
        // A patience below the route timeout is what the slow-replica test needs;
        // otherwise the timeout is the one the timeout case waits out.
        let route_timeout = if patience < ROUTE_TIMEOUT {
            WAIT
        } else {
            ROUTE_TIMEOUT
        };
        let server = NatsServer::start().await.unwrap();
        let nats = async_nats::connect(server.url()).await.unwrap();
        let subjects = Subjects::new(Namespace::new("affinity-test").unwrap());
        let asked = futures::stream::select_all([
            nats.subscribe(subjects.route()).await.unwrap(),
            nats.subscribe(subjects.route_at(REPLICA)).await.unwrap(),
        ]);
        let affinity = ReplicaAffinity {
            window: Duration::from_secs(3600),
            patience,
            target: PinTarget::Lowest,
        };
        let settings = one_by_one(route_timeout, Some(affinity));
        let (client, metrics) = router_client_with(&nats, &subjects, settings);
        Self {
            _server: server,
            nats,
            asked,
            pinned_subject: subjects.route_at(REPLICA),
            client,
            metrics,
        }
    }

    fn ask(&self, n: u32) -> JoinHandle<Result<RouteReply, ApiError>> {
        ask(&self.client, n)
    }

    /// The next query the replica gets, where it arrived, and its inbox.
    /// Skips the gateway's pings (a slow query makes it ping the replicas it knows),
    /// which this replica leaves unanswered.
    async fn next(&mut self) -> (RouteRequest, Via, async_nats::Subject) {
        loop {
            let message = tokio::time::timeout(WAIT, self.asked.next())
                .await
                .expect("a query within the wait")
                .expect("the subscriptions are open");
            let via = if message.subject.as_str() == self.pinned_subject {
                Via::Pinned
            } else {
                Via::QueueGroup
            };
            let request: RouteRequest = decode(&message.payload).unwrap();
            if request.request_id.0 != "gateway-readiness-probe" {
                return (request, via, message.reply.expect("a request has an inbox"));
            }
        }
    }

    /// Answers `inbox` with `reply`, naming the replica as `router_id` says.
    async fn answer(&self, inbox: async_nats::Subject, reply: &RouteReply, router_id: &str) {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(ROUTER_ID_HEADER, router_id);
        let payload = encode(reply).unwrap().into();
        (self
            .nats
            .publish_with_headers(inbox, headers, payload)
            .await)
            .unwrap();
    }

    /// Asks query `n`; checks it arrived `via`, answers it with `reply` (or not at
    /// all: `None`) naming the replica as `router_id`; returns what the caller got.
    async fn exchange(
        &mut self,
        n: u32,
        via: Via,
        reply: Option<RouteReply>,
        router_id: &str,
    ) -> Result<RouteReply, ApiError> {
        let asked = self.ask(n);
        let (request, arrived, inbox) = self.next().await;
        assert_eq!(request.request_id.0, format!("q-{n}"));
        assert_eq!(arrived, via, "query {n}");
        if let Some(reply) = reply {
            self.answer(inbox, &reply, router_id).await;
        }
        tokio::time::timeout(WAIT, asked).await.unwrap().unwrap()
    }
}

/// The events of `kv_gateway_route_affinity_total`, in the order
/// [`Setup::affinity_events`] counts them.
const EVENTS: [&str; 5] = ["pinned", "overloaded", "timed_out", "gone", "failed"];

impl Setup {
    /// How many times each of [`EVENTS`] was counted.
    fn affinity_events(&self) -> [u64; 5] {
        EVENTS.map(|event| self.metrics.affinity.with_label_values(&[event]).get())
    }
}

fn overloaded() -> Option<RouteReply> {
    Some(RouteReply::Error(RouteError {
        code: RouteErrorCode::Overloaded,
        message: "scripted".into(),
    }))
}

fn routed(n: u32) -> Option<RouteReply> {
    Some(RouteReply::Routed(decision(
        format!("q-{n}").as_str().into(),
        WorkerId(1),
    )))
}

#[tokio::test]
async fn a_pin_is_let_go_on_overload_timeout_or_an_unreadable_name() {
    // Never slow: a scripted answer late on a loaded host must not let the pin go.
    let mut setup = Setup::start(WAIT).await;
    let us = REPLICA.to_string();
    // Pinned by the first answer; the second goes to the replica's own subject.
    setup
        .exchange(0, Via::QueueGroup, routed(0), &us)
        .await
        .unwrap();
    setup
        .exchange(1, Via::Pinned, routed(1), &us)
        .await
        .unwrap();

    // `overloaded`: the caller is told, and the next query goes to the queue group.
    let err = (setup.exchange(2, Via::Pinned, overloaded(), &us).await).unwrap_err();
    assert_eq!(err.status.as_u16(), 429, "{err:?}");
    setup
        .exchange(3, Via::QueueGroup, routed(3), &us)
        .await
        .unwrap();

    // No answer in time: the caller gets 503, the next query the queue group.
    setup
        .exchange(4, Via::Pinned, routed(4), &us)
        .await
        .unwrap();
    let err = (setup.exchange(5, Via::Pinned, None, &us).await).unwrap_err();
    assert_eq!(err.status.as_u16(), 503, "{err:?}");

    // A name that does not parse pins nothing.
    setup
        .exchange(6, Via::QueueGroup, routed(6), "not-a-router")
        .await
        .unwrap();
    setup
        .exchange(7, Via::QueueGroup, routed(7), &us)
        .await
        .unwrap();
    setup
        .exchange(8, Via::Pinned, routed(8), &us)
        .await
        .unwrap();

    // `overloaded` through the queue group pins nothing: the next query goes there
    // too.
    let err = (setup.exchange(9, Via::Pinned, overloaded(), &us).await).unwrap_err();
    assert_eq!(err.status.as_u16(), 429, "{err:?}");
    let err = (setup.exchange(10, Via::QueueGroup, overloaded(), &us).await).unwrap_err();
    assert_eq!(err.status.as_u16(), 429, "{err:?}");
    setup
        .exchange(11, Via::QueueGroup, routed(11), &us)
        .await
        .unwrap();
    setup
        .exchange(12, Via::Pinned, routed(12), &us)
        .await
        .unwrap();

    // Pinned by queries 0, 3, 7 and 11; let go twice overloaded and once timed out.
    assert_eq!(setup.affinity_events(), [4, 2, 1, 0, 0], "{EVENTS:?}");
}

/// A pinned replica that leaves a query unanswered past the patience (stalled) is
/// let go: the next query goes through the queue group and is answered there while
/// the first still waits, and gets its answer when the replica answers after all.
#[tokio::test]
async fn a_replica_slow_past_the_patience_gets_no_more_queries() {
    let patience = Duration::from_millis(50);
    let mut setup = Setup::start(patience).await;
    let us = REPLICA.to_string();
    setup
        .exchange(0, Via::QueueGroup, routed(0), &us)
        .await
        .unwrap();
    // Query 1 reaches the pinned replica, which does not answer yet.
    let stalled = setup.ask(1);
    let (request, via, inbox) = setup.next().await;
    assert_eq!((request.request_id.0.as_str(), via), ("q-1", Via::Pinned));
    let events = setup.metrics.affinity.clone();
    integration_tests::eventually("the slow replica let go", WAIT, || {
        let released = events.with_label_values(&["timed_out"]).get();
        async move { (released == 1).then_some(()) }
    })
    .await
    .unwrap();
    // Query 2 goes through the queue group while query 1 still waits, and pins
    // again to whoever answers it.
    assert!(
        !stalled.is_finished(),
        "query 1 gave up within the patience"
    );
    setup
        .exchange(2, Via::QueueGroup, routed(2), &us)
        .await
        .unwrap();
    setup.answer(inbox, &routed(1).unwrap(), &us).await;
    let late = tokio::time::timeout(WAIT, stalled).await.unwrap().unwrap();
    assert!(
        matches!(late, Ok(RouteReply::Routed(ref d)) if d.request_id.0 == "q-1"),
        "{late:?}"
    );
    setup
        .exchange(3, Via::Pinned, routed(3), &us)
        .await
        .unwrap();
    assert_eq!(setup.affinity_events(), [2, 0, 1, 0, 0], "{EVENTS:?}");
}
