//! One way to create Prometheus metrics: each metric group is built by a constructor
//! that takes a [`Registrar`], which registers every metric it creates in an injected
//! [`Registry`] — or, for tests and tools, in none.
//!
//! Why injected rather than the global registry (as Quickwit's `new_counter` family
//! does): several daemons and relays run in one test process, and each must export
//! only its own metrics. Why one helper: the alternative is a `register` and an
//! `unregistered` constructor per metric group, each listing its metrics again; here a
//! group lists each metric once, in the constructor that creates it.
//!
//! This module depends on nothing but `prometheus`, so that every binary of the
//! project (daemon, relay, gateway) can build its metrics the same way.
//!
//! Costs: none after start-up. A registrar keeps the descriptor of every metric it
//! created (a few hundred bytes each) for as long as it lives, which is the
//! constructor call.

use prometheus::core::{Collector, Desc};
use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};
use std::cell::RefCell;

/// Creates metrics and registers each in the injected registry, if any.
///
/// Every constructor fails with a [`prometheus::Error`] when the definition is invalid
/// (a bad name or label) or a metric of the same name is already registered.
pub struct Registrar<'a> {
    registry: Option<&'a Registry>,
    created: RefCell<Vec<Desc>>,
}

impl<'a> Registrar<'a> {
    /// Registers every metric it creates in `registry`.
    pub fn new(registry: &'a Registry) -> Self {
        Self {
            registry: Some(registry),
            created: RefCell::default(),
        }
    }

    /// Registers nothing: the metrics work, but nobody scrapes them.
    pub fn unregistered() -> Registrar<'static> {
        Registrar {
            registry: None,
            created: RefCell::default(),
        }
    }

    /// An integer counter.
    pub fn counter(&self, name: &str, help: &str) -> Result<IntCounter, prometheus::Error> {
        self.add(IntCounter::new(name, help)?)
    }

    /// Integer counters, one per value of `labels`.
    pub fn counter_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntCounterVec, prometheus::Error> {
        self.add(IntCounterVec::new(Opts::new(name, help), labels)?)
    }

    /// An integer gauge.
    pub fn gauge(&self, name: &str, help: &str) -> Result<IntGauge, prometheus::Error> {
        self.add(IntGauge::new(name, help)?)
    }

    /// Integer gauges, one per value of `labels`.
    pub fn gauge_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntGaugeVec, prometheus::Error> {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels)?)
    }

    /// Floating-point gauges (ratios, estimates), one per value of `labels`.
    pub fn float_gauge_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<GaugeVec, prometheus::Error> {
        self.add(GaugeVec::new(Opts::new(name, help), labels)?)
    }

    /// A histogram with the given bucket bounds.
    pub fn histogram(
        &self,
        name: &str,
        help: &str,
        buckets: Vec<f64>,
    ) -> Result<Histogram, prometheus::Error> {
        self.add(Histogram::with_opts(
            HistogramOpts::new(name, help).buckets(buckets),
        )?)
    }

    /// Histograms with the given bucket bounds, one per value of `labels`.
    pub fn histogram_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        buckets: Vec<f64>,
    ) -> Result<HistogramVec, prometheus::Error> {
        self.add(HistogramVec::new(
            HistogramOpts::new(name, help).buckets(buckets),
            labels,
        )?)
    }

    /// The descriptors (name, help, label names) of every metric created so far,
    /// sorted by name: what a scrape can export, label vectors without samples
    /// included.
    pub fn descriptors(&self) -> Vec<Desc> {
        let mut descs = self.created.borrow().clone();
        descs.sort_by(|a, b| a.fq_name.cmp(&b.fq_name));
        descs
    }

    fn add<M: Collector + Clone + 'static>(&self, metric: M) -> Result<M, prometheus::Error> {
        if let Some(registry) = self.registry {
            registry.register(Box::new(metric.clone()))?;
        }
        self.created
            .borrow_mut()
            .extend(metric.desc().into_iter().cloned());
        Ok(metric)
    }
}

/// Builds a metric group with `build`, registered nowhere.
///
/// # Panics
/// When `build` fails. With nothing registered it can only fail on an invalid
/// definition; the project's definitions are static, and a test builds every group, so
/// that is a programming error caught before release.
pub fn unregistered<T>(build: impl FnOnce(&Registrar<'_>) -> Result<T, prometheus::Error>) -> T {
    // Nothing is registered, so no name can clash; definitions are static and valid.
    #[allow(clippy::expect_used)]
    build(&Registrar::unregistered()).expect("static metric definitions are valid")
}

/// The registry of one participant's process (`kv-router serve`, `relay`, `gateway`,
/// `epp`): empty but for the standard `process_*` metrics of the process, read from
/// `/proc/self` at each scrape: `process_cpu_seconds_total` (user + system),
/// `process_resident_memory_bytes`, `process_virtual_memory_bytes`,
/// `process_open_fds`, `process_max_fds`, `process_threads` and
/// `process_start_time_seconds` (Unix time). Operators read a replica's CPU and
/// memory from them as they do for any Prometheus target.
///
/// Tests that run several participants in one process give each a plain
/// [`Registry::new`] instead: the process metrics would be the test's, not theirs.
/// Cost: a scrape reads three small `/proc` files and lists the open descriptors.
pub fn process_registry() -> Registry {
    let registry = Registry::new();
    #[cfg(target_os = "linux")]
    {
        let collector = prometheus::process_collector::ProcessCollector::for_self();
        // A fresh registry holds no other collector, so no name can clash.
        #[allow(clippy::expect_used)]
        registry
            .register(Box::new(collector))
            .expect("a fresh registry accepts the process collector");
    }
    registry
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_registry_exports_the_process_cpu_and_memory() {
        let registry = process_registry();
        let names: Vec<String> = (registry.gather().iter())
            .map(|f| f.name().to_owned())
            .collect();
        for name in ["process_cpu_seconds_total", "process_resident_memory_bytes"] {
            assert!(names.iter().any(|n| n == name), "{name} missing: {names:?}");
        }
    }

    #[test]
    fn registers_in_the_injected_registry_only() {
        let registry = Registry::new();
        let registered = Registrar::new(&registry);
        let c = registered.counter("a_total", "A").unwrap();
        c.inc();
        let _ = registered.counter_vec("b_total", "B", &["kind"]).unwrap();
        let names: Vec<String> = registry
            .gather()
            .iter()
            .map(|f| f.name().to_owned())
            .collect();
        assert_eq!(
            names,
            ["a_total"],
            "a vector without samples is not gathered"
        );
        let described: Vec<String> = registered
            .descriptors()
            .iter()
            .map(|d| d.fq_name.clone())
            .collect();
        assert_eq!(described, ["a_total", "b_total"]);
        assert!(
            registered.counter("a_total", "again").is_err(),
            "a name registers once"
        );

        let nowhere = Registrar::unregistered();
        let g = nowhere.gauge("a_total", "same name, no registry").unwrap();
        g.set(3);
        assert_eq!(g.get(), 3);
        assert_eq!(registry.gather().len(), 1);
    }

    #[test]
    fn invalid_definitions_fail() {
        let nowhere = Registrar::unregistered();
        assert!(nowhere.counter("bad name", "spaces").is_err());
        assert!(nowhere.counter_vec("c_total", "C", &["bad-label"]).is_err());
        assert!(
            nowhere.histogram("h_seconds", "H", vec![2.0, 1.0]).is_err(),
            "buckets must increase"
        );
    }
}
