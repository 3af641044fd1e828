//! Which replica the gateway pins to, against a real nats-server and two scripted
//! replicas: by default the lowest replica id it has heard from, so that gateways
//! agree on one replica; one that answers `overloaded` is left out for a window, one
//! that is gone is forgotten. With `--route-affinity-target answered`, the replica
//! that answered.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

use futures::StreamExt as _;
use integration_tests::router_client::{ask, decision, one_by_one, router_client_with};
use kv_events::routing::{RouteError, RouteErrorCode, RouteReply, RouteRequest};
use kv_events::{Namespace, ROUTER_ID_HEADER, RouterId, Subjects, WorkerId, decode, encode};
use kv_gateway::router::{PinTarget, ReplicaAffinity, RouterClient};
use std::time::Duration;
use testbed::NatsServer;

/// Bounds a wait that must end (a failing test must not hang), not a timing claim.
const WAIT: Duration = Duration::from_secs(30);

/// The pin's window: long enough that a pin holds from one query to the next on a
/// loaded host, and waited out between the phases of a test.
const WINDOW: Duration = Duration::from_secs(2);

const LOW: RouterId = RouterId(0xa);
const HIGH: RouterId = RouterId(0xb);

/// Where a query arrived.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum At {
    QueueGroup,
    Replica(RouterId),
}

struct Setup {
    _server: NatsServer,
    nats: async_nats::Client,
    subjects: Subjects,
    asked: futures::stream::SelectAll<async_nats::Subscriber>,
    client: RouterClient,
}

impl Setup {
    async fn start(target: PinTarget) -> Self {
        let server = NatsServer::start().await.unwrap();
        let nats = async_nats::connect(server.url()).await.unwrap();
        let subjects = Subjects::new(Namespace::new("pin-target-test").unwrap());
        let asked = futures::stream::select_all([
            nats.subscribe(subjects.route()).await.unwrap(),
            nats.subscribe(subjects.route_at(LOW)).await.unwrap(),
            nats.subscribe(subjects.route_at(HIGH)).await.unwrap(),
        ]);
        nats.flush().await.unwrap();
        let affinity = ReplicaAffinity {
            window: WINDOW,
            patience: WAIT,
            target,
        };
        let (client, _) = router_client_with(&nats, &subjects, one_by_one(WAIT, Some(affinity)));
        Self {
            _server: server,
            nats,
            subjects,
            asked,
            client,
        }
    }

    /// Asks query `n`, checks where it arrived, answers it as `replica` (`overloaded`
    /// when asked), and returns whether the caller got a decision.
    async fn exchange(&mut self, n: u32, at: At, replica: RouterId, overload: bool) -> bool {
        let asked = ask(&self.client, n);
        let message = tokio::time::timeout(WAIT, self.asked.next())
            .await
            .expect("a query within the wait")
            .expect("the subscriptions are open");
        let arrived = if message.subject.as_str() == self.subjects.route() {
            At::QueueGroup
        } else if message.subject.as_str() == self.subjects.route_at(LOW) {
            At::Replica(LOW)
        } else {
            At::Replica(HIGH)
        };
        let request: RouteRequest = decode(&message.payload).unwrap();
        assert_eq!(request.request_id.0, format!("q-{n}"));
        assert_eq!(arrived, at, "query {n}");
        let reply = if overload {
            RouteReply::Error(RouteError {
                code: RouteErrorCode::Overloaded,
                message: "scripted".into(),
            })
        } else {
            RouteReply::Routed(decision(request.request_id, WorkerId(1)))
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(ROUTER_ID_HEADER, replica.to_string().as_str());
        let inbox = message.reply.expect("a request has an inbox");
        let payload = encode(&reply).unwrap().into();
        (self
            .nats
            .publish_with_headers(inbox, headers, payload)
            .await)
            .unwrap();
        let answered = tokio::time::timeout(WAIT, asked).await.unwrap().unwrap();
        answered.is_ok()
    }
}

/// Lets the pin lapse: the next query goes through the queue group.
async fn window_passes() {
    tokio::time::sleep(WINDOW + Duration::from_millis(100)).await;
}

#[tokio::test]
async fn the_gateway_pins_to_the_lowest_replica_it_has_heard_from() {
    let mut setup = Setup::start(PinTarget::Lowest).await;
    // Only the high replica is known: the pin goes to it.
    assert!(setup.exchange(0, At::QueueGroup, HIGH, false).await);
    assert!(setup.exchange(1, At::Replica(HIGH), HIGH, false).await);
    window_passes().await;
    // The queue group's next pick is the low one: it is lower, the pin moves.
    assert!(setup.exchange(2, At::QueueGroup, LOW, false).await);
    assert!(setup.exchange(3, At::Replica(LOW), LOW, false).await);
    window_passes().await;
    // The queue group picks the high one again; the gateway still pins to the low
    // one, as every gateway that has heard from both does.
    assert!(setup.exchange(4, At::QueueGroup, HIGH, false).await);
    assert!(setup.exchange(5, At::Replica(LOW), LOW, false).await);
    // The low one is overloaded: it is left out for a window.
    assert!(!setup.exchange(6, At::Replica(LOW), LOW, true).await);
    assert!(setup.exchange(7, At::QueueGroup, HIGH, false).await);
    assert!(setup.exchange(8, At::Replica(HIGH), HIGH, false).await);
    window_passes().await;
    // A window later the low one is preferred again.
    assert!(setup.exchange(9, At::QueueGroup, HIGH, false).await);
    assert!(setup.exchange(10, At::Replica(LOW), LOW, false).await);
}

#[tokio::test]
async fn a_replica_that_is_gone_is_forgotten() {
    let mut setup = Setup::start(PinTarget::Lowest).await;
    assert!(setup.exchange(0, At::QueueGroup, LOW, false).await);
    window_passes().await;
    assert!(setup.exchange(1, At::QueueGroup, HIGH, false).await);
    assert!(setup.exchange(2, At::Replica(LOW), LOW, false).await);
    // The low replica leaves: NATS says nothing subscribes its subject, and the
    // query goes through the queue group instead.
    setup.asked = futures::stream::select_all([
        setup.nats.subscribe(setup.subjects.route()).await.unwrap(),
        setup
            .nats
            .subscribe(setup.subjects.route_at(HIGH))
            .await
            .unwrap(),
    ]);
    setup.nats.flush().await.unwrap();
    assert!(setup.exchange(3, At::QueueGroup, HIGH, false).await);
    // Forgotten, so the pin goes to the high one and stays there.
    assert!(setup.exchange(4, At::Replica(HIGH), HIGH, false).await);
}

#[tokio::test]
async fn with_the_answered_target_the_pin_follows_the_queue_group() {
    let mut setup = Setup::start(PinTarget::Answered).await;
    assert!(setup.exchange(0, At::QueueGroup, LOW, false).await);
    assert!(setup.exchange(1, At::Replica(LOW), LOW, false).await);
    window_passes().await;
    assert!(setup.exchange(2, At::QueueGroup, HIGH, false).await);
    assert!(setup.exchange(3, At::Replica(HIGH), HIGH, false).await);
}
