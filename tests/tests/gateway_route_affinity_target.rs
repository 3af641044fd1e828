//! Which replica the gateway pins to, against a real nats-server and two scripted
//! replicas: by default the lowest replica id it has heard from (through its queries,
//! its roll calls, or, when no replica answers those, its readiness probes through
//! the queue group), pinned anew when a window passes without a query through the
//! queue group, so that gateways agree on one replica; one that answers `overloaded`
//! is left out for a window, one that is gone is forgotten. With
//! `--route-affinity-target answered`, the replica that answered. The scripted
//! replicas answer no roll call unless a test says so, as routers from before it.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

use futures::StreamExt as _;
use integration_tests::router_client::{ask, decision, one_by_one, router_client_with};
use kv_events::replicas::RollCallReply;
use kv_events::routing::{RouteError, RouteErrorCode, RouteReply, RouteRequest};
use kv_events::{Namespace, ROUTER_ID_HEADER, RouterId, Subjects, WorkerId, decode, encode};
use kv_gateway::router::{PinTarget, ReplicaAffinity, RouterClient};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use testbed::NatsServer;
use tokio::sync::mpsc;

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
    /// Queries (readiness probes left out) and where they arrived.
    queries: mpsc::UnboundedReceiver<(async_nats::Message, At)>,
    /// The replica that answers the gateway's readiness probes (`None`: nobody).
    probes_answered_by: Arc<Mutex<Option<RouterId>>>,
    /// The replicas that answer the gateway's roll calls.
    roll_call_answered_by: Arc<Mutex<Vec<RouterId>>>,
    /// One message per roll call received, once answered.
    roll_calls: mpsc::UnboundedReceiver<()>,
    /// Whether the low replica still subscribes its own subject.
    low_subscribed: Option<tokio::task::JoinHandle<()>>,
    client: RouterClient,
}

/// Forwards each query on `subscriber` to `queries` as arriving `at`, and answers
/// each readiness probe naming the replica `probes` names at the time.
fn serve(
    nats: async_nats::Client,
    mut subscriber: async_nats::Subscriber,
    at: At,
    queries: mpsc::UnboundedSender<(async_nats::Message, At)>,
    probes: Arc<Mutex<Option<RouterId>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(message) = subscriber.next().await {
            let request: RouteRequest = decode(&message.payload).unwrap();
            if request.request_id.0 != "gateway-readiness-probe" {
                let _ = queries.send((message, at));
                continue;
            }
            let named = *probes.lock().unwrap();
            if let (Some(replica), Some(inbox)) = (named, message.reply) {
                let refused = RouteReply::Error(RouteError {
                    code: RouteErrorCode::BadRequest,
                    message: "empty prompt".into(),
                });
                answer(&nats, inbox, &refused, replica).await;
            }
        }
    })
}

/// Answers `inbox` with `reply`, naming `replica`.
async fn answer(
    nats: &async_nats::Client,
    inbox: async_nats::Subject,
    reply: &RouteReply,
    replica: RouterId,
) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(ROUTER_ID_HEADER, replica.to_string().as_str());
    let payload = encode(reply).unwrap().into();
    (nats.publish_with_headers(inbox, headers, payload).await).unwrap();
}

/// Answers each roll call on `subscriber` once per replica `by` names at the time
/// (after two replies that name none, when it names any), then tells `calls`.
fn answer_roll_calls(
    nats: async_nats::Client,
    mut subscriber: async_nats::Subscriber,
    by: Arc<Mutex<Vec<RouterId>>>,
    calls: mpsc::UnboundedSender<()>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(message) = subscriber.next().await {
            let replicas = by.lock().unwrap().clone();
            let inbox = message.reply.unwrap();
            if !replicas.is_empty() {
                // Replies that name no replica come first: skipped, not fatal.
                let mut bad = async_nats::HeaderMap::new();
                bad.insert(ROUTER_ID_HEADER, "not a router id");
                let garbage = bytes::Bytes::from_static(b"\xc1 not msgpack");
                (nats
                    .publish_with_headers(inbox.clone(), bad, garbage.clone())
                    .await)
                    .unwrap();
                (nats.publish(inbox.clone(), garbage).await).unwrap();
            }
            for replica in replicas {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert(ROUTER_ID_HEADER, replica.to_string().as_str());
                let reply = RollCallReply { router_id: replica };
                let payload = encode(&reply).unwrap().into();
                (nats
                    .publish_with_headers(inbox.clone(), headers, payload)
                    .await)
                    .unwrap();
            }
            let _ = calls.send(());
        }
    })
}

impl Setup {
    async fn start(target: PinTarget) -> Self {
        Self::start_with(target, WINDOW).await
    }

    async fn start_with(target: PinTarget, window: Duration) -> Self {
        let server = NatsServer::start().await.unwrap();
        let nats = async_nats::connect(server.url()).await.unwrap();
        let subjects = Subjects::new(Namespace::new("pin-target-test").unwrap());
        let (tx, queries) = mpsc::unbounded_channel();
        let probes = Arc::new(Mutex::new(None));
        let mut served = Vec::new();
        for (subject, at) in [
            (subjects.route(), At::QueueGroup),
            (subjects.route_at(LOW), At::Replica(LOW)),
            (subjects.route_at(HIGH), At::Replica(HIGH)),
        ] {
            let subscriber = nats.subscribe(subject).await.unwrap();
            served.push(serve(
                nats.clone(),
                subscriber,
                at,
                tx.clone(),
                probes.clone(),
            ));
        }
        let roll_call_answered_by = Arc::new(Mutex::new(Vec::new()));
        let (calls, roll_calls) = mpsc::unbounded_channel();
        let roll_call = nats.subscribe(subjects.router_roll_call()).await.unwrap();
        served.push(answer_roll_calls(
            nats.clone(),
            roll_call,
            roll_call_answered_by.clone(),
            calls,
        ));
        nats.flush().await.unwrap();
        let affinity = ReplicaAffinity {
            window,
            patience: WAIT,
            target,
        };
        let (client, _) = router_client_with(&nats, &subjects, one_by_one(WAIT, Some(affinity)));
        Self {
            _server: server,
            nats,
            subjects,
            queries,
            probes_answered_by: probes,
            roll_call_answered_by,
            roll_calls,
            low_subscribed: Some(served.swap_remove(1)),
            client,
        }
    }

    /// Asks query `n`, checks where it arrived, answers it as `replica` (`overloaded`
    /// when asked), and returns whether the caller got a decision.
    async fn exchange(&mut self, n: u32, at: At, replica: RouterId, overload: bool) -> bool {
        let (arrived, decided) = self.exchange_as(n, |_| replica, overload).await;
        assert_eq!(arrived, at, "query {n}");
        decided
    }

    /// Asks query `n` and answers it as the replica it arrived at (the high one
    /// through the queue group); returns where it arrived.
    async fn exchange_anywhere(&mut self, n: u32) -> At {
        let replica = |at| match at {
            At::Replica(replica) => replica,
            At::QueueGroup => HIGH,
        };
        let (arrived, decided) = self.exchange_as(n, replica, false).await;
        assert!(decided, "query {n}");
        arrived
    }

    /// Asks query `n`, answers it as the replica `replica` names for where it arrived
    /// (`overloaded` when asked); returns where it arrived and whether the caller got
    /// a decision.
    async fn exchange_as(
        &mut self,
        n: u32,
        replica: impl Fn(At) -> RouterId,
        overload: bool,
    ) -> (At, bool) {
        let asked = ask(&self.client, n);
        let (message, arrived) = tokio::time::timeout(WAIT, self.queries.recv())
            .await
            .expect("a query within the wait")
            .expect("the subscriptions are served");
        let request: RouteRequest = decode(&message.payload).unwrap();
        assert_eq!(request.request_id.0, format!("q-{n}"));
        let reply = if overload {
            RouteReply::Error(RouteError {
                code: RouteErrorCode::Overloaded,
                message: "scripted".into(),
            })
        } else {
            RouteReply::Routed(decision(request.request_id, WorkerId(1)))
        };
        let inbox = message.reply.expect("a request has an inbox");
        answer(&self.nats, inbox, &reply, replica(arrived)).await;
        let answered = tokio::time::timeout(WAIT, asked).await.unwrap().unwrap();
        (arrived, answered.is_ok())
    }

    /// Readiness probes are answered by `replica` from now on.
    fn probes_answered_by(&self, replica: Option<RouterId>) {
        *self.probes_answered_by.lock().unwrap() = replica;
    }

    /// The low replica leaves: nothing subscribes its own subject any more.
    async fn low_leaves(&mut self) {
        if let Some(served) = self.low_subscribed.take() {
            served.abort();
            let _ = served.await;
        }
        self.nats.flush().await.unwrap();
        assert_ne!(self.subjects.route_at(LOW), self.subjects.route_at(HIGH));
    }
}

/// Lets the pin lapse.
async fn window_passes() {
    tokio::time::sleep(WINDOW + Duration::from_millis(100)).await;
}

#[tokio::test]
async fn the_gateway_pins_to_the_lowest_replica_it_has_heard_from() {
    let mut setup = Setup::start(PinTarget::Lowest).await;
    // Nobody answers the start-up probes: the first query goes through the queue
    // group, and only the high replica is known.
    assert!(setup.exchange(0, At::QueueGroup, HIGH, false).await);
    assert!(setup.exchange(1, At::Replica(HIGH), HIGH, false).await);
    window_passes().await;
    // The pin is renewed to the lowest known, the high one, with no query through
    // the queue group; the probes sent then are answered by the low one.
    setup.probes_answered_by(Some(LOW));
    assert!(setup.exchange(2, At::Replica(HIGH), HIGH, false).await);
    window_passes().await;
    // Now the low one is known: every gateway that has heard from both pins to it.
    assert!(setup.exchange(3, At::Replica(LOW), LOW, false).await);
    assert!(setup.exchange(4, At::Replica(LOW), LOW, false).await);
    // It is overloaded: it is left out for a window, the high one takes over.
    assert!(!setup.exchange(5, At::Replica(LOW), LOW, true).await);
    assert!(setup.exchange(6, At::Replica(HIGH), HIGH, false).await);
    window_passes().await;
    // A window later the low one is preferred again.
    assert!(setup.exchange(7, At::Replica(LOW), LOW, false).await);
}

#[tokio::test]
async fn a_replica_that_is_gone_is_forgotten() {
    let mut setup = Setup::start(PinTarget::Lowest).await;
    assert!(setup.exchange(0, At::QueueGroup, LOW, false).await);
    window_passes().await;
    setup.probes_answered_by(Some(HIGH));
    assert!(setup.exchange(1, At::Replica(LOW), LOW, false).await);
    setup.probes_answered_by(None);
    // The low replica leaves: NATS says nothing subscribes its subject, and the
    // query goes through the queue group instead.
    setup.low_leaves().await;
    window_passes().await;
    assert!(setup.exchange(2, At::QueueGroup, HIGH, false).await);
    // Forgotten, so the pin goes to the high one, and is renewed there.
    assert!(setup.exchange(3, At::Replica(HIGH), HIGH, false).await);
    window_passes().await;
    assert!(setup.exchange(4, At::Replica(HIGH), HIGH, false).await);
}

/// A roll call hears every replica at once: the first answer comes through the queue
/// group from the high replica, the gateway then calls the roll (once its start-up
/// call, which nobody answered, is done), both answer, and its next queries go to
/// the low one long before the pin's window passes. The low replica serves only its
/// own subject, so nothing but the roll call can name it.
#[tokio::test]
async fn a_roll_call_moves_the_pin_to_the_lowest_replica_within_its_window() {
    let mut setup = Setup::start_with(PinTarget::Lowest, Duration::from_secs(600)).await;
    // The start-up roll call, unanswered: no replica is up yet.
    tokio::time::timeout(WAIT, setup.roll_calls.recv())
        .await
        .unwrap();
    *setup.roll_call_answered_by.lock().unwrap() = vec![HIGH, LOW];
    assert!(setup.exchange(0, At::QueueGroup, HIGH, false).await);
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut n = 1;
    while setup.exchange_anywhere(n).await != At::Replica(LOW) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} queries, none on the low replica"
        );
        n += 1;
    }
    // From now on the low one.
    assert!(setup.exchange(n + 1, At::Replica(LOW), LOW, false).await);
}

#[tokio::test]
async fn with_the_answered_target_the_pin_follows_the_queue_group() {
    let mut setup = Setup::start(PinTarget::Answered).await;
    setup.probes_answered_by(Some(LOW));
    assert!(setup.exchange(0, At::QueueGroup, LOW, false).await);
    assert!(setup.exchange(1, At::Replica(LOW), LOW, false).await);
    window_passes().await;
    assert!(setup.exchange(2, At::QueueGroup, HIGH, false).await);
    assert!(setup.exchange(3, At::Replica(HIGH), HIGH, false).await);
}
