//! The orderly stop of the engines, within the shutdown budget
//! (`--shutdown-timeout-ms`, [`kv_cluster::shutdown`]): with NATS or etcd gone a
//! lease revoke or the outbox's last publish cannot finish, and the engines must
//! still exit.

use super::{Cluster, ServiceError};
use kv_cluster::shutdown::ShutdownBudget;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Waits for `inner`, then stops in order within `budget` (the docs of `service`): the
/// engine tasks, the leases (revoked), the outbox (published and flushed). Past the
/// budget the rest is skipped, each step logged (a skipped revoke expires with its
/// lease TTL) and [`ServiceError::ShutdownIncomplete`] returned.
pub(super) async fn supervise(
    inner: CancellationToken,
    mut tasks: JoinSet<()>,
    mut leases: JoinSet<()>,
    cluster: Option<Cluster>,
    budget: Duration,
) -> Result<(), ServiceError> {
    inner.cancelled().await;
    let mut budget = ShutdownBudget::start(budget);
    let mut result = Ok(());
    for (step, set) in [
        ("stopping the engines", &mut tasks),
        ("revoking the leases", &mut leases),
    ] {
        let joined = budget.step(step, async {
            let mut result = Ok(());
            while let Some(joined) = set.join_next().await {
                if let Err(err) = joined {
                    warn!(%err, "engine task panicked");
                    result = Err(err.into());
                }
            }
            result
        });
        result = result.and(joined.await.unwrap_or(Ok(())));
    }
    if let Some(cluster) = cluster {
        drop(cluster.outbox);
        let mut publisher = cluster.publisher;
        match budget
            .step("publishing the outbox to NATS", &mut publisher)
            .await
        {
            Some(joined) => joined?,
            None => publisher.abort(),
        }
    }
    budget.finish()?;
    info!("kv-mocker engines stopped");
    result
}
