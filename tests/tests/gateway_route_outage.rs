//! The gateway's route queries across a NATS outage, against a real nats-server and a
//! scripted router: the gateway reaches NATS through a TCP proxy the test cuts and
//! restores, as a network partition would. A query asked while the connection is
//! down waits for it within the route timeout, and fails if it is not back by then;
//! it is never sent later, after its caller has given up (a router would book it
//! with nobody left to free it). A query asked during an outage shorter than the
//! timeout is answered once the connection is back, and a query that finds no router
//! subscribed (as just after a NATS restart) once one subscribes again. A query a
//! router received but did not answer in time is followed by its `freed`.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

use futures::StreamExt as _;
use integration_tests::etcd_proxy::EtcdProxy;
use integration_tests::router_client::{ask, decision, one_by_one, router_client_on};
use kv_events::routing::{LifecycleEvent, LifecycleMessage, RouteReply, RouteRequest};
use kv_events::{Namespace, Subjects, WorkerId, decode, encode};
use kv_gateway::error::ApiError;
use kv_gateway::router::RouterClient;
use std::time::Duration;
use testbed::NatsServer;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Bounds a wait that must end (a failing test must not hang), not a timing claim.
const WAIT: Duration = Duration::from_secs(30);

/// The request id of the lifecycle publisher's probe for a router after a reconnect.
const READINESS_PROBE: &str = "gateway-readiness-probe";

/// The gateway's route timeout: what a query asked during a long cut waits out, and
/// what a short cut must end within (the client reconnects every 50 ms here).
const ROUTE_TIMEOUT: Duration = Duration::from_secs(3);

struct Setup {
    _server: NatsServer,
    proxy: EtcdProxy,
    /// The scripted router's connection (straight to NATS, never cut).
    router: async_nats::Client,
    queries: async_nats::Subscriber,
    subjects: Subjects,
    client: RouterClient,
    /// The gateway connection's events, as the test sees them.
    events: mpsc::UnboundedReceiver<async_nats::Event>,
}

impl Setup {
    async fn start() -> Self {
        let server = NatsServer::start().await.unwrap();
        let upstream = format!("127.0.0.1:{}", server.port()).parse().unwrap();
        let mut proxy = EtcdProxy::new(upstream).unwrap();
        proxy.restore().await.unwrap();
        let subjects = Subjects::new(Namespace::new("outage-test").unwrap());
        let router = async_nats::connect(server.url()).await.unwrap();
        let queries = router.subscribe(subjects.route()).await.unwrap();
        router.flush().await.unwrap();

        // The gateway's connection, with its events sent both to the router client
        // (as the gateway does) and to the test.
        let (to_client, client_events) = mpsc::unbounded_channel();
        let (to_test, events) = mpsc::unbounded_channel();
        let nats = async_nats::ConnectOptions::new()
            .retry_on_initial_connect()
            .reconnect_delay_callback(|_| Duration::from_millis(50))
            .event_callback(move |event| {
                let (to_client, to_test) = (to_client.clone(), to_test.clone());
                async move {
                    let _ = to_test.send(event.clone());
                    let _ = to_client.send(event);
                }
            })
            .connect(proxy.endpoint().replace("http://", "nats://"))
            .await
            .unwrap();
        let settings = one_by_one(ROUTE_TIMEOUT, None);
        let (client, _) = router_client_on(&nats, &subjects, settings, client_events);
        let mut setup = Self {
            _server: server,
            proxy,
            router,
            queries,
            subjects,
            client,
            events,
        };
        setup.until(async_nats::Event::Connected).await;
        setup
    }

    /// Waits until the gateway's connection reports `event`.
    async fn until(&mut self, event: async_nats::Event) {
        let wanted = event.to_string();
        tokio::time::timeout(WAIT, async {
            while let Some(seen) = self.events.recv().await {
                if seen.to_string() == wanted {
                    return;
                }
            }
            panic!("the gateway's connection events ended");
        })
        .await
        .unwrap_or_else(|_| panic!("no {wanted} event within the wait"));
    }

    fn ask(&self, n: u32) -> JoinHandle<Result<RouteReply, ApiError>> {
        ask(&self.client, n)
    }

    /// Answers the next query the router gets, which must be `q-{n}`.
    async fn answer_next(&mut self, n: u32) {
        let (request, inbox) = self.next_query(n).await;
        self.answer(request, inbox).await;
    }

    /// The next query the router gets, which must be `q-{n}`, and its inbox. The
    /// lifecycle publisher's probe after a reconnect (is a router there?) is answered
    /// on the way.
    async fn next_query(&mut self, n: u32) -> (RouteRequest, async_nats::Subject) {
        loop {
            let message = tokio::time::timeout(WAIT, self.queries.next())
                .await
                .expect("a query within the wait")
                .expect("the subscription is open");
            let request: RouteRequest = decode(&message.payload).unwrap();
            let inbox = message.reply.expect("a request has an inbox");
            if request.request_id.0 != READINESS_PROBE {
                assert_eq!(
                    request.request_id.0,
                    format!("q-{n}"),
                    "the query the router got"
                );
                return (request, inbox);
            }
            self.answer(request, inbox).await;
        }
    }

    /// Answers `request` at `inbox` as routed to worker 1.
    async fn answer(&self, request: RouteRequest, inbox: async_nats::Subject) {
        let reply = RouteReply::Routed(decision(request.request_id, WorkerId(1)));
        (self
            .router
            .publish(inbox, encode(&reply).unwrap().into())
            .await)
            .unwrap();
    }
}

async fn outcome(asked: JoinHandle<Result<RouteReply, ApiError>>) -> Result<RouteReply, ApiError> {
    tokio::time::timeout(WAIT, asked).await.unwrap().unwrap()
}

#[tokio::test]
async fn a_query_asked_while_nats_is_away_waits_for_it_and_is_never_sent_late() {
    let mut setup = Setup::start().await;
    setup.ask(0);
    setup.answer_next(0).await;

    // An outage longer than the route timeout: the query fails with 503.
    setup.proxy.cut().await;
    setup.until(async_nats::Event::Disconnected).await;
    let err = outcome(setup.ask(1)).await.unwrap_err();
    assert_eq!(err.status.as_u16(), 503, "{err:?}");

    // Back: the next query the router gets is the one asked now, not the given-up
    // one (which async-nats would have held and sent on reconnect).
    setup.proxy.restore().await.unwrap();
    setup.until(async_nats::Event::Connected).await;
    let asked = setup.ask(2);
    setup.answer_next(2).await;
    assert!(matches!(outcome(asked).await, Ok(RouteReply::Routed(_))));

    // An outage shorter than the timeout: the query waits for the connection and
    // is answered once it is back.
    setup.proxy.cut().await;
    setup.until(async_nats::Event::Disconnected).await;
    let asked = setup.ask(3);
    setup.proxy.restore().await.unwrap();
    setup.answer_next(3).await;
    assert!(matches!(outcome(asked).await, Ok(RouteReply::Routed(_))));
}

#[tokio::test]
async fn a_query_that_finds_no_router_is_asked_again_until_one_subscribes() {
    let mut setup = Setup::start().await;
    setup.ask(0);
    setup.answer_next(0).await;

    // The router unsubscribes, as routers are after a NATS restart until they have
    // subscribed again: NATS answers the query "no responders".
    setup.queries.unsubscribe().await.unwrap();
    setup.router.flush().await.unwrap();
    let asked = setup.ask(1);
    // Long enough for the first ask to find nobody on any host that runs the test
    // promptly; on one that does not, the test passes without testing the repeat.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !asked.is_finished(),
        "the query gave up while no router subscribed"
    );
    setup.queries = setup
        .router
        .subscribe(setup.subjects.route())
        .await
        .unwrap();
    setup.router.flush().await.unwrap();
    setup.answer_next(1).await;
    assert!(matches!(outcome(asked).await, Ok(RouteReply::Routed(_))));
}

/// A query the router received but did not answer in time may have been booked (its
/// answer too late): the gateway follows the failure with the query's `freed`.
#[tokio::test]
async fn a_query_not_answered_in_time_is_followed_by_its_freed() {
    let mut setup = Setup::start().await;
    let mut lifecycle = setup
        .router
        .subscribe(setup.subjects.lifecycle())
        .await
        .unwrap();
    setup.router.flush().await.unwrap();
    let asked = setup.ask(1);
    let (request, _never_answered) = setup.next_query(1).await;
    let err = outcome(asked).await.unwrap_err();
    assert_eq!(err.status.as_u16(), 503, "{err:?}");
    let message = tokio::time::timeout(WAIT, lifecycle.next())
        .await
        .expect("a lifecycle message within the wait")
        .expect("the subscription is open");
    let freed: LifecycleMessage = decode(&message.payload).unwrap();
    assert_eq!(freed.request_id, request.request_id);
    assert_eq!(freed.event, LifecycleEvent::Freed);
}
