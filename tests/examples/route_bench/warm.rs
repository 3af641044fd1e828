//! `--warm-up-samples`: give every rank its own calibrated timing before measuring.
//!
//! A fleet in production learns each rank's timing from first tokens (online
//! calibration, `scheduler::calibration`); once every rank has, a `predicted-ttft`
//! decision can no longer treat idle ranks alike. The bench's routes are freed without
//! a first token, so without this the fleet stays cold. With it, the daemon is started
//! with `--calibration-warmup-samples K`, and every cached prefix is routed `K + 2`
//! times, each followed after a short wait by its first token (`PrefillDone`) and its
//! end (`Freed`): each worker holds 8 prefixes of the default layout, so every rank
//! collects at least `K` samples with near certainty.

use crate::{Args, prompt};
use kv_events::routing::{LifecycleEvent, LifecycleMessage, RouteReply, RouteRequest};
use kv_events::{Subjects, decode, encode};
use std::sync::Arc;
use std::time::Duration;

/// Routing tasks in flight during the warm-up.
const TASKS: u64 = 64;

/// Routes every cached prefix `samples + 2` times with a first token 2 ms after each
/// answer; returns the routes answered.
pub(crate) async fn warm_up(
    nats: &async_nats::Client,
    subjects: &Arc<Subjects>,
    args: &Arc<Args>,
    samples: u32,
) -> anyhow::Result<u64> {
    let chains = args.workers * args.chains_per_worker / 2;
    let total = chains * (u64::from(samples) + 2);
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..TASKS {
        let (nats, subjects, args) = (nats.clone(), subjects.clone(), args.clone());
        tasks.spawn(async move {
            let mut routed = 0u64;
            for n in (task..total).step_by(TASKS as usize) {
                let id = format!("warm-{n}");
                let request = RouteRequest::new(id.as_str(), prompt(&args, n % chains, n));
                let reply = nats
                    .request(subjects.route(), encode(&request)?.into())
                    .await?;
                if !matches!(decode::<RouteReply>(&reply.payload)?, RouteReply::Routed(_)) {
                    continue;
                }
                routed += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
                for event in [LifecycleEvent::PrefillDone, LifecycleEvent::Freed] {
                    let message = LifecycleMessage {
                        request_id: request.request_id.clone(),
                        event,
                    };
                    nats.publish(subjects.lifecycle(), encode(&message)?.into())
                        .await?;
                }
            }
            anyhow::Ok(routed)
        });
    }
    let mut routed = 0;
    while let Some(done) = tasks.join_next().await {
        routed += done??;
    }
    nats.flush().await?;
    // Lifecycle messages are applied asynchronously: let the daemon drain them.
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(routed)
}
