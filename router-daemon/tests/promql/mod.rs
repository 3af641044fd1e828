//! A checker for the PromQL the deployment kit ships (Prometheus rules, the Grafana
//! dashboard): every `kv_router_*` and `kv_gateway_*` name in an expression (histogram
//! series `_bucket`/`_sum`/`_count` included) is in a reviewed metric-name snapshot,
//! every label in its selector is one of that metric's labels, and every `by (...)`
//! label belongs to a metric of the same expression. Labels Prometheus adds to every
//! scraped series (the target labels a ServiceMonitor sets) are allowed everywhere.
//! A renamed metric or label then fails a test instead of silently emptying an alert
//! or a panel.

// Each test binary including this module uses a part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Prefixes of the metrics the project exports.
const PREFIXES: [&str; 2] = ["kv_router_", "kv_gateway_"];

/// Labels Prometheus attaches to every series of a scraped target.
pub const TARGET_LABELS: [&str; 4] = ["namespace", "pod", "job", "instance"];

/// The reviewed snapshots of what the daemon and the gateway export.
const SNAPSHOTS: [&str; 2] = [
    "router-daemon/tests/snapshots/http_endpoints__metric_names_are_a_reviewed_change.snap",
    "kv-gateway/tests/snapshots/metric_names__metric_names_are_a_reviewed_change.snap",
];

pub fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

/// Metric name → label names, from the insta snapshots of both `/metrics` pages.
pub fn exported() -> BTreeMap<String, BTreeSet<String>> {
    let mut all = BTreeMap::new();
    for snapshot in SNAPSHOTS {
        let text = std::fs::read_to_string(repo(snapshot)).expect("metric snapshot exists");
        all.extend(
            text.lines()
                .filter(|l| PREFIXES.iter().any(|p| l.starts_with(p)))
                .map(|l| {
                    let (name, labels) = l.split_once(' ').expect("name [labels]");
                    let labels = labels
                        .trim_matches(|c| c == '[' || c == ']')
                        .split(',')
                        .map(|s| s.trim().trim_matches('"').to_owned())
                        .filter(|s| !s.is_empty())
                        .collect();
                    (name.to_owned(), labels)
                }),
        );
    }
    all
}

/// The `expr:` values of a rules file (inline, or a `|` block of deeper-indented lines).
pub fn expressions(yaml: &str) -> Vec<String> {
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
pub struct MetricReference {
    pub name: String,
    pub labels: Vec<String>,
    pub bucket: bool,
}

pub fn references(
    expr: &str,
    exported: &BTreeMap<String, BTreeSet<String>>,
) -> Vec<MetricReference> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut found = Vec::new();
    let mut rest = expr;
    while let Some(start) = PREFIXES.iter().filter_map(|p| rest.find(p)).min() {
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
        found.push(MetricReference {
            name,
            labels,
            bucket,
        });
    }
    found
}

/// Labels named in `by (...)` clauses.
pub fn grouping_labels(expr: &str) -> Vec<String> {
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

/// Checks one expression; returns the exported metrics it uses, or what is wrong.
pub fn check(
    expr: &str,
    exported: &BTreeMap<String, BTreeSet<String>>,
) -> Result<BTreeSet<String>, String> {
    let refs = references(expr, exported);
    if refs.is_empty() {
        return Err(format!("no kv_router or kv_gateway metric in `{expr}`"));
    }
    let target = |label: &str| TARGET_LABELS.contains(&label);
    let mut used = BTreeSet::new();
    let mut expr_labels: BTreeSet<String> = BTreeSet::new();
    for r in &refs {
        let Some(labels) = exported.get(&r.name) else {
            return Err(format!("`{}` in `{expr}` is not exported", r.name));
        };
        for label in &r.labels {
            if !(labels.contains(label) || target(label) || (r.bucket && label == "le")) {
                return Err(format!(
                    "`{}` has no label `{label}` (in `{expr}`); it has {labels:?}",
                    r.name
                ));
            }
        }
        expr_labels.extend(labels.iter().cloned());
        used.insert(r.name.clone());
    }
    for label in grouping_labels(expr) {
        if !(label == "le" || target(&label) || expr_labels.contains(&label)) {
            return Err(format!(
                "`by ({label})` in `{expr}` names no label of its metrics"
            ));
        }
    }
    Ok(used)
}
