//! A route query held by a router replica that stalls, against a real nats-server and
//! two scripted replicas in one queue group: once the query has waited out the
//! patience, the gateway pings the replicas it has heard from; the stalled one does
//! not answer, the live one does and is asked again under a fresh request id, whose
//! answer the caller gets, and the first id is freed. A replica that answers its ping
//! while it holds a query (the query waits in its queue) is left to answer it.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

use futures::StreamExt as _;
use integration_tests::router_client::{ask, decision, one_by_one, router_client_with};
use kv_events::routing::{
    LifecycleBatch, LifecycleEvent, RouteError, RouteErrorCode, RouteReply, RouteRequest,
};
use kv_events::{Namespace, ROUTER_ID_HEADER, RouterId, Subjects, WorkerId, decode, encode};
use kv_gateway::router::{PinTarget, ReplicaAffinity, RouterClient, RouterMetrics};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use testbed::NatsServer;
use tokio::sync::mpsc;

/// Bounds a wait that must end (a failing test must not hang), not a timing claim.
const WAIT: Duration = Duration::from_secs(30);

/// The request id of the gateway's ping (its readiness probe).
const PING: &str = "gateway-readiness-probe";

const QUEUE_GROUP: &str = "routers";

/// A scripted replica: answers every query naming itself, the ping with the
/// `bad_request` a router gives an empty prompt, and nothing at all while stalled;
/// reports every query (not the pings) it receives.
struct Replica {
    stalled: Arc<AtomicBool>,
    /// (request id, the replica's own subject or not) of each query received.
    received: mpsc::UnboundedReceiver<(String, bool)>,
}

impl Replica {
    async fn start(nats: &async_nats::Client, subjects: &Subjects, id: RouterId) -> Self {
        let shared = nats
            .queue_subscribe(subjects.route(), QUEUE_GROUP.into())
            .await
            .unwrap();
        let own_subject = subjects.route_at(id);
        let own = nats.subscribe(own_subject.clone()).await.unwrap();
        nats.flush().await.unwrap();
        let stalled = Arc::new(AtomicBool::new(false));
        let (report, received) = mpsc::unbounded_channel();
        let (nats, stall) = (nats.clone(), stalled.clone());
        tokio::spawn(async move {
            let mut asked = futures::stream::select_all([shared, own]);
            while let Some(message) = asked.next().await {
                if stall.load(Ordering::SeqCst) {
                    continue;
                }
                let request = id_of(&message);
                if request != PING {
                    let _ = report.send((request, message.subject.as_str() == own_subject));
                }
                answer(&nats, id, message).await;
            }
        });
        Self { stalled, received }
    }

    /// The id of the next query received.
    async fn next(&mut self) -> (String, bool) {
        tokio::time::timeout(WAIT, self.received.recv())
            .await
            .unwrap()
            .unwrap()
    }
}

/// The request id of a route query.
fn id_of(message: &async_nats::Message) -> String {
    decode::<RouteRequest>(&message.payload)
        .unwrap()
        .request_id
        .0
}

/// The next message of `queries`, within the wait.
async fn next(queries: &mut async_nats::Subscriber) -> async_nats::Message {
    tokio::time::timeout(WAIT, queries.next())
        .await
        .unwrap()
        .unwrap()
}

/// Answers `query` as replica `id` would: the ping with the `bad_request` a router
/// gives an empty prompt, any other query routed to worker `id`.
async fn answer(nats: &async_nats::Client, id: RouterId, query: async_nats::Message) {
    let request: RouteRequest = decode(&query.payload).unwrap();
    let reply = if request.request_id.0 == PING {
        RouteReply::Error(RouteError {
            code: RouteErrorCode::BadRequest,
            message: "empty prompt".into(),
        })
    } else {
        RouteReply::Routed(decision(request.request_id, WorkerId(id.0)))
    };
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(ROUTER_ID_HEADER, id.to_string().as_str());
    let payload = encode(&reply).unwrap().into();
    nats.publish_with_headers(query.reply.unwrap(), headers, payload)
        .await
        .unwrap();
}

struct Setup {
    _server: NatsServer,
    nats: async_nats::Client,
    subjects: Subjects,
    client: RouterClient,
    metrics: RouterMetrics,
    /// The lifecycle messages published, from the start.
    lifecycle: async_nats::Subscriber,
}

impl Setup {
    /// A gateway with replica affinity for `window`, patience 50 ms, and a route
    /// timeout the test never waits out when it passes.
    async fn start(window: Duration) -> Self {
        Self::start_with(window, Duration::from_millis(50), WAIT).await
    }

    /// A gateway with replica affinity for `window`, `patience`, and route `timeout`.
    async fn start_with(window: Duration, patience: Duration, timeout: Duration) -> Self {
        let server = NatsServer::start().await.unwrap();
        let nats = async_nats::connect(server.url()).await.unwrap();
        let subjects = Subjects::new(Namespace::new("stall-test").unwrap());
        // Pinned to the replica that answered, so that with a short window the queue
        // group picks each query and a query lands on the replica that stalls (with
        // the `lowest` target they would all go to the live one, the lower id).
        let affinity = ReplicaAffinity {
            window,
            patience,
            target: PinTarget::Answered,
        };
        let lifecycle = nats.subscribe(subjects.lifecycle()).await.unwrap();
        nats.flush().await.unwrap();
        let (client, metrics) =
            router_client_with(&nats, &subjects, one_by_one(timeout, Some(affinity)));
        Self {
            _server: server,
            nats,
            subjects,
            client,
            metrics,
            lifecycle,
        }
    }

    fn stall_events(&self) -> [u64; 3] {
        ["silent", "asked_again", "again_answered"]
            .map(|event| self.metrics.stalls.with_label_values(&[event]).get())
    }
}

/// Routed with the id it booked, or the test fails.
fn booked_id(reply: Result<RouteReply, kv_gateway::error::ApiError>) -> String {
    match reply {
        Ok(RouteReply::Routed(d)) => d.request_id.0,
        other => panic!("not routed: {other:?}"),
    }
}

#[tokio::test]
async fn a_query_held_by_a_stalled_replica_is_asked_again_of_a_live_one() {
    // A window this short sends every query through the queue group.
    let mut setup = Setup::start(Duration::from_millis(1)).await;
    let (asked, booked) = rescue(&setup).await;
    assert!(booked.starts_with("gw-"), "a fresh gateway id: {booked}");
    assert_eq!(
        setup.stall_events(),
        [1, 1, 1],
        "silent, asked_again, again_answered"
    );
    assert_freed(&mut setup, &asked).await;
}

#[tokio::test]
async fn a_stalled_replica_is_judged_once_its_live_peer_answers_the_ping() {
    // The query waits out a 2 s patience, and the route timeout is 3.5 s: a ping
    // round that waited out the patience too would ask again at 4 s, too late, and
    // the query would fail. Judged a tenth of the patience after the live replica's
    // answer, it is asked again at about 2.2 s and answered.
    let patience = Duration::from_secs(2);
    let timeout = Duration::from_millis(3500);
    let setup = Setup::start_with(Duration::from_millis(1), patience, timeout).await;
    let (asked, booked) = rescue(&setup).await;
    assert_ne!(asked, booked, "asked again under a fresh id");
    assert_eq!(setup.stall_events(), [1, 1, 1]);
}

/// Starts a stalling and a live replica, lets the gateway hear from both, stalls one
/// and asks until a query lands on it; returns (the id asked, the id booked by the
/// live replica on its own subject).
async fn rescue(setup: &Setup) -> (String, String) {
    let (stalling_id, live_id) = (RouterId(0x5), RouterId(0x1));
    let mut stalling = Replica::start(&setup.nats, &setup.subjects, stalling_id).await;
    let mut live = Replica::start(&setup.nats, &setup.subjects, live_id).await;

    // Until both replicas have answered a query, so the gateway knows them.
    let (mut heard_stalling, mut heard_live) = (false, false);
    for n in 0..200 {
        booked_id(
            tokio::time::timeout(WAIT, ask(&setup.client, n))
                .await
                .unwrap()
                .unwrap(),
        );
        heard_stalling |= stalling.received.try_recv().is_ok();
        heard_live |= live.received.try_recv().is_ok();
        if heard_stalling && heard_live {
            break;
        }
    }
    assert!(
        heard_stalling && heard_live,
        "the queue group never picked one of them"
    );
    while live.received.try_recv().is_ok() {}

    // The replica stalls; queries go on until one lands on it (the queue group
    // picks at random), and that one is answered by the live replica under a fresh
    // id, asked on the live replica's own subject.
    stalling.stalled.store(true, Ordering::SeqCst);
    let mut rescued = None;
    for n in 1000..1200 {
        let asked = format!("q-{n}");
        let booked = booked_id(
            tokio::time::timeout(WAIT, ask(&setup.client, n))
                .await
                .unwrap()
                .unwrap(),
        );
        let (received, own) = live.next().await;
        if booked != asked {
            assert_eq!((received.as_str(), own), (booked.as_str(), true));
            rescued = Some((asked, booked));
            break;
        }
        // Answered by the live replica (through the queue group or pinned to it).
        assert_eq!(received, asked);
    }
    rescued.expect("no query landed on the stalled replica")
}

/// The id the stalled replica holds is freed, so it books nothing when it resumes.
async fn assert_freed(setup: &mut Setup, asked: &str) {
    let freed_first = tokio::time::timeout(WAIT, async {
        while let Some(message) = setup.lifecycle.next().await {
            let batch: LifecycleBatch = decode(&message.payload).unwrap();
            if batch
                .messages
                .iter()
                .any(|m| m.request_id.0 == asked && m.event == LifecycleEvent::Freed)
            {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(freed_first, Ok(true), "no freed for {asked}");
}

#[tokio::test]
async fn a_replica_that_answers_its_ping_keeps_the_query_it_holds() {
    // One replica, pinned once it answers; it holds query 1 (as if it waited in its
    // queue) until the gateway has pinged it, then answers both.
    let setup = Setup::start(Duration::from_secs(3600)).await;
    let (id, nats) = (RouterId(0x7), &setup.nats);
    let mut asked = nats.subscribe(setup.subjects.route_at(id)).await.unwrap();
    let mut shared = nats.subscribe(setup.subjects.route()).await.unwrap();
    nats.flush().await.unwrap();
    let first = ask(&setup.client, 0);
    answer(nats, id, next(&mut shared).await).await;
    let first = tokio::time::timeout(WAIT, first).await.unwrap().unwrap();
    assert_eq!(booked_id(first), "q-0");

    let held = ask(&setup.client, 1);
    let query = next(&mut asked).await;
    let ping = next(&mut asked).await;
    assert_eq!((id_of(&query), id_of(&ping)), ("q-1".into(), PING.into()));
    answer(nats, id, ping).await;
    // Nothing is asked again once the ping is answered: the query waits for this
    // replica (as it would in its queue).
    let stray = tokio::time::timeout(Duration::from_millis(300), asked.next()).await;
    assert!(stray.is_err(), "a query asked again: {stray:?}");
    answer(nats, id, query).await;
    let held = tokio::time::timeout(WAIT, held).await.unwrap().unwrap();
    assert_eq!(booked_id(held), "q-1");
    assert_eq!(
        setup.stall_events(),
        [0, 0, 0],
        "silent, asked_again, again_answered"
    );
}
