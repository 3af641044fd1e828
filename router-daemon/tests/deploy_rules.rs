//! The Prometheus rules shipped in the Helm chart
//! (`deploy/helm/kv-router/files/prometheus-rules.yaml`) use only metrics and labels
//! the daemon exports (see `promql` for what is checked). A renamed metric then fails
//! here instead of silently disabling an alert.

mod promql;

use promql::{check, exported, expressions, grouping_labels, references, repo};
use std::collections::BTreeSet;

#[test]
fn prometheus_rules_use_only_exported_metrics_and_labels() {
    let exported = exported();
    assert!(exported.len() > 20, "snapshot parsed: {exported:?}");
    let yaml = std::fs::read_to_string(repo("deploy/helm/kv-router/files/prometheus-rules.yaml"))
        .expect("rules file exists");
    let exprs = expressions(&yaml);
    assert!(exprs.len() >= 10, "expressions found: {exprs:?}");
    let mut checked = BTreeSet::new();
    for expr in &exprs {
        checked.extend(check(expr, &exported).unwrap_or_else(|e| panic!("{e}")));
    }
    assert!(checked.contains("kv_router_route_duration_seconds"));
    assert!(checked.contains("kv_router_ready"));
    assert!(checked.contains("kv_gateway_cache_parity_mismatch"));
}

#[test]
fn the_checker_catches_a_renamed_metric_or_label() {
    let exported = exported();
    let renamed = references(
        "rate(kv_router_route_requests{outcome=\"routed\"}[5m])",
        &exported,
    );
    assert!(!exported.contains_key(&renamed[0].name));
    assert!(check("rate(kv_router_route_requests[5m])", &exported).is_err());
    let refs = references(
        "sum(rate(kv_router_route_duration_seconds_bucket{le=\"0.1\",status=\"x\"}[5m]))",
        &exported,
    );
    assert_eq!(refs[0].name, "kv_router_route_duration_seconds");
    assert!(refs[0].bucket);
    assert_eq!(refs[0].labels, ["le", "status"]);
    assert!(!exported[&refs[0].name].contains("status"));
    assert!(
        check(
            "sum(rate(kv_router_route_duration_seconds_bucket{le=\"0.1\",status=\"x\"}[5m]))",
            &exported
        )
        .is_err()
    );
    assert!(check("sum by (kind) (kv_router_queue_depth)", &exported).is_err());
    assert!(check("sum by (pod) (kv_router_queue_depth)", &exported).is_ok());
    assert!(
        check(
            "sum by (endpoint) (rate(kv_gateway_ttft_seconds_count[5m]))",
            &exported
        )
        .is_ok()
    );
    assert!(
        check(
            "rate(kv_gateway_ttft_seconds_count{stage=\"x\"}[5m])",
            &exported
        )
        .is_err()
    );
    assert_eq!(
        grouping_labels("sum by (le, worker_id) (x) / sum by (kind) (y)"),
        ["le", "worker_id", "kind"]
    );
    assert_eq!(
        expressions("- expr: a\n- expr: |\n    b\n    c\n  for: 1m\n"),
        ["a", "b c "]
    );
}
