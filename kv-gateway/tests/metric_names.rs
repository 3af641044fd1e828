//! Every metric the gateway exports, with its label names, as a reviewed snapshot: a
//! rename shows up in review, and the Grafana dashboard's test
//! (`router-daemon/tests/deploy_dashboard.rs`) checks its queries against this list.

use kv_cluster::metrics::Registrar;
use kv_gateway::metrics::GatewayMetrics;

/// Lines `name ["label", …]`, sorted by name, in the format of the daemon's snapshot.
#[test]
fn metric_names_are_a_reviewed_change() {
    let registrar = Registrar::unregistered();
    GatewayMetrics::new(&registrar).expect("static metric definitions are valid");
    let listing: Vec<String> = registrar
        .descriptors()
        .iter()
        .map(|d| format!("{} {:?}", d.fq_name, d.variable_labels))
        .collect();
    assert!(
        listing
            .iter()
            .any(|l| l.starts_with("kv_gateway_ttft_seconds "))
    );
    insta::assert_snapshot!(listing.join("\n"));
}
