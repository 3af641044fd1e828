//! The picker's Prometheus metrics (`kv_epp_*`), in the gateway's style; the shared
//! tokenize and route stages are counted by the gateway's metrics
//! (`kv_gateway_stage_seconds`, `kv_gateway_tokenize_*`), registered alongside.

use kv_cluster::metrics::Registrar;
use kv_gateway::metrics::LATENCY_BUCKETS;
use prometheus::{HistogramVec, IntCounterVec, IntGauge};
use std::time::Duration;

/// The picker's metrics (cheap to clone: shared handles).
#[derive(Clone)]
pub struct EppMetrics {
    picks: IntCounterVec,
    pick_latency: HistogramVec,
    streams: IntGauge,
    served: IntCounterVec,
    rebooked: IntCounterVec,
}

impl EppMetrics {
    /// Creates every metric through `r`.
    ///
    /// # Errors
    /// When a metric of the same name is already registered.
    pub fn new(r: &Registrar<'_>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            picks: r.counter_vec(
                "kv_epp_picks_total",
                "Requests answered by the picker, by outcome (the HTTP status of an immediate response, or picked)",
                &["outcome"],
            )?,
            pick_latency: r.histogram_vec(
                "kv_epp_pick_seconds",
                "Time from the request's last body chunk to the picker's answer (tokenize and route), in seconds",
                &["outcome"],
                LATENCY_BUCKETS.to_vec(),
            )?,
            streams: r.gauge("kv_epp_streams", "ext_proc streams open now")?,
            served: r.counter_vec(
                "kv_epp_served_total",
                "Responses whose x-gateway-destination-endpoint-served header named the picked endpoint (match) or another (mismatch) or was absent",
                &["served"],
            )?,
            rebooked: r.counter_vec(
                "kv_epp_rebooked_total",
                "Bookings moved to the registered worker the proxy served instead of the picked one (moved), or left in place because the router refused the move (failed)",
                &["outcome"],
            )?,
        })
    }

    /// One request answered with `outcome` (`picked` or an HTTP status) after `elapsed`.
    pub fn picked(&self, outcome: &str, elapsed: Duration) {
        self.picks.with_label_values(&[outcome]).inc();
        self.pick_latency
            .with_label_values(&[outcome])
            .observe(elapsed.as_secs_f64());
    }

    /// Requests answered with `outcome` so far.
    pub fn picks(&self, outcome: &str) -> u64 {
        self.picks.with_label_values(&[outcome]).get()
    }

    /// A stream opened (`+1`) or closed (`-1`).
    pub fn stream_open(&self, delta: i64) {
        self.streams.add(delta);
    }

    /// The proxy's served-endpoint report: `match`, `mismatch` or `absent`.
    pub fn served(&self, served: &str) {
        self.served.with_label_values(&[served]).inc();
    }

    /// A booking move to the served worker: `moved` or `failed`.
    pub fn rebooked(&self, outcome: &str) {
        self.rebooked.with_label_values(&[outcome]).inc();
    }

    /// Booking moves with `outcome` so far.
    pub fn rebooks(&self, outcome: &str) -> u64 {
        self.rebooked.with_label_values(&[outcome]).get()
    }
}
