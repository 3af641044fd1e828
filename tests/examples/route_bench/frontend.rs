//! One frontend task of the bench: it sends prompts (to the echo responder, or as
//! single or batch route requests to the daemon) until its deadline, timing each round
//! trip, and hands the `freed` of every routed request to the lifecycle publisher
//! ([`super::freed`]).

use super::{Args, echo, prompt};
use anyhow::Context;
use kv_events::routing::{
    LifecycleEvent, LifecycleMessage, RouteBatchReply, RouteBatchRequest, RouteReply, RouteRequest,
};
use kv_events::{Subjects, decode, encode};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The encoded `RouteRequest` to the echo responder.
    Echo,
    /// One `RouteRequest` per round trip.
    Single,
    /// `--batch` requests per `RouteBatchRequest`.
    Batch,
}

/// What one frontend task measured.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) routes: u64,
    pub(crate) failed: u64,
    pub(crate) round_trips_us: Vec<u64>,
}

/// Runs one frontend task (number `task`) in `mode` until `until`.
pub(crate) async fn frontend(
    nats: async_nats::Client,
    freer: mpsc::UnboundedSender<LifecycleMessage>,
    subjects: Arc<Subjects>,
    args: Arc<Args>,
    mode: Mode,
    task: usize,
    until: Instant,
) -> anyhow::Result<Tally> {
    let mut tally = Tally::default();
    let chains = args.workers * args.chains_per_worker / 2;
    let mut n: u64 = 0;
    while Instant::now() < until {
        let count = match mode {
            Mode::Echo | Mode::Single => 1,
            Mode::Batch => args.batch,
        };
        let requests: Vec<RouteRequest> = (0..count)
            .map(|_| {
                n += 1;
                let id = format!("t{task}-{n}");
                let chain = (n * 7919 + task as u64 * 104_729) % chains.max(1);
                RouteRequest::new(id, prompt(&args, chain, n * 1_000 + task as u64))
            })
            .collect();
        let started = Instant::now();
        let replies = match mode {
            Mode::Echo => {
                let payload = encode(&requests[0])?;
                let reply = nats.request(echo::SUBJECT, payload.clone().into()).await?;
                anyhow::ensure!(reply.payload[..] == payload[..], "echo changed the payload");
                tally.routes += 1;
                tally
                    .round_trips_us
                    .push(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
                continue;
            }
            Mode::Single => {
                let reply = nats
                    .request(subjects.route(), encode(&requests[0])?.into())
                    .await?;
                vec![decode::<RouteReply>(&reply.payload)?]
            }
            Mode::Batch => {
                let batch = RouteBatchRequest {
                    requests: requests.clone(),
                    order: Default::default(),
                };
                let reply = nats
                    .request(subjects.route_batch(), encode(&batch)?.into())
                    .await?;
                match decode::<RouteBatchReply>(&reply.payload)? {
                    RouteBatchReply::Answered { replies } => replies,
                    RouteBatchReply::Error(e) => anyhow::bail!("batch refused: {e:?}"),
                }
            }
        };
        tally
            .round_trips_us
            .push(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
        for (request, reply) in requests.iter().zip(&replies) {
            match reply {
                RouteReply::Routed(_) => {
                    tally.routes += 1;
                    let freed = LifecycleMessage {
                        request_id: request.request_id.clone(),
                        event: LifecycleEvent::Freed,
                    };
                    freer.send(freed).context("the lifecycle publisher ended")?;
                }
                RouteReply::Error(_) => tally.failed += 1,
            }
        }
    }
    Ok(tally)
}
