//! The gateway's lifecycle publisher against a real nats-server: lifecycle messages
//! queued while it is busy go out as one NATS message (a `LifecycleBatch`, in the
//! order they were queued), and a message queued alone keeps the single form that
//! routers before the batch form read.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

use futures::StreamExt as _;
use integration_tests::router_client::{ALONE, decision, router_client};
use kv_events::routing::{
    LifecycleBatch, LifecycleEvent, LifecycleMessage, Prompt, RouteReply, RouteRequest,
};
use kv_events::{Namespace, Subjects, WorkerId, decode, encode};
use kv_gateway::router::Booking;
use std::time::Duration;
use testbed::NatsServer;

/// Bounds a wait that must end (a failing test must not hang), not a timing claim.
const WAIT: Duration = Duration::from_secs(30);

/// Answers every route request on `subjects` with worker 1.
async fn fake_router(
    nats: &async_nats::Client,
    subjects: &Subjects,
) -> tokio::task::JoinHandle<()> {
    let mut routes = nats.subscribe(subjects.route()).await.unwrap();
    let client = nats.clone();
    tokio::spawn(async move {
        while let Some(message) = routes.next().await {
            let request: RouteRequest = decode(&message.payload).unwrap();
            let reply = RouteReply::Routed(decision(request.request_id, WorkerId(1)));
            if let Some(inbox) = message.reply {
                client
                    .publish(inbox, encode(&reply).unwrap().into())
                    .await
                    .unwrap();
            }
        }
    })
}

async fn next_payload(lifecycle: &mut async_nats::Subscriber) -> bytes::Bytes {
    tokio::time::timeout(WAIT, lifecycle.next())
        .await
        .expect("a lifecycle message within the wait")
        .expect("the subscription is open")
        .payload
}

fn sent(id: &str, event: LifecycleEvent) -> LifecycleMessage {
    LifecycleMessage {
        request_id: id.into(),
        event,
    }
}

/// A real nats-server, a fake router, the lifecycle subject subscribed, and four
/// requests routed by a client sending at most `max_batch` messages per NATS message.
struct Setup {
    _server: NatsServer,
    lifecycle: async_nats::Subscriber,
    bookings: Vec<Booking>,
    ids: Vec<String>,
}

impl Setup {
    async fn start(max_batch: usize) -> Self {
        let server = NatsServer::start().await.unwrap();
        let nats = async_nats::connect(server.url()).await.unwrap();
        let subjects = Subjects::new(Namespace::new("lifecycle-test").unwrap());
        let _router = fake_router(&nats, &subjects).await;
        // The client publishes on this same connection, which the server reads in order.
        let lifecycle = nats.subscribe(subjects.lifecycle()).await.unwrap();
        let (client, _) = router_client(&nats, &subjects, WAIT, ALONE, max_batch);
        let mut bookings: Vec<Booking> = Vec::new();
        for _ in 0..4 {
            let id = client.request_id();
            let prompt = Prompt::Tokens {
                token_ids: vec![1, 2, 3],
            };
            let (_, booking) = client.route(id, prompt, &[], None, false).await.unwrap();
            bookings.push(booking);
        }
        let ids = bookings.iter().map(|b| b.request_id().0.clone()).collect();
        Self {
            _server: server,
            lifecycle,
            bookings,
            ids,
        }
    }

    /// Queues `prefill_done` then `freed` for the first three requests, with no await
    /// in between (so all six are queued before the publisher wakes); returns what
    /// the publisher should send, in order, and the fourth request.
    fn queue_six(&mut self) -> (Vec<LifecycleMessage>, Booking) {
        let lone = self.bookings.pop().unwrap();
        for booking in &mut self.bookings {
            booking.prefill_done();
        }
        for booking in self.bookings.drain(..) {
            booking.free();
        }
        let ids = &self.ids[..3];
        let mut expected: Vec<LifecycleMessage> = ids
            .iter()
            .map(|id| sent(id, LifecycleEvent::PrefillDone))
            .collect();
        expected.extend(ids.iter().map(|id| sent(id, LifecycleEvent::Freed)));
        (expected, lone)
    }
}

// Current-thread runtime (the default): the publisher task runs only when this test
// yields, so everything sent between two awaits is queued before it wakes.
#[tokio::test]
async fn queued_lifecycle_messages_leave_as_one_batch_and_a_lone_one_as_a_single_message() {
    let mut setup = Setup::start(kv_events::limits::MAX_LIFECYCLE_BATCH).await;
    let (expected, lone) = setup.queue_six();
    let batch: LifecycleBatch = decode(&next_payload(&mut setup.lifecycle).await).unwrap();
    assert_eq!(batch.messages, expected, "one NATS message, in queue order");

    lone.free();
    let single = next_payload(&mut setup.lifecycle).await;
    assert_eq!(
        decode::<LifecycleMessage>(&single).unwrap(),
        sent(&setup.ids[3], LifecycleEvent::Freed),
        "alone, the single form an older router reads"
    );
}

/// `--lifecycle-batch 1` (for routers older than the batch form): the same queued
/// messages leave one per NATS message, each in the single form, in order.
#[tokio::test]
async fn a_batch_of_one_sends_every_queued_message_in_the_single_form() {
    let mut setup = Setup::start(1).await;
    let (expected, _lone) = setup.queue_six();
    for message in expected {
        let payload = next_payload(&mut setup.lifecycle).await;
        assert_eq!(
            decode::<LifecycleMessage>(&payload).unwrap(),
            message,
            "the single form, in queue order"
        );
    }
}
