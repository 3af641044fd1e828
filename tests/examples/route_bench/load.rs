//! `--report-load-ms`: every worker reports load, and the daemon skips busy ranks.
//!
//! With busy thresholds set, a rank's busy state reads the load its engine reports,
//! so every reporting rank is touched and a `predicted-ttft` decision cannot treat
//! idle ranks alike (issue 29). With this option the daemon is started with both
//! thresholds ([`BUSY_DECODE`] of each worker's KV blocks, [`BUSY_PREFILL`] tokens)
//! and a metrics interval of twice the period, and every worker publishes a
//! `LoadMetrics` sample each period from just after the warm-up until the end. The
//! samples rotate: in round `k` worker `w` reports `(37w + 13k) mod 100` percent of
//! its KV blocks as decode blocks and `(53w + 7k) mod 5,000` prefill tokens, so
//! about 15% of the ranks are busy by decode blocks and 18% by prefill tokens in any
//! round, and which ones changes every round.

use crate::Args;
use kv_events::{LoadMetrics, Subjects, WorkerId, encode};
use std::sync::Arc;
use std::time::Duration;

/// The decode-blocks busy threshold, a share of each worker's KV blocks.
const BUSY_DECODE: &str = "85%";
/// The prefill-tokens busy threshold, in tokens.
const BUSY_PREFILL: &str = "4096";

/// The daemon flags that go with reports every `period_ms`.
pub(crate) fn daemon_flags(period_ms: u64) -> Vec<String> {
    [
        "--busy-decode-blocks",
        BUSY_DECODE,
        "--busy-prefill-tokens",
        BUSY_PREFILL,
        "--metrics-interval-ms",
    ]
    .into_iter()
    .map(String::from)
    .chain([(2 * period_ms.max(1)).to_string()])
    .collect()
}

/// Publishes every worker's sample each `period_ms` until aborted; the first round
/// is flushed before this returns.
pub(crate) async fn start(
    nats: &async_nats::Client,
    subjects: &Arc<Subjects>,
    args: &Arc<Args>,
    period_ms: u64,
    total_kv_blocks: u64,
) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let (nats, subjects, workers) = (nats.clone(), subjects.clone(), args.workers);
    let round = move |k: u64| {
        let (nats, subjects) = (nats.clone(), subjects.clone());
        async move {
            for w in 0..workers {
                let metrics = LoadMetrics {
                    worker_id: WorkerId(w),
                    active_decode_blocks: total_kv_blocks / 100 * ((37 * w + 13 * k) % 100),
                    active_prefill_tokens: (53 * w + 7 * k) % 5_000,
                    kv_total_blocks: total_kv_blocks,
                    ..LoadMetrics::default()
                };
                nats.publish(subjects.load_metrics(WorkerId(w)), encode(&metrics)?.into())
                    .await?;
            }
            nats.flush().await?;
            anyhow::Ok(())
        }
    };
    round(0).await?;
    let mut tick = tokio::time::interval(Duration::from_millis(period_ms.max(1)));
    tick.tick().await; // the first tick is immediate: round 0 went out above
    Ok(tokio::spawn(async move {
        for k in 1.. {
            tick.tick().await;
            round(k).await?;
        }
        Ok(())
    }))
}
