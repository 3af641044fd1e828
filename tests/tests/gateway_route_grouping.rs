//! The gateway's route grouping against a real nats-server and a scripted router:
//! queries that arrive while one is out leave together as one `route_batch` when it
//! is answered, each gets its own entry's answer, an entry answered `overloaded` and a
//! batch refused whole are asked again alone, a query never waits past the hold, and
//! `--route-batch 1` sends every query on its own. A booking whose caller left while
//! its query waited is freed at once. With real router replicas, see
//! `replicas/grouping.rs`. Where nothing serves batches, each query is asked alone.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

use futures::StreamExt as _;
use integration_tests::router_client::{decision, router_client};
use kv_events::routing::{
    LifecycleEvent, LifecycleMessage, Prompt, RouteBatchReply, RouteBatchRequest, RouteError,
    RouteErrorCode, RouteReply, RouteRequest,
};
use kv_events::{Namespace, Subjects, WorkerId, decode, encode};
use kv_gateway::error::ApiError;
use kv_gateway::router::{Booking, Grouping, RouterClient};
use std::time::Duration;
use testbed::NatsServer;
use tokio::task::JoinHandle;

/// Bounds a wait that must end (a failing test must not hang), not a timing claim.
const WAIT: Duration = Duration::from_secs(30);

/// Grouping with a hold longer than any test: a query waits for the answer out.
const HOLDING: Grouping = Grouping {
    max: 32,
    hold: WAIT,
};

/// What the scripted router was asked, and the inbox to answer on.
enum Asked {
    Single(RouteRequest, async_nats::Subject),
    Batch(RouteBatchRequest, async_nats::Subject),
}

/// Subscribes the route and batch route subjects; the test answers by hand.
struct ScriptedRouter {
    nats: async_nats::Client,
    asked: futures::stream::SelectAll<async_nats::Subscriber>,
    subjects: Subjects,
}

impl ScriptedRouter {
    /// Serves single queries, and batches too with `batches`.
    async fn start(nats: &async_nats::Client, subjects: &Subjects, batches: bool) -> Self {
        let mut served = vec![nats.subscribe(subjects.route()).await.unwrap()];
        if batches {
            served.push(nats.subscribe(subjects.route_batch()).await.unwrap());
        }
        Self {
            nats: nats.clone(),
            asked: futures::stream::select_all(served),
            subjects: subjects.clone(),
        }
    }

    async fn next(&mut self) -> Asked {
        let message = tokio::time::timeout(WAIT, self.asked.next())
            .await
            .expect("a query within the wait")
            .expect("the subscriptions are open");
        let inbox = message.reply.expect("a request has an inbox");
        if message.subject.as_str() == self.subjects.route_batch() {
            Asked::Batch(decode(&message.payload).unwrap(), inbox)
        } else {
            Asked::Single(decode(&message.payload).unwrap(), inbox)
        }
    }

    async fn single(&mut self) -> (RouteRequest, async_nats::Subject) {
        match self.next().await {
            Asked::Single(request, inbox) => (request, inbox),
            Asked::Batch(batch, _) => panic!("expected a single query, got {batch:?}"),
        }
    }

    async fn batch(&mut self) -> (RouteBatchRequest, async_nats::Subject) {
        match self.next().await {
            Asked::Batch(batch, inbox) => (batch, inbox),
            Asked::Single(request, _) => panic!("expected a batch, got {request:?}"),
        }
    }

    /// Answers `inbox` with an encoded reply.
    async fn answer(&self, inbox: async_nats::Subject, payload: Vec<u8>) {
        self.nats.publish(inbox, payload.into()).await.unwrap();
    }

    /// Answers `inbox` with `request` [`routed`].
    async fn route(&self, inbox: async_nats::Subject, request: &RouteRequest) {
        self.answer(inbox, encode(&routed(request)).unwrap()).await;
    }

    /// Answers `inbox` with every entry of `batch` [`routed`].
    async fn route_batch(&self, inbox: async_nats::Subject, batch: &RouteBatchRequest) {
        let replies = batch.requests.iter().map(routed).collect();
        let answered = RouteBatchReply::Answered { replies };
        self.answer(inbox, encode(&answered).unwrap()).await;
    }

    /// Routes the next `count` single queries; returns their ids, sorted.
    async fn route_singles(&mut self, count: usize) -> Vec<String> {
        let mut ids = Vec::new();
        for _ in 0..count {
            let (request, inbox) = self.single().await;
            self.route(inbox, &request).await;
            ids.push(request.request_id.0);
        }
        ids.sort();
        ids
    }
}

/// Routed to worker `10 + n` for the query whose id ends in `-n`.
fn routed(request: &RouteRequest) -> RouteReply {
    let n: u64 = request
        .request_id
        .0
        .rsplit('-')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    RouteReply::Routed(decision(request.request_id.clone(), WorkerId(10 + n)))
}

fn refused(code: RouteErrorCode) -> RouteError {
    RouteError {
        code,
        message: "scripted".into(),
    }
}

struct Setup {
    _server: NatsServer,
    router: ScriptedRouter,
    client: RouterClient,
    sizes: prometheus::Histogram,
    lifecycle: async_nats::Subscriber,
}

impl Setup {
    async fn start(grouping: Grouping) -> Self {
        Self::serving(grouping, true).await
    }

    /// With a router that serves batches only with `batches`.
    async fn serving(grouping: Grouping, batches: bool) -> Self {
        let server = NatsServer::start().await.unwrap();
        let nats = async_nats::connect(server.url()).await.unwrap();
        let subjects = Subjects::new(Namespace::new("grouping-test").unwrap());
        let router = ScriptedRouter::start(&nats, &subjects, batches).await;
        let lifecycle = nats.subscribe(subjects.lifecycle()).await.unwrap();
        let (client, metrics) = router_client(&nats, &subjects, WAIT, grouping, 1);
        Self {
            _server: server,
            router,
            client,
            sizes: metrics.group_sizes,
            lifecycle,
        }
    }

    /// Asks for query `name-n` in its own task, as concurrent requests do.
    fn ask(&self, name: &str, n: u32) -> JoinHandle<Result<(WorkerId, Booking), ApiError>> {
        let client = self.client.clone();
        let id = format!("{name}-{n}").as_str().into();
        let prompt = Prompt::Tokens {
            token_ids: vec![n; 8],
        };
        tokio::spawn(async move {
            let (decision, booking) = client.route(id, prompt, &[], None, false).await?;
            Ok((decision.worker_id, booking))
        })
    }
}

/// The workers `asked` were routed to, in order.
async fn workers(asked: Vec<JoinHandle<Result<(WorkerId, Booking), ApiError>>>) -> Vec<u64> {
    let mut workers = Vec::new();
    for asked in asked {
        workers.push(worker(asked).await);
    }
    workers
}

async fn worker(asked: JoinHandle<Result<(WorkerId, Booking), ApiError>>) -> u64 {
    let (worker, _booking) = tokio::time::timeout(WAIT, asked)
        .await
        .expect("an answer within the wait")
        .unwrap()
        .expect("routed");
    worker.0
}

fn ids(batch: &RouteBatchRequest) -> Vec<String> {
    batch
        .requests
        .iter()
        .map(|r| r.request_id.0.clone())
        .collect()
}

#[tokio::test]
async fn queries_arriving_while_one_is_out_leave_together_and_each_gets_its_answer() {
    let mut s = Setup::start(HOLDING).await;
    let first = s.ask("q", 0);
    let (lone, inbox) = s.router.single().await;
    assert_eq!(lone.request_id.0, "q-0");
    // Four more arrive while q-0 is out, q-1 well before the others: they all wait
    // for its answer (the hold is long).
    let mut rest = vec![s.ask("q", 1)];
    tokio::time::sleep(Duration::from_millis(50)).await;
    rest.extend((2..=4).map(|n| s.ask("q", n)));
    tokio::task::yield_now().await;
    s.router.route(inbox, &lone).await;
    assert_eq!(worker(first).await, 10);

    let (batch, inbox) = s.router.batch().await;
    assert_eq!(ids(&batch), ["q-1", "q-2", "q-3", "q-4"], "arrival order");
    assert_eq!(batch.order, kv_events::routing::BatchOrder::AsGiven);
    // q-2 is refused as overloaded (a batch never waits in the queue): it is asked
    // again alone, and answered then.
    let replies: Vec<RouteReply> = batch
        .requests
        .iter()
        .map(|r| match r.request_id.0.as_str() {
            "q-2" => RouteReply::Error(refused(RouteErrorCode::Overloaded)),
            _ => routed(r),
        })
        .collect();
    s.router
        .answer(
            inbox,
            encode(&RouteBatchReply::Answered { replies }).unwrap(),
        )
        .await;
    let (again, inbox) = s.router.single().await;
    assert_eq!(again.request_id.0, "q-2");
    s.router.route(inbox, &again).await;
    assert_eq!(
        workers(rest).await,
        [11, 12, 13, 14],
        "each query gets its own entry's answer"
    );
    // One message of 1 query, one of 4; the re-ask goes around the grouping.
    assert_eq!(s.sizes.get_sample_count(), 2);
    assert_eq!(s.sizes.get_sample_sum(), 5.0);
}

#[tokio::test]
async fn a_batch_refused_whole_is_asked_again_query_by_query() {
    let mut s = Setup::start(HOLDING).await;
    let first = s.ask("r", 0);
    let (lone, inbox) = s.router.single().await;
    let rest: Vec<_> = (1..=3).map(|n| s.ask("r", n)).collect();
    tokio::task::yield_now().await;
    s.router.route(inbox, &lone).await;
    let (batch, inbox) = s.router.batch().await;
    assert_eq!(batch.requests.len(), 3);
    // A router with a smaller --max-route-batch refuses the batch; nothing was booked.
    let refusal = RouteBatchReply::Error(refused(RouteErrorCode::BadRequest));
    s.router.answer(inbox, encode(&refusal).unwrap()).await;
    assert_eq!(s.router.route_singles(3).await, ["r-1", "r-2", "r-3"]);
    assert_eq!(worker(first).await, 10);
    assert_eq!(workers(rest).await, [11, 12, 13]);
}

#[tokio::test]
async fn without_a_batch_service_each_query_is_asked_alone() {
    // A router (or a stand-in) that serves only single queries: no batch responder.
    let mut s = Setup::serving(HOLDING, false).await;
    let first = s.ask("n", 0);
    let (lone, inbox) = s.router.single().await;
    let rest: Vec<_> = (1..=2).map(|n| s.ask("n", n)).collect();
    tokio::task::yield_now().await;
    s.router.route(inbox, &lone).await;
    assert_eq!(s.router.route_singles(2).await, ["n-1", "n-2"]);
    assert_eq!(worker(first).await, 10);
    assert_eq!(workers(rest).await, [11, 12]);
}

#[tokio::test]
async fn a_query_waits_for_an_unanswered_one_no_longer_than_the_hold() {
    let hold = Duration::from_millis(50);
    let mut s = Setup::start(Grouping { max: 32, hold }).await;
    let first = s.ask("h", 0);
    let (lone, held) = s.router.single().await;
    // q-0 stays unanswered (a router queue wait, say); the next two leave after the
    // hold anyway, together, and are answered before it.
    let rest: Vec<_> = (1..=2).map(|n| s.ask("h", n)).collect();
    let (batch, inbox) = s.router.batch().await;
    assert_eq!(ids(&batch), ["h-1", "h-2"]);
    s.router.route_batch(inbox, &batch).await;
    assert_eq!(workers(rest).await, [11, 12]);
    assert!(!first.is_finished(), "h-0 is still unanswered");
    s.router.route(held, &lone).await;
    assert_eq!(worker(first).await, 10);
}

#[tokio::test]
async fn a_booking_whose_caller_left_is_freed_at_once() {
    let mut s = Setup::start(HOLDING).await;
    let first = s.ask("g", 0);
    let (lone, inbox) = s.router.single().await;
    let gone = s.ask("g", 1);
    let stays = s.ask("g", 2);
    tokio::task::yield_now().await;
    // g-1's client disconnects while its query waits behind g-0.
    gone.abort();
    s.router.route(inbox, &lone).await;
    assert_eq!(worker(first).await, 10);
    let (batch, inbox) = s.router.batch().await;
    assert_eq!(ids(&batch), ["g-1", "g-2"]);
    s.router.route_batch(inbox, &batch).await;
    assert_eq!(worker(stays).await, 12);
    // Each booking is freed once: g-0 and g-2 by their callers, g-1 by the grouping.
    let mut freed = Vec::new();
    for _ in 0..3 {
        let message = tokio::time::timeout(WAIT, s.lifecycle.next())
            .await
            .expect("a lifecycle message within the wait")
            .expect("the subscription is open");
        let message: LifecycleMessage = decode(&message.payload).unwrap();
        assert_eq!(message.event, LifecycleEvent::Freed);
        freed.push(message.request_id.0);
    }
    freed.sort();
    assert_eq!(freed, ["g-0", "g-1", "g-2"]);
}

#[tokio::test]
async fn with_route_batch_1_every_query_leaves_on_its_own() {
    let mut s = Setup::start(Grouping { max: 1, hold: WAIT }).await;
    let first = s.ask("s", 0);
    let (lone, held) = s.router.single().await;
    let second = s.ask("s", 1);
    // Not held behind the unanswered first query, and not batched.
    let (next, inbox) = s.router.single().await;
    assert_eq!(next.request_id.0, "s-1");
    s.router.route(inbox, &next).await;
    assert_eq!(worker(second).await, 11);
    s.router.route(held, &lone).await;
    assert_eq!(worker(first).await, 10);
    assert_eq!(s.sizes.get_sample_count(), 0, "no grouping task");
}
