//! The quickstart's router: `--router-replicas N` daemons (`kv-router serve`) in the
//! namespace's one route queue group, so NATS hands each route query to one of them,
//! as a scaled-out deployment runs. With more than one, each pass also measures
//! whether the replicas agree: every 500 ms it reads each replica's view of the load
//! booked per rank (`kv_router_worker_active_decode_blocks`, which counts the
//! replica's own bookings and those its peers synced to it) and, at the end of the
//! pass, the replication lag of their sync messages
//! (`kv_router_replica_sync_lag_seconds`, summed over the replicas). Every pass, one
//! replica or more, also reads how many queries each replica routed
//! (`kv_router_route_requests_total{outcome="routed"}`) and the CPU the replicas'
//! processes spent during the pass (from `/proc`, 10 ms resolution, summed): whether
//! one replica made the decisions, and what indexing every KV event in each replica
//! costs the host.
//!
//! Cost: one `/metrics` read per replica per 500 ms (a few KB each, under one
//! scheduler lock in the daemon). The replicas are read concurrently but not at one
//! instant: a booking that lands between two reads counts as spread, so the spread
//! is an upper bound of the replicas' disagreement.

use super::stack::{Binaries, StartedProcesses, child_command};
use super::{READY_TIMEOUT, ROUTER_READY, progress};
use anyhow::Context;
use kv_cluster::http::exposition::samples;
use kv_events::routing::PolicyKind;
use std::collections::BTreeMap;
use std::time::Duration;
use testbed::free_port;

/// How often the booked load of every replica is read during a pass.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Deadline of one `/metrics` read.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
const BOOKED_BLOCKS: &str = "kv_router_worker_active_decode_blocks";
const LAG_BUCKET: &str = "kv_router_replica_sync_lag_seconds_bucket";
const ROUTED: &str = "kv_router_route_requests_total";

/// The header of the replica table's [`ReplicaFigures::row`]s.
pub(super) const REPLICA_HEADER: [&str; 8] = [
    "replicas",
    "routed by busiest",
    "routers CPU s",
    "booked spread mean",
    "booked spread max",
    "sync lag p50",
    "sync lag p99",
    "synced msgs",
];

/// The router replicas of one pass, running.
pub(super) struct RouterReplicas {
    labels: Vec<String>,
    metrics_urls: Vec<String>,
    client: reqwest::Client,
}

/// Starts `replicas` routers under `policy`, one after the other (a later one takes
/// the earlier ones' bookings in its start-up snapshot), each with its HTTP endpoint
/// on a free loopback port and its own router id (1, 2, …).
pub(super) async fn start(
    stack: &mut StartedProcesses,
    binaries: &Binaries,
    connection: &[&str],
    policy: PolicyKind,
    replicas: u32,
) -> anyhow::Result<RouterReplicas> {
    let mut started = RouterReplicas {
        labels: Vec::new(),
        metrics_urls: Vec::new(),
        client: crate::replay::http::GatewayTarget::client().context("building the http client")?,
    };
    for i in 1..=replicas {
        let label = if replicas == 1 {
            format!("router-{policy}")
        } else {
            format!("router-{policy}-{i}")
        };
        let listen = format!("127.0.0.1:{}", free_port()?);
        let mut command = child_command(&binaries.router);
        // `/debug` is served on the HTTP endpoint too, not on its own port.
        // No --block-size: the router adopts the size the workers register.
        command.arg("serve").args(connection).args([
            "--http-listen",
            &listen,
            "--http-debug-listen",
            "main",
            "--policy",
            policy.as_str(),
            "--router-id",
            &i.to_string(),
        ]);
        let router = stack.spawn(&label, command)?;
        started.labels.push(label);
        router.wait_for_line(ROUTER_READY, READY_TIMEOUT).await?;
        started
            .metrics_urls
            .push(format!("http://{listen}/metrics"));
    }
    let noun = if replicas == 1 {
        "router"
    } else {
        "router replicas"
    };
    progress(&format!(
        "{replicas} {noun} ready (kv-router serve --policy {policy})"
    ));
    Ok(started)
}

impl RouterReplicas {
    /// Stops every replica (gracefully).
    pub(super) async fn stop(self, stack: &mut StartedProcesses) -> anyhow::Result<()> {
        for label in &self.labels {
            stack.stop_child(label).await?;
        }
        Ok(())
    }

    /// Reads every replica's booked load each [`SAMPLE_EVERY`] into `figures`, until
    /// dropped; never returns (with one replica there is nothing to compare, and it
    /// reads nothing).
    pub(super) async fn sample_booked_load(
        &self,
        figures: &mut ReplicaFigures,
    ) -> std::convert::Infallible {
        if self.metrics_urls.len() < 2 {
            return std::future::pending().await;
        }
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        loop {
            tick.tick().await;
            // A replica that cannot be read skips the sample; a dead one ends the
            // pass through the quickstart's child watch.
            if let Ok(pages) = self.read_all().await {
                figures.add_sample(&pages);
            }
        }
    }

    /// Notes the replicas' CPU time before the pass in `figures`.
    pub(super) fn read_start(&self, stack: &StartedProcesses, figures: &mut ReplicaFigures) {
        figures.cpu_seconds = -stack.cpu_seconds(&self.labels);
    }

    /// Adds the replicas' CPU time since [`Self::read_start`] and what their metrics
    /// say at the end of the pass ([`ReplicaFigures::add_end`]) to `figures`.
    pub(super) async fn read_end(
        &self,
        stack: &StartedProcesses,
        figures: &mut ReplicaFigures,
    ) -> anyhow::Result<()> {
        figures.cpu_seconds += stack.cpu_seconds(&self.labels);
        figures.add_end(&self.read_all().await?);
        Ok(())
    }

    async fn read_all(&self) -> anyhow::Result<Vec<String>> {
        let reads = self.metrics_urls.iter().map(|url| async move {
            let (status, text) = kv_cluster::http::get_text(
                &self.client,
                url.as_str(),
                READ_TIMEOUT,
                kv_cluster::http::MAX_RESPONSE_BYTES,
            )
            .await
            .with_context(|| format!("reading {url}"))?;
            anyhow::ensure!(status.is_success(), "{url} answered {status}");
            Ok(text)
        });
        futures::future::try_join_all(reads).await
    }
}

/// What one pass measured about its replicas' agreement.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub(super) struct ReplicaFigures {
    /// Router replicas of the pass.
    pub replicas: usize,
    /// Queries each replica routed during the pass, by router id.
    pub routed: Vec<f64>,
    /// CPU seconds the replicas spent during the pass, summed.
    pub cpu_seconds: f64,
    /// Per sample with any load booked: the sum over ranks of the spread of the
    /// replicas' booked decode blocks (max − min) over the sum over ranks of their
    /// mean, as a fraction (0 = every replica saw the same load on every rank).
    pub booked_spread: Vec<f64>,
    /// The replicas' sync lag histograms, summed.
    pub lag: LagBuckets,
}

impl ReplicaFigures {
    /// Adds the spread of one set of `/metrics` pages, one per replica.
    fn add_sample(&mut self, pages: &[String]) {
        let mut by_rank: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for page in pages {
            for s in samples(page).filter(|s| s.name == BOOKED_BLOCKS) {
                by_rank
                    .entry(s.labels.to_owned())
                    .or_default()
                    .push(s.value);
            }
        }
        let (mut spread, mut mean) = (0.0, 0.0);
        for values in by_rank.values() {
            // A rank one replica has not registered yet counts as 0 there.
            let missing = pages.len().saturating_sub(values.len());
            let zeros = std::iter::repeat_n(0.0, missing);
            let all: Vec<f64> = values.iter().copied().chain(zeros).collect();
            let max = all.iter().copied().fold(f64::MIN, f64::max);
            let min = all.iter().copied().fold(f64::MAX, f64::min);
            spread += max - min;
            mean += all.iter().sum::<f64>() / all.len() as f64;
        }
        if mean > 0.0 {
            self.booked_spread.push(spread / mean);
        }
    }

    /// Adds the replicas' `/metrics` `pages` read at the end of the pass: the queries
    /// each routed and their sync lag histograms.
    fn add_end(&mut self, pages: &[String]) {
        self.replicas = pages.len();
        self.routed = (pages.iter())
            .map(|page| {
                (samples(page).filter(|s| s.name == ROUTED))
                    .filter(|s| s.label("outcome") == Some("routed"))
                    .map(|s| s.value)
                    .sum()
            })
            .collect();
        if self.replicas > 1 {
            self.lag = LagBuckets::from_pages(pages);
        }
    }

    /// One row under [`REPLICA_HEADER`], labelled `policy`.
    pub(super) fn row(&self, policy: &str) -> Vec<String> {
        let pct =
            |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{:.1}%", v * 100.0));
        let ms =
            |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("≤ {:.2} ms", v * 1e3));
        let n = self.booked_spread.len();
        let mean = (n > 0).then(|| self.booked_spread.iter().sum::<f64>() / n as f64);
        let max = self.booked_spread.iter().copied().reduce(f64::max);
        let routed: f64 = self.routed.iter().sum();
        let busiest = self.routed.iter().copied().reduce(f64::max);
        vec![
            format!("{policy} ×{}", self.replicas),
            pct(busiest.filter(|_| routed > 0.0).map(|b| b / routed)),
            format!("{:.2}", self.cpu_seconds),
            pct(mean),
            pct(max),
            ms(self.lag.quantile(0.5)),
            ms(self.lag.quantile(0.99)),
            format!("{:.0}", self.lag.count()),
        ]
    }
}

/// Cumulative bucket counts of a latency histogram by upper bound, in seconds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub(super) struct LagBuckets {
    /// `(le, cumulative count)`, in increasing `le`, `+Inf` last.
    pub buckets: Vec<(f64, f64)>,
}

impl LagBuckets {
    /// The sum of the lag histograms of `pages`.
    fn from_pages(pages: &[String]) -> Self {
        let mut sum: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for page in pages {
            for s in samples(page).filter(|s| s.name == LAG_BUCKET) {
                let Some(le) = s.label("le").and_then(parse_le) else {
                    continue;
                };
                sum.entry(le.to_bits()).or_insert((le, 0.0)).1 += s.value;
            }
        }
        let mut buckets: Vec<(f64, f64)> = sum.into_values().collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Self { buckets }
    }

    /// Observations counted.
    fn count(&self) -> f64 {
        self.buckets.last().map_or(0.0, |b| b.1)
    }

    /// The upper bound of the bucket holding quantile `q` (0..=1), in seconds; `None`
    /// without observations or when it falls in `+Inf`.
    fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0.0 {
            return None;
        }
        self.buckets
            .iter()
            .find(|(_, c)| *c >= q * total)
            .map(|b| b.0)
            .filter(|le| le.is_finite())
    }
}

/// Prints the replica table of every pass and writes their figures to
/// `out/replicas.json`.
pub(super) fn report(
    rows: Vec<Vec<String>>,
    figures: &[ReplicaFigures],
    out: &std::path::Path,
) -> anyhow::Result<()> {
    println!("{}", engine_model::render_table(&REPLICA_HEADER, rows));
    println!(
        "(routed by busiest = the share of routed queries the busiest replica decided;\n routers CPU = the replicas' CPU during the pass, summed; booked spread = over ranks,\n max - min of the replicas' booked decode blocks over their mean, sampled every\n 500 ms; sync lag = from a replica deciding a step to a peer having applied it, one\n clock, bucket upper bounds)\n"
    );
    let path = out.join("replicas.json");
    std::fs::write(&path, serde_json::to_vec_pretty(figures)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

fn parse_le(le: &str) -> Option<f64> {
    if le == "+Inf" {
        Some(f64::INFINITY)
    } else {
        le.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_compares_every_rank_across_replicas() {
        let page = |a: u32, b: u32| {
            format!(
                "{BOOKED_BLOCKS}{{worker_id=\"1\",dp_rank=\"0\"}} {a}\n\
                 {BOOKED_BLOCKS}{{worker_id=\"2\",dp_rank=\"0\"}} {b}\n"
            )
        };
        let mut figures = ReplicaFigures::default();
        figures.add_sample(&[page(10, 30), page(10, 30), page(10, 30)]);
        figures.add_sample(&[page(0, 0), page(0, 0)]);
        // Rank 1: 10 vs 20 (spread 10, mean 15); rank 2: 30 vs 30.
        figures.add_sample(&[page(10, 30), page(20, 30)]);
        // A rank one replica has not registered counts as 0 there.
        figures.add_sample(&[page(10, 30), String::new()]);
        assert_eq!(figures.booked_spread.len(), 3, "no load, no sample");
        assert_eq!(figures.booked_spread[0], 0.0);
        assert!((figures.booked_spread[1] - 10.0 / 45.0).abs() < 1e-9);
        assert!((figures.booked_spread[2] - 2.0).abs() < 1e-9);
    }

    #[test]
    fn the_end_of_a_pass_reads_the_queries_each_replica_routed() {
        let page = |routed: u32| {
            format!(
                "{ROUTED}{{outcome=\"routed\"}} {routed}\n\
                 {ROUTED}{{outcome=\"probe\"}} 18\n"
            )
        };
        let mut figures = ReplicaFigures {
            cpu_seconds: 3.04,
            ..ReplicaFigures::default()
        };
        figures.add_end(&[page(90), page(10)]);
        assert_eq!(figures.routed, [90.0, 10.0], "probes are not routes");
        let row = figures.row("kv");
        assert_eq!(row[..3], ["kv ×2", "90.0%", "3.04"]);
    }

    #[test]
    fn lag_quantiles_come_from_the_summed_buckets() {
        let page = |fast: u32, slow: u32| {
            format!(
                "{LAG_BUCKET}{{le=\"0.001\"}} {fast}\n{LAG_BUCKET}{{le=\"0.01\"}} {}\n\
                 {LAG_BUCKET}{{le=\"+Inf\"}} {}\n",
                fast + slow,
                fast + slow
            )
        };
        let lag = LagBuckets::from_pages(&[page(90, 0), page(9, 1)]);
        assert_eq!(lag.count(), 100.0);
        assert_eq!(lag.quantile(0.5), Some(0.001));
        assert_eq!(lag.quantile(0.99), Some(0.001));
        assert_eq!(lag.quantile(1.0), Some(0.01));
        assert_eq!(LagBuckets::default().quantile(0.5), None);
    }
}
