//! Tests of the relay's flags and their validation (`config.rs`).

use super::*;
use kv_cluster::nats::{ClientCertificate, NatsAuth};

fn config(args: &[&str]) -> Result<RelayConfig, RelayError> {
    let base = ["kv-router", "--worker-name", "w"];
    let cli =
        kv_cluster::args::parse_flags::<RelayArgs, _, _>(base.iter().chain(args.iter()).copied())
            .expect("flags parse");
    RelayConfig::from_args(&cli)
}

#[test]
fn the_engine_url_is_registered_for_the_gateway() {
    let base = ["--engine-endpoint", "tcp://10.0.0.1:5557"];
    let none = config(&base).unwrap();
    assert_eq!(none.worker.url, None);
    assert!(none.scrape.is_none(), "nothing to scrape");
    let mut with = base.to_vec();
    with.extend(["--engine-url", "http://10.0.0.1:8000/"]);
    let c = config(&with).unwrap();
    assert_eq!(c.worker.url.as_deref(), Some("http://10.0.0.1:8000"));
    let s = c.scrape.expect("the engine's page is read by default");
    assert_eq!(s.url.as_str(), "http://10.0.0.1:8000/metrics");
    let models = s.models.expect("and its /v1/models");
    assert_eq!(models.url.as_str(), "http://10.0.0.1:8000/v1/models");
    // A path prefix is kept; an https engine is read over https.
    let mut prefixed = base.to_vec();
    prefixed.extend(["--engine-url", "http://gw:80/engine-3"]);
    let models = config(&prefixed).unwrap().scrape.unwrap().models.unwrap();
    assert_eq!(models.url.path(), "/engine-3/v1/models");
    let mut https = base.to_vec();
    https.extend([
        "--engine-url",
        "https://e:443",
        "--metrics-url",
        "http://e:9000/m",
    ]);
    let s = config(&https).unwrap().scrape.unwrap();
    assert_eq!(s.url.as_str(), "http://e:9000/m");
    assert_eq!(s.models.unwrap().url.as_str(), "https://e/v1/models");
    let mut bad = base.to_vec();
    bad.extend(["--engine-url", "10.0.0.1:8000"]);
    let err = config(&bad).err().unwrap().to_string();
    assert!(err.contains("engine-url"), "{err}");
}

#[test]
fn the_role_flags_are_checked_and_kept_for_the_registration() {
    use kv_events::disaggregation::{KvTransfer, TransferProtocol, WorkerRole};
    let base = ["--engine-endpoint", "tcp://10.0.0.1:5557"];
    let url = ["--engine-url", "http://10.0.0.1:8000"];
    let aggregated = config(&base).unwrap().worker.placement;
    assert_eq!(
        (aggregated.role, aggregated.kv_transfer),
        (WorkerRole::Both, None)
    );
    let mut prefill = [&base[..], &url[..]].concat();
    prefill.extend([
        "--role",
        "prefill",
        "--kv-transfer",
        "sglang",
        "--bootstrap-port",
        "8998",
    ]);
    let placement = config(&prefill).unwrap().worker.placement;
    assert_eq!(placement.role, WorkerRole::Prefill);
    assert_eq!(
        placement.kv_transfer,
        Some(KvTransfer {
            protocol: TransferProtocol::Sglang,
            bootstrap_port: Some(8998)
        })
    );
    let err = |args: &[&str]| config(args).unwrap_err().to_string();
    let mut decode = [&base[..], &url[..]].concat();
    decode.extend(["--role", "decode"]);
    assert!(err(&decode).contains("--kv-transfer"), "{}", err(&decode));
    // Without a url no frontend could send it either half.
    let mut no_url = base.to_vec();
    no_url.extend(["--role", "decode", "--kv-transfer", "vllm"]);
    assert!(err(&no_url).contains("--engine-url"), "{}", err(&no_url));
}

#[test]
fn one_base_endpoint_is_offset_by_rank_like_vllm() {
    let c = config(&[
        "--engine-endpoint",
        "tcp://10.0.0.1:5557",
        "--replay-endpoint",
        "tcp://10.0.0.1:5600",
        "--dp-size",
        "3",
    ])
    .unwrap();
    let e = &c.engine.endpoints;
    assert_eq!(e.len(), 3);
    assert_eq!(e[2].publish, "tcp://10.0.0.1:5559");
    assert_eq!(e[2].replay.as_deref(), Some("tcp://10.0.0.1:5602"));
    assert_eq!(e[2].default_rank, DpRank(2));
    assert_eq!(c.worker.dp_size, 3);
    assert_eq!(c.engine.format, EngineFormat::Auto);
}

#[test]
fn explicit_endpoints_and_shared_endpoint() {
    let c = config(&["--engine-endpoint", "tcp://a:1,tcp://b:2"]).unwrap();
    assert_eq!(c.worker.dp_size, 2);
    assert_eq!(c.engine.endpoints[1].publish, "tcp://b:2");
    assert_eq!(c.engine.endpoints[1].replay, None);
    let c = config(&[
        "--engine-endpoint",
        "tcp://a:1",
        "--shared-endpoint",
        "--dp-size",
        "4",
    ])
    .unwrap();
    assert_eq!(c.engine.endpoints.len(), 1);
    assert_eq!(c.engine.endpoints[0].default_rank, DpRank(0));
    assert_eq!(c.worker.dp_size, 4);
}

#[test]
fn scrape_urls_are_http_or_https_and_default_to_the_metrics_path() {
    let scrape = |url: &str| {
        config(&["--engine-endpoint", "tcp://a:1", "--metrics-url", url])
            .unwrap()
            .scrape
            .unwrap()
            .url
    };
    assert_eq!(
        scrape("http://127.0.0.1:8000/metrics").as_str(),
        "http://127.0.0.1:8000/metrics"
    );
    assert_eq!(scrape("https://e:8443").as_str(), "https://e:8443/metrics");
}

#[test]
fn nats_auth_tls_and_etcd_flags_are_serves() {
    let with = |extra: &[&str]| config(&[&["--engine-endpoint", "tcp://a:1"], extra].concat());
    let auth = |extra: &[&str]| with(extra).unwrap().nats.auth;
    let creds = NatsAuth::CredentialsFile("r.creds".into());
    assert_eq!(auth(&["--nats-creds", "r.creds"]), creds);
    assert_eq!(auth(&["--nats-token", "t"]), NatsAuth::Token("t".into()));
    let (user, password) = ("u".into(), "p".into());
    let up = NatsAuth::UserPassword { user, password };
    assert_eq!(auth(&["--nats-user", "u", "--nats-password", "p"]), up);
    let tls = [
        "--nats-tls-ca",
        "ca",
        "--nats-tls-cert",
        "c",
        "--nats-tls-key",
        "k",
    ];
    let c = with(&[&tls[..], &["--etcd-connect-timeout-ms", "250"]].concat()).unwrap();
    let cert = ClientCertificate {
        cert: "c".into(),
        key: "k".into(),
    };
    assert_eq!(c.nats.tls.client_cert, Some(cert));
    assert_eq!(c.nats.tls.ca_file, Some("ca".into()));
    assert_eq!(c.etcd.connect_timeout, Duration::from_millis(250));
    let err = |extra: &[&str]| with(extra).unwrap_err().to_string();
    assert!(err(&["--nats-tls-cert", "c.pem"]).contains("--nats-tls-key"));
    assert!(err(&["--nats-user", "u"]).contains("--nats-password"));
    assert!(err(&["--nats-token", "t", "--nats-creds", "c"]).contains("--nats-creds"));
}

#[test]
fn bad_flags_name_themselves() {
    let err = |args: &[&str]| config(args).unwrap_err().to_string();
    assert!(err(&["--engine-endpoint", "ipc:///tmp/x"]).contains("--engine-endpoint"));
    assert!(
        err(&["--engine-endpoint", "tcp://a:1,tcp://b:2", "--dp-size", "3"])
            .contains("--engine-endpoint")
    );
    assert!(err(&["--engine-endpoint", "tcp://a:65535", "--dp-size", "2"]).contains("65535"));
    assert!(err(&["--engine-endpoint", "tcp://a:1", "--dp-size", "0"]).contains("--dp-size"));
    assert!(
        err(&["--engine-endpoint", "tcp://a:1", "--metrics-url", "ftp://x"])
            .contains("--metrics-url")
    );
    let empty = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(empty.path(), b"no certificate here").unwrap();
    for ca in ["/nonexistent/ca.pem", empty.path().to_str().unwrap()] {
        let e = err(&[
            "--engine-endpoint",
            "tcp://a:1",
            "--metrics-url",
            "https://x",
            "--metrics-tls-ca",
            ca,
        ]);
        assert!(e.contains("--metrics-tls-ca"), "{e}");
    }
    assert!(
        err(&["--engine-endpoint", "tcp://a:1", "--lease-ttl-secs", "1"])
            .contains("--lease-ttl-secs")
    );
}

#[test]
fn the_replay_and_reconnect_bounds_have_defaults_and_limits() {
    let c = config(&["--engine-endpoint", "tcp://a:1"]).unwrap();
    assert_eq!(
        c.engine.replay,
        ReplayPolicy {
            request_timeout: Duration::from_secs(2),
            max_requests: 16,
        }
    );
    assert_eq!(c.engine.reconnect_max_backoff, Duration::from_secs(1));
    let with = |extra: &[&str]| config(&[&["--engine-endpoint", "tcp://a:1"], extra].concat());
    let c = with(&[
        "--replay-max-requests",
        "3",
        "--reconnect-max-backoff-ms",
        "250",
    ])
    .unwrap();
    assert_eq!(c.engine.replay.max_requests, 3);
    assert_eq!(c.engine.reconnect_max_backoff, Duration::from_millis(250));
    let err = |extra: &[&str]| with(extra).unwrap_err().to_string();
    assert!(err(&["--replay-max-requests", "0"]).contains("--replay-max-requests"));
    for bad in ["99", "60001"] {
        let e = err(&["--reconnect-max-backoff-ms", bad]);
        assert!(e.contains("--reconnect-max-backoff-ms"), "{e}");
    }
}
