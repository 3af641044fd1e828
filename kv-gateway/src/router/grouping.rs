//! Route grouping: the route queries that arrive while one of the gateway's is being
//! answered wait for that answer and then leave together, as one batch.
//!
//! Why: router replicas answer from one NATS queue group and learn each other's
//! bookings over NATS about a millisecond later. Requests that reach the gateway at
//! the same instant (a client's burst, a job fanned out) would go to different
//! replicas, each deciding without the others' bookings, and all pick the same
//! least-loaded worker: 8 replicas served the Mooncake excerpt's same-instant bursts
//! with a 10–22% higher mean TTFT than one (`docs/benchmarks.md`, "Router replicas").
//! A batch (`{ns}.router.route_batch`) is placed by one replica in one critical
//! section, each query seeing the bookings of those before it, in arrival order:
//! what one replica does with the same queries sent one by one. Under load it also
//! saves the router and the gateway a NATS message per query.
//!
//! Rule (group commit): a query is sent at once when no group of this gateway is
//! out; otherwise it waits until the group out is answered or `hold` has passed since
//! that group left, whichever comes first, and then leaves with every query queued by
//! then — at most `max` of them and as many bytes as NATS and the router accept. A
//! query that leaves alone keeps the single form on `{ns}.router.route` (so
//! `--route-batch 1` is the gateway without grouping).
//!
//! A batch never waits in the router's queue (docs/protocol.md), a single query may:
//! so an entry the router answers `overloaded` is asked again on its own, and a batch
//! the router refuses as a whole (more entries or bytes than its limits), or that
//! nothing subscribes (a router or stand-in serving only single queries), is asked
//! again query by query. Either way each query gets the answer it would have had
//! alone, one round trip later.
//!
//! A query whose caller has gone by the time its answer comes (the client
//! disconnected while the query waited or was out) and that the router booked is
//! freed at once, rather than held by the router until its request TTL.
//!
//! Cost: a query that arrives while a group is out waits for that group's answer,
//! the rest of one route round trip (0.2–0.8 ms on one host), at most `hold`; the
//! answer of a batch is as slow as its slowest entry's placement. Every query takes
//! one channel send and one task wake-up more than a direct request.

use super::asker::Asker;
use crate::error::ApiError;
use kv_events::routing::{
    BATCH_FRAME_BYTES, BatchOrder, LifecycleEvent, LifecycleMessage, RouteBatchReply,
    RouteBatchRequest, RouteErrorCode, RouteReply,
};
use prometheus::Histogram;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::debug;

/// How queries are grouped (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grouping {
    /// Most queries in one batch, 1 to [`MAX_GROUP`]; 1 sends each on its own.
    pub max: usize,
    /// Longest a query waits for the group out to be answered.
    pub hold: Duration,
}

/// Most queries in one batch: the router's default `--max-route-batch`.
pub const MAX_GROUP: usize = 256;

/// One query waiting to leave: its encoded `RouteRequest` and where its answer goes.
struct Asked {
    payload: Vec<u8>,
    answer: oneshot::Sender<Result<RouteReply, ApiError>>,
}

/// The handle queries are asked through; the task ends when the last clone is dropped.
#[derive(Clone)]
pub(super) struct Grouper {
    queue: mpsc::UnboundedSender<Asked>,
}

impl Grouper {
    /// Starts the grouping task over `asker`, recording each NATS message's query
    /// count in `sizes` and freeing through `lifecycle` what no caller takes. Must be
    /// called inside a tokio runtime.
    pub(super) fn spawn(
        asker: Asker,
        grouping: Grouping,
        sizes: Histogram,
        lifecycle: mpsc::UnboundedSender<LifecycleMessage>,
    ) -> Self {
        // Unbounded: it holds at most the gateway's requests in flight, which its
        // concurrency limit bounds.
        let (queue, queued) = mpsc::unbounded_channel();
        let task = Task {
            to: Answers { asker, lifecycle },
            max: grouping.max.clamp(1, MAX_GROUP),
            hold: grouping.hold,
            sizes,
        };
        tokio::spawn(task.run(queued));
        Self { queue }
    }

    /// Asks the router with `payload` (one encoded `RouteRequest`), alone or in a
    /// batch, and returns its reply.
    ///
    /// # Errors
    /// As [`Asker::single`].
    pub(super) async fn ask(&self, payload: Vec<u8>) -> Result<RouteReply, ApiError> {
        let (answer, answered) = oneshot::channel();
        self.queue
            .send(Asked { payload, answer })
            .map_err(|_| ApiError::unavailable("the gateway is shutting down"))?;
        answered
            .await
            .unwrap_or_else(|_| Err(ApiError::internal("the route query was dropped")))
    }
}

struct Task {
    to: Answers,
    max: usize,
    hold: Duration,
    sizes: Histogram,
}

impl Task {
    async fn run(self, mut queued: mpsc::UnboundedReceiver<Asked>) {
        // A query taken from the queue that did not fit the group before: it leads
        // the next one.
        let mut carried: Option<Asked> = None;
        // The last group sent: answered when its reply arrived, and the end of its hold.
        let mut out: Option<(oneshot::Receiver<()>, Instant)> = None;
        loop {
            let first = match carried.take() {
                Some(asked) => asked,
                None => match queued.recv().await {
                    Some(asked) => asked,
                    None => return,
                },
            };
            if let Some((answered, until)) = out.take() {
                // Answered, dropped or timed out: either way the next group goes.
                let _ = tokio::time::timeout_at(until, answered).await;
            }
            let budget = self.to.asker.max_payload();
            let mut bytes = BATCH_FRAME_BYTES + first.payload.len();
            let mut group = vec![first];
            while group.len() < self.max {
                let Ok(next) = queued.try_recv() else { break };
                if bytes + next.payload.len() > budget {
                    carried = Some(next);
                    break;
                }
                bytes += next.payload.len();
                group.push(next);
            }
            self.sizes.observe(group.len() as f64);
            let (done, answered) = oneshot::channel();
            out = Some((answered, Instant::now() + self.hold));
            tokio::spawn(self.to.clone().answer(group, done));
        }
    }
}

/// What answers a group: the router's asker, and the lifecycle queue for frees.
#[derive(Clone)]
struct Answers {
    asker: Asker,
    lifecycle: mpsc::UnboundedSender<LifecycleMessage>,
}

impl Answers {
    /// Sends `group` (alone or as a batch), tells `done` when the router has answered,
    /// and answers every query of it.
    async fn answer(self, mut group: Vec<Asked>, done: oneshot::Sender<()>) {
        if group.len() == 1 {
            let Some(asked) = group.pop() else { return };
            let reply = self.asker.single(asked.payload).await;
            let _ = done.send(());
            self.deliver(asked.answer, reply);
            return;
        }
        let payloads: Vec<&[u8]> = group.iter().map(|a| a.payload.as_slice()).collect();
        let reply = match RouteBatchRequest::frame(&payloads, BatchOrder::AsGiven) {
            Ok(payload) => self.asker.batch(payload).await,
            Err(e) => Err(ApiError::internal(format!("encoding a route batch: {e}"))),
        };
        let _ = done.send(());
        match reply {
            Ok(Some(RouteBatchReply::Answered { replies })) if replies.len() == group.len() => {
                for (asked, reply) in group.into_iter().zip(replies) {
                    match reply {
                        RouteReply::Error(e) if e.code == RouteErrorCode::Overloaded => {
                            // A single query may wait in the router's queue; a batch
                            // may not.
                            tokio::spawn(self.clone().alone(asked));
                        }
                        reply => self.deliver(asked.answer, Ok(reply)),
                    }
                }
            }
            Ok(Some(RouteBatchReply::Answered { replies })) => {
                let message = format!(
                    "the router answered {} of a batch of {} route queries",
                    replies.len(),
                    group.len()
                );
                for asked in group {
                    self.deliver(asked.answer, Err(ApiError::internal(message.clone())));
                }
            }
            Ok(Some(RouteBatchReply::Error(refused))) => {
                // Nothing was booked: each query is asked again on its own.
                debug!(queries = group.len(), code = ?refused.code, message = %refused.message,
                    "route batch refused; asking query by query");
                for asked in group {
                    tokio::spawn(self.clone().alone(asked));
                }
            }
            Ok(None) => {
                // Nothing serves batches here: each query is asked on its own.
                debug!(
                    queries = group.len(),
                    "no route batch service; asking query by query"
                );
                for asked in group {
                    tokio::spawn(self.clone().alone(asked));
                }
            }
            Err(e) => {
                for asked in group {
                    self.deliver(asked.answer, Err(e.clone()));
                }
            }
        }
    }

    async fn alone(self, asked: Asked) {
        let reply = self.asker.single(asked.payload).await;
        self.deliver(asked.answer, reply);
    }

    /// Hands `reply` to its caller; a booking no caller takes is freed at once.
    fn deliver(
        &self,
        answer: oneshot::Sender<Result<RouteReply, ApiError>>,
        reply: Result<RouteReply, ApiError>,
    ) {
        if let Err(Ok(RouteReply::Routed(decision))) = answer.send(reply) {
            debug!(request_id = %decision.request_id, "route answered after its caller left; freed");
            // The publisher lives as long as any router client; after that nothing is sent.
            let _ = self.lifecycle.send(LifecycleMessage {
                request_id: decision.request_id,
                event: LifecycleEvent::Freed,
            });
        }
    }
}
