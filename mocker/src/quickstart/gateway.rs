//! The quickstart's request path: `kv-router gateway` in front of the mock engines,
//! and the gateway's own account of where the time before the first token went.

use super::stack::{Binaries, StartedProcesses, child_command};
use super::{READY_TIMEOUT, progress};
use crate::engine::http::DEFAULT_MODEL_NAME;
use crate::replay::http::GatewayTarget;
use anyhow::Context;
use kv_cluster::http::exposition::samples;
use kv_cluster::http::metric_sample;
use kv_events::disaggregation::DisaggregationReason;
use testbed::free_port;

const GATEWAY_READY: &str = "kv-router gateway ready";

/// The header of the gateway table's [`GatewayTotals::row`]s.
pub(super) const GATEWAY_HEADER: [&str; 7] = [
    "gateway",
    "TTFT mean",
    "route",
    "engine",
    "gateway share",
    "remote prefill",
    "cache parity",
];

/// Starts `count` gateways, each on a free loopback port: one answers the replay
/// alone; several take its requests in turn, as behind a round-robin load balancer.
/// The prompts are token ids, so they need no model files: `--tokenize-via engine`
/// would only be used for text.
pub(super) async fn start(
    stack: &mut StartedProcesses,
    binaries: &Binaries,
    connection: &[&str],
    count: u32,
) -> anyhow::Result<Vec<GatewayTarget>> {
    let mut gateways = Vec::new();
    for i in 1..=count {
        let name = if count == 1 {
            "gateway".to_owned()
        } else {
            format!("gateway-{i}")
        };
        gateways.push(start_one(stack, binaries, connection, &name).await?);
    }
    Ok(gateways)
}

/// Starts one gateway, logging as `name`.
async fn start_one(
    stack: &mut StartedProcesses,
    binaries: &Binaries,
    connection: &[&str],
    name: &str,
) -> anyhow::Result<GatewayTarget> {
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let mut command = child_command(&binaries.router);
    command.arg("gateway").args(connection).args([
        "--listen",
        &listen,
        "--tokenize-via",
        "engine",
        "--served-model-name",
        DEFAULT_MODEL_NAME,
        // Mooncake prompts reach 100k+ tokens, sent as JSON lists of ids.
        "--max-prompt-tokens",
        "1048576",
        "--max-body-bytes",
        "67108864",
    ]);
    let gateway = stack.spawn(name, command)?;
    gateway.wait_for_line(GATEWAY_READY, READY_TIMEOUT).await?;
    let url = format!("http://{listen}");
    progress(&format!("{name} ready at {url}/v1 (OpenAI API)"));
    GatewayTarget::new(url, DEFAULT_MODEL_NAME.to_owned()).context("building the http client")
}

/// Sums the gateway exports, read from its `/metrics`.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct GatewayTotals {
    ttft_s: f64,
    requests: f64,
    route_s: f64,
    engine_s: f64,
    /// Routed attempts the router answered without a disaggregation decision (an
    /// aggregated fleet), and those it sent to a prefill worker (`long_uncached`).
    aggregated: f64,
    remote: f64,
    attempts: f64,
    /// Engine answers judged by the cache-parity monitor, over every worker: agreed (in-flight hits
    /// and evictions that raced the route included), over-claimed, under-claimed.
    parity: [f64; 3],
}

impl GatewayTotals {
    /// Reads the totals of every gateway now, summed (zeros for none).
    pub(super) async fn read(gateways: &[GatewayTarget]) -> anyhow::Result<Self> {
        let mut sum = Self::default();
        for gateway in gateways {
            let one = Self::read_one(gateway).await?;
            sum.ttft_s += one.ttft_s;
            sum.requests += one.requests;
            sum.route_s += one.route_s;
            sum.engine_s += one.engine_s;
            sum.aggregated += one.aggregated;
            sum.remote += one.remote;
            sum.attempts += one.attempts;
            for (total, part) in sum.parity.iter_mut().zip(one.parity) {
                *total += part;
            }
        }
        Ok(sum)
    }

    /// Reads one gateway's totals now.
    async fn read_one(gateway: &GatewayTarget) -> anyhow::Result<Self> {
        let (status, text) = kv_cluster::http::get_text(
            &gateway.client,
            format!("{}/metrics", gateway.url),
            std::time::Duration::from_secs(10),
            kv_cluster::http::MAX_RESPONSE_BYTES,
        )
        .await
        .context("reading the gateway's metrics")?;
        anyhow::ensure!(
            status.is_success(),
            "the gateway's /metrics answered {status}"
        );
        let sample = |name: &str, labels: &str| metric_sample(&text, name, labels).unwrap_or(0.0);
        let decided = |reason: &str| {
            sample(
                "kv_gateway_disaggregation_total",
                &format!(r#"reason="{reason}""#),
            )
        };
        let reasons = DisaggregationReason::ALL.map(|r| decided(r.as_str()));
        Ok(Self {
            aggregated: decided("aggregated"),
            remote: decided(DisaggregationReason::LongUncached.as_str()),
            attempts: decided("aggregated") + reasons.iter().sum::<f64>(),
            ttft_s: sample("kv_gateway_ttft_seconds_sum", r#"endpoint="completions""#),
            requests: sample("kv_gateway_ttft_seconds_count", r#"endpoint="completions""#),
            route_s: sample("kv_gateway_stage_seconds_sum", r#"stage="route""#),
            engine_s: sample("kv_gateway_stage_seconds_sum", r#"stage="engine""#),
            // In-flight hits agree: the blocks were booked there, not yet indexed; so
            // do evictions the router shows raced the route: its picture was right.
            parity: [
                &["agree", "in_flight", "evicted"][..],
                &["over_claim"],
                &["under_claim"],
            ]
            .map(|outcomes| {
                samples(&text)
                    .filter(|s| s.name == "kv_gateway_cache_parity_total")
                    .filter(|s| s.label("outcome").is_some_and(|o| outcomes.contains(&o)))
                    .map(|s| s.value)
                    .sum()
            }),
        })
    }

    /// One table row (cells under [`GATEWAY_HEADER`]) for what happened between
    /// `before` and `self`: the gateway's mean TTFT, its routing and engine stages, and
    /// the share of TTFT spent in the gateway and router (everything but the engine's
    /// first token), wall ms.
    pub(super) fn row(&self, before: &Self, policy: &str) -> Vec<String> {
        let n = (self.requests - before.requests).max(1.0);
        let ms = |total: f64| total * 1000.0 / n;
        let ttft = ms(self.ttft_s - before.ttft_s);
        let route = ms(self.route_s - before.route_s);
        let engine = ms(self.engine_s - before.engine_s);
        let share = if ttft > 0.0 {
            100.0 * (ttft - engine).max(0.0) / ttft
        } else {
            0.0
        };
        vec![
            policy.to_owned(),
            format!("{ttft:.1}"),
            format!("{route:.2}"),
            format!("{engine:.1}"),
            format!("{share:.1}%"),
            self.remote_share(before),
            self.parity_counts(before),
        ]
    }

    /// The answers whose cached tokens agreed with the router's prediction, then those
    /// it over- and under-claimed: `agree / over / under`.
    fn parity_counts(&self, before: &Self) -> String {
        let [agree, over, under] = [0, 1, 2].map(|i| self.parity[i] - before.parity[i]);
        format!("{agree:.0} / {over:.0} / {under:.0}")
    }

    /// The share of routed attempts whose prompt ran on a prefill worker, or `-` when
    /// the router made no disaggregation decision (an aggregated fleet).
    fn remote_share(&self, before: &Self) -> String {
        let attempts = self.attempts - before.attempts;
        if attempts <= self.aggregated - before.aggregated {
            return "-".to_owned();
        }
        format!("{:.1}%", 100.0 * (self.remote - before.remote) / attempts)
    }
}
