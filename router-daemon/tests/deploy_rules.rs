//! The Prometheus rules shipped in `deploy/kubernetes/prometheusrule.yaml` use only
//! metrics and labels the daemon exports: every `kv_router_*` name in a rule
//! expression (histogram series `_bucket`/`_sum`/`_count` included) is in the reviewed
//! metric-name snapshot, every label in its selector is one of that metric's labels,
//! and every `by (...)` label belongs to a metric of the same expression. A renamed
//! metric then fails here instead of silently disabling an alert.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

/// Metric name → label names, from the insta snapshot of `/metrics`.
fn exported() -> BTreeMap<String, BTreeSet<String>> {
    let path = repo(
        "router-daemon/tests/snapshots/http_endpoints__metric_names_are_a_reviewed_change.snap",
    );
    let text = std::fs::read_to_string(&path).expect("metric snapshot exists");
    text.lines()
        .filter(|l| l.starts_with("kv_router_"))
        .map(|l| {
            let (name, labels) = l.split_once(' ').expect("name [labels]");
            let labels = labels
                .trim_matches(|c| c == '[' || c == ']')
                .split(',')
                .map(|s| s.trim().trim_matches('"').to_owned())
                .filter(|s| !s.is_empty())
                .collect();
            (name.to_owned(), labels)
        })
        .collect()
}

/// The `expr:` values of a rules file (inline, or a `|` block of deeper-indented lines).
fn expressions(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut exprs = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        let key = trimmed.strip_prefix("- ").unwrap_or(trimmed);
        if let Some(rest) = key.strip_prefix("expr:") {
            let rest = rest.trim();
            if rest == "|" {
                let indent = line.len() - key.len();
                let mut block = String::new();
                i += 1;
                while i < lines.len() {
                    let next = lines[i];
                    let next_indent = next.len() - next.trim_start().len();
                    if !next.trim().is_empty() && next_indent <= indent {
                        break;
                    }
                    block.push_str(next.trim());
                    block.push(' ');
                    i += 1;
                }
                exprs.push(block);
                continue;
            }
            exprs.push(rest.to_owned());
        }
        i += 1;
    }
    exprs
}

/// A metric reference in an expression: its exported name, the labels its selector
/// uses, and whether it is a histogram's `_bucket` series (which adds `le`).
struct Reference {
    name: String,
    labels: Vec<String>,
    bucket: bool,
}

fn references(expr: &str, exported: &BTreeMap<String, BTreeSet<String>>) -> Vec<Reference> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut found = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("kv_router_") {
        let tail = &rest[start..];
        let end = tail.find(|c: char| !is_name(c)).unwrap_or(tail.len());
        let series = &tail[..end];
        let after = &tail[end..];
        rest = after;
        // Recording-rule names (`kv_router:...`) are not exported metrics.
        if after.starts_with(':') {
            continue;
        }
        let (name, bucket) = if exported.contains_key(series) {
            (series.to_owned(), false)
        } else {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| series.strip_suffix(suffix).map(|b| (b, *suffix)));
            match base {
                Some((b, suffix)) => (b.to_owned(), suffix == "_bucket"),
                None => (series.to_owned(), false),
            }
        };
        let labels = after
            .strip_prefix('{')
            .and_then(|s| s.split_once('}'))
            .map(|(selector, _)| {
                selector
                    .split(',')
                    .filter_map(|m| {
                        let key = m.split(['=', '!', '~']).next()?.trim();
                        (!key.is_empty()).then(|| key.to_owned())
                    })
                    .collect()
            })
            .unwrap_or_default();
        found.push(Reference {
            name,
            labels,
            bucket,
        });
    }
    found
}

/// Labels named in `by (...)` clauses.
fn grouping_labels(expr: &str) -> Vec<String> {
    let mut labels = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("by (") {
        let tail = &rest[at + 4..];
        let Some((inside, after)) = tail.split_once(')') else {
            break;
        };
        labels.extend(
            inside
                .split(',')
                .map(|l| l.trim().to_owned())
                .filter(|l| !l.is_empty()),
        );
        rest = after;
    }
    labels
}

#[test]
fn prometheus_rules_use_only_exported_metrics_and_labels() {
    let exported = exported();
    assert!(exported.len() > 20, "snapshot parsed: {exported:?}");
    let yaml = std::fs::read_to_string(repo("deploy/kubernetes/prometheusrule.yaml"))
        .expect("rules file exists");
    let exprs = expressions(&yaml);
    assert!(exprs.len() >= 10, "expressions found: {exprs:?}");
    let mut checked = BTreeSet::new();
    for expr in &exprs {
        let refs = references(expr, &exported);
        assert!(!refs.is_empty(), "no kv_router metric in `{expr}`");
        let mut expr_labels: BTreeSet<String> = BTreeSet::new();
        for r in &refs {
            let Some(labels) = exported.get(&r.name) else {
                panic!("`{}` in `{expr}` is not exported", r.name);
            };
            for label in &r.labels {
                assert!(
                    labels.contains(label) || (r.bucket && label == "le"),
                    "`{}` has no label `{label}` (in `{expr}`); it has {labels:?}",
                    r.name
                );
            }
            expr_labels.extend(labels.iter().cloned());
            checked.insert(r.name.clone());
        }
        for label in grouping_labels(expr) {
            assert!(
                label == "le" || expr_labels.contains(&label),
                "`by ({label})` in `{expr}` names no label of its metrics"
            );
        }
    }
    assert!(checked.contains("kv_router_route_duration_seconds"));
    assert!(checked.contains("kv_router_ready"));
}

#[test]
fn the_checker_catches_a_renamed_metric_or_label() {
    let exported = exported();
    let renamed = references(
        "rate(kv_router_route_requests{outcome=\"routed\"}[5m])",
        &exported,
    );
    assert!(!exported.contains_key(&renamed[0].name));
    let refs = references(
        "sum(rate(kv_router_route_duration_seconds_bucket{le=\"0.1\",status=\"x\"}[5m]))",
        &exported,
    );
    assert_eq!(refs[0].name, "kv_router_route_duration_seconds");
    assert!(refs[0].bucket);
    assert_eq!(refs[0].labels, ["le", "status"]);
    assert!(!exported[&refs[0].name].contains("status"));
    assert_eq!(
        grouping_labels("sum by (le, worker_id) (x) / sum by (kind) (y)"),
        ["le", "worker_id", "kind"]
    );
    assert_eq!(
        expressions("- expr: a\n- expr: |\n    b\n    c\n  for: 1m\n"),
        ["a", "b c "]
    );
}
