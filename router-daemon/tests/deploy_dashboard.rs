//! The Grafana dashboard (`deploy/grafana/kv-router.json`, shipped in the Helm chart
//! as a ConfigMap) queries only metrics and labels the daemon and the gateway export,
//! checked against their reviewed metric-name snapshots as the Prometheus rules are
//! (see `promql`), and covers what an operator looks at first: route rate and
//! latency, overlap and hit rate, per-worker load, event intake, gaps and
//! recoveries, queue and rejections, the gateway's TTFT and ITL, cache parity.

mod promql;

use promql::{TARGET_LABELS, check, exported, repo};
use serde_json::Value;
use std::collections::BTreeSet;

fn dashboard() -> Value {
    let text =
        std::fs::read_to_string(repo("deploy/grafana/kv-router.json")).expect("dashboard exists");
    serde_json::from_str(&text).expect("dashboard is JSON")
}

/// Every panel's queries, with the panel title: `(title, expr)`.
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let panels = dashboard["panels"].as_array().expect("panels");
    let nested = panels
        .iter()
        .flat_map(|p| p["panels"].as_array().into_iter().flatten());
    for panel in panels.iter().chain(nested) {
        let title = panel["title"].as_str().unwrap_or_default().to_owned();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a target has an expr");
            found.push((title.clone(), expr.to_owned()));
        }
    }
    found
}

#[test]
fn dashboard_queries_use_only_exported_metrics_and_labels() {
    let exported = exported();
    let dashboard = dashboard();
    let queries = queries(&dashboard);
    assert!(queries.len() >= 20, "queries found: {queries:?}");
    let mut used = BTreeSet::new();
    for (title, expr) in &queries {
        let metrics = check(expr, &exported).unwrap_or_else(|e| panic!("panel `{title}`: {e}"));
        used.extend(metrics);
    }
    // Template variables: `label_values(metric, label)`.
    for var in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        let Some(definition) = var["definition"].as_str() else {
            continue;
        };
        let inner = definition
            .strip_prefix("label_values(")
            .and_then(|s| s.strip_suffix(')'))
            .expect("variables use label_values(metric, label)");
        let (metric, label) = inner.split_once(',').expect("label_values(metric, label)");
        let (metric, label) = (metric.trim(), label.trim());
        let labels = exported
            .get(metric)
            .unwrap_or_else(|| panic!("variable query `{definition}`: `{metric}` not exported"));
        assert!(
            labels.contains(label) || TARGET_LABELS.contains(&label),
            "variable query `{definition}`: no label `{label}`"
        );
    }
    for needed in [
        "kv_router_route_requests_total",
        "kv_router_route_duration_seconds",
        "kv_router_route_overlap_blocks",
        "kv_gateway_overlap_ratio",
        "kv_router_route_decisions_total",
        "kv_router_engine_kv_used_blocks",
        "kv_router_indexer_events_total",
        "kv_router_indexer_event_order_total",
        "kv_router_recovery_runs_total",
        "kv_router_queue_depth",
        "kv_router_messages_total",
        "kv_gateway_ttft_seconds",
        "kv_gateway_itl_seconds",
        "kv_gateway_cache_parity_total",
        "kv_gateway_cache_parity_diff_tokens",
        "kv_gateway_cache_parity_mismatch",
    ] {
        assert!(used.contains(needed), "no panel shows {needed}: {used:?}");
    }
}

#[test]
fn panels_have_unique_ids_and_query_the_dashboard_datasource() {
    let dashboard = dashboard();
    let mut ids = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let id = panel["id"].as_u64().expect("numeric panel id");
        assert!(ids.insert(id), "panel id {id} twice");
        if panel["type"] != "row" {
            assert_eq!(
                panel["datasource"]["uid"], "${datasource}",
                "panel `{}` has a fixed datasource",
                panel["title"]
            );
        }
    }
}

#[test]
fn the_dashboard_checker_catches_a_renamed_metric_in_a_panel() {
    let exported = exported();
    let mut dashboard = dashboard();
    dashboard["panels"][1]["targets"][0]["expr"] =
        Value::from("sum(rate(kv_gateway_time_to_first_token_seconds_count[5m]))");
    let (_, expr) = &queries(&dashboard)[0];
    assert!(check(expr, &exported).is_err());
}
