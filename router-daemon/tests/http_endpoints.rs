//! The HTTP endpoint against a daemon that is built but not connected: no NATS or
//! etcd is needed to check what `/metrics`, `/health/*` and `/debug/workers` report.
//! Messages are built as JSON values and msgpack-encoded, as a non-Rust client would.

use indexer::IndexerApi as _;
use kv_events::discovery::WorkerRegistration;
use kv_events::{WorkerId, decode, encode};
use router_daemon::DirectoryEntry;
use router_daemon::Starting;
use router_daemon::config::{DaemonConfig, ServeArgs};
use router_daemon::counters::Counters;
use serde_json::{Value, json};
use std::time::Duration;

const T: Duration = Duration::from_secs(5);

/// The status and body of one `GET`.
struct Answer {
    status: u16,
    body: String,
}

/// `GET http://{addr}{path}` on a connection of its own, within `timeout`.
async fn get(addr: &str, path: &str, timeout: Duration) -> Result<Answer, kv_cluster::Error> {
    let (status, body) = kv_cluster::http::get_once(addr, path, timeout).await?;
    Ok(Answer {
        status: status.as_u16(),
        body,
    })
}

/// The test daemon's configuration: `extra` flags after the common ones.
fn config_with(extra: &[&str]) -> DaemonConfig {
    let common = ["kv-router", "--block-size", "4", "--shards", "2"];
    let args =
        kv_cluster::args::parse_flags::<ServeArgs, _, _>(common.iter().chain(extra).copied())
            .expect("test flags parse");
    DaemonConfig::from_args(&args).expect("test flags are valid")
}

/// `/debug` on a free loopback port of its own (the default address is fixed).
fn config() -> DaemonConfig {
    config_with(&["--http-debug-listen", "127.0.0.1:0"])
}

/// Every metric a daemon can export: the descriptors of [`Counters`] (including label
/// vectors that have no sample yet) and every family other subsystems registered in
/// the daemon's registry at start-up.
#[tokio::test]
async fn metric_names_are_a_reviewed_change() {
    let registry = prometheus::Registry::new();
    let _starting = Starting::new(config(), &registry).unwrap();
    let mut listing: std::collections::BTreeSet<String> = Counters::unregistered()
        .descriptors()
        .iter()
        .map(|d| format!("{} {:?}", d.fq_name, d.variable_labels))
        .collect();
    for family in registry.gather() {
        let labels: Vec<String> = family
            .get_metric()
            .first()
            .map(|m| m.get_label().iter().map(|l| l.name().to_owned()).collect())
            .unwrap_or_default();
        let mut sorted = labels.clone();
        sorted.sort();
        let known = listing
            .iter()
            .any(|l| l.starts_with(&format!("{} ", family.name())));
        if !known {
            listing.insert(format!("{} {sorted:?}", family.name()));
        }
    }
    insta::assert_snapshot!(listing.into_iter().collect::<Vec<_>>().join("\n"));
}

#[tokio::test]
async fn endpoints_report_health_metrics_and_workers() {
    let registry = prometheus::Registry::new();
    let mut starting = Starting::new(config(), &registry).unwrap();
    let addr = starting
        .serve_http("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
        .to_string();
    let state = starting.state().clone();

    let live = get(&addr, "/health/livez", T).await.unwrap();
    assert_eq!((live.status, live.body.as_str()), (200, "ok\n"));

    let ready = get(&addr, "/health/readyz", T).await.unwrap();
    assert_eq!(ready.status, 503, "{}", ready.body);
    let report: Value = serde_json::from_str(&ready.body).unwrap();
    assert_eq!(report["ready"], false);
    assert_eq!(report["phase"], "starting");
    assert_eq!(report["checks"]["nats"]["ok"], false);
    assert_eq!(report["checks"]["discovery"]["ok"], false);

    // A worker as discovery would register it, one stored chain of 3 blocks, one
    // routed query.
    let reg = WorkerRegistration {
        worker_id: WorkerId(7),
        dp_size: 2,
        block_size: 4,
        total_kv_blocks: 64,
        url: None,
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    };
    state.scheduler().add_worker(reg.clone()).unwrap();
    state.directory.upsert(DirectoryEntry {
        registration: reg,
        lease_id: 0x1234,
        mod_revision: 9,
    });
    let tokens: Vec<u32> = (0..12).collect();
    let hashes = kv_events::compute_block_hashes(&tokens, 4);
    let blocks: Vec<Value> = hashes
        .iter()
        .enumerate()
        .map(|(i, h)| json!({"block_hash": 100 + i as u64, "tokens_hash": h.0}))
        .collect();
    let batch = json!({"worker_id": 7, "events": [
        {"event_id": 0, "dp_rank": 1, "data": {"type": "stored", "parent_hash": null, "blocks": blocks}}
    ]});
    let batch = decode(&encode(&batch).unwrap()).unwrap();
    state.indexer.apply(batch).await.unwrap();
    let request = json!({"request_id": "r1", "prompt": {"type": "tokens", "token_ids": tokens}});
    let reply = router_daemon::handlers::handle_route(&state, &encode(&request).unwrap()).await;
    let reply = serde_json::to_value(&reply).unwrap();
    assert_eq!(reply["status"], "routed", "{reply}");
    assert_eq!(
        (reply["worker_id"].as_u64(), reply["dp_rank"].as_u64()),
        (Some(7), Some(1))
    );
    let bad = router_daemon::handlers::handle_route(&state, b"\xc1 not msgpack").await;
    assert!(serde_json::to_value(&bad).unwrap()["status"] == "error");
    // On dp_rank 0: a second copy of a block stored then dropped (the block stays),
    // and a KV cache group stored again with another window (refused).
    let block = |hash: u64| json!({"block_hash": hash, "tokens_hash": hash});
    let stored = |hash: u64, group: Value| json!({"type": "stored", "parent_hash": null, "blocks": [block(hash)], "group": group});
    let batch = json!({"worker_id": 7, "events": [
        {"event_id": 0, "dp_rank": 0, "data": stored(500, Value::Null)},
        {"event_id": 1, "dp_rank": 0, "data": stored(500, Value::Null)},
        {"event_id": 2, "dp_rank": 0, "data": {"type": "removed", "block_hashes": [500]}},
        {"event_id": 3, "dp_rank": 0, "data": stored(600, json!({"id": 2, "window_blocks": 4}))},
        {"event_id": 4, "dp_rank": 0, "data": stored(700, json!({"id": 2, "window_blocks": 8}))},
    ]});
    let batch = decode(&encode(&batch).unwrap()).unwrap();
    state.indexer.apply(batch).await.unwrap();

    let metrics = get(&addr, "/metrics", T).await.unwrap();
    assert_eq!(metrics.status, 200);
    let text = metrics.body;
    let expect = [
        ("kv_router_ready", "", 0.0),
        ("kv_router_nats_connected", "", 0.0),
        ("kv_router_indexer_blocks", "", 5.0),
        (
            "kv_router_indexer_events_total",
            r#"outcome="applied",type="stored""#,
            4.0,
        ),
        (
            "kv_router_indexer_events_total",
            r#"outcome="rejected",type="stored""#,
            1.0,
        ),
        ("kv_router_indexer_block_ops_total", r#"op="stored""#, 5.0),
        (
            "kv_router_indexer_block_ops_total",
            r#"op="duplicate""#,
            1.0,
        ),
        (
            "kv_router_indexer_block_ops_total",
            r#"op="copy_removed""#,
            1.0,
        ),
        ("kv_router_route_requests_total", r#"outcome="routed""#, 1.0),
        (
            "kv_router_route_decisions_total",
            r#"dp_rank="1",worker_id="7""#,
            1.0,
        ),
        // 3 blocks held, but the 12-token prompt is exactly 3 blocks: the engine
        // computes its last token again, so 2 are reusable.
        ("kv_router_route_overlap_blocks_sum", "", 2.0),
        (
            "kv_router_disaggregation_decisions_total",
            r#"reason="long_uncached""#,
            0.0,
        ),
        (
            "kv_router_route_duration_seconds_count",
            r#"outcome="routed""#,
            1.0,
        ),
        (
            "kv_router_messages_total",
            r#"kind="route",outcome="malformed""#,
            1.0,
        ),
        (
            "kv_router_worker_active_requests",
            r#"dp_rank="1",worker_id="7""#,
            1.0,
        ),
        (
            "kv_router_worker_active_requests",
            r#"dp_rank="0",worker_id="7""#,
            0.0,
        ),
        (
            "kv_router_worker_active_decode_blocks",
            r#"dp_rank="1",worker_id="7""#,
            3.0,
        ),
        (
            "kv_router_indexer_rank_blocks",
            r#"dp_rank="1",worker_id="7""#,
            3.0,
        ),
        ("kv_router_indexer_recovering_ranks", "", 0.0),
    ];
    for (name, labels, value) in expect {
        assert_eq!(
            kv_cluster::http::metric_sample(&text, name, labels),
            Some(value),
            "{name}{{{labels}}} in\n{text}"
        );
    }
    assert!(
        kv_cluster::http::metric_sample(&text, "kv_router_indexer_memory_bytes", "").unwrap() > 0.0
    );
    assert!(text.contains("kv_router_build_info{version="), "{text}");

    assert_eq!(
        get(&addr, "/debug/workers", T).await.unwrap().status,
        404,
        "/debug is not on the main listener"
    );
    let debug_addr = starting
        .http_debug_addr()
        .expect("a debug listener")
        .to_string();
    let workers = get(&debug_addr, "/debug/workers", T).await.unwrap();
    assert_eq!(workers.status, 200);
    let view: Value = serde_json::from_str(&workers.body).unwrap();
    let w = &view["workers"][0];
    assert_eq!(w["worker_id"], 7);
    assert_eq!(w["lease_id"], 0x1234);
    assert_eq!(w["mod_revision"], 9);
    assert_eq!(w["ranks"].as_array().map(Vec::len), Some(2));
    assert_eq!(w["ranks"][1]["active_requests"], 1);
    assert_eq!(w["ranks"][1]["active_decode_blocks"], 3);
    assert_eq!(w["ranks"][1]["indexed_blocks"], 3);
    // A rank's count is its full-attention group's (block 500), not the windowed one's.
    assert_eq!(w["ranks"][0]["indexed_blocks"], 1);
    assert_eq!(w["ranks"][0]["engine"], Value::Null);
    assert_eq!(view["etcd"]["ok"], false);

    let missing = get(&addr, "/nope", T).await.unwrap();
    assert_eq!(missing.status, 404);
    assert_eq!(get(&debug_addr, "/metrics", T).await.unwrap().status, 404);
}

/// `--http-debug-listen off` serves `/debug` nowhere; `main` serves it beside the rest.
#[tokio::test]
async fn debug_endpoint_off_or_on_the_main_listener() {
    for (value, status) in [("off", 404), ("main", 200)] {
        let registry = prometheus::Registry::new();
        let mut starting =
            Starting::new(config_with(&["--http-debug-listen", value]), &registry).unwrap();
        let addr = starting
            .serve_http("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap()
            .to_string();
        assert_eq!(starting.http_debug_addr(), None, "{value}");
        let workers = get(&addr, "/debug/workers", T).await.unwrap();
        assert_eq!(workers.status, status, "--http-debug-listen {value}");
        assert_eq!(get(&addr, "/health/livez", T).await.unwrap().status, 200);
    }
}

/// Finding 11: a thousand connections that never send a request, and one that sends
/// its headers a byte at a time, are all closed unanswered after the header-read
/// timeout, and a normal client's `/health/livez` is answered. Before the timeout
/// existed every such connection stayed open.
#[tokio::test]
async fn slowloris_connections_are_closed_and_probes_still_answered() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let registry = prometheus::Registry::new();
    let flags = [
        "--http-debug-listen",
        "off",
        "--http-header-read-timeout-ms",
        "300",
        "--http-max-connections",
        "256",
    ];
    let mut starting = Starting::new(config_with(&flags), &registry).unwrap();
    let addr = starting
        .serve_http("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    /// Reads until the daemon closes the connection; returns what it answered.
    async fn answer(stream: &mut tokio::net::TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0u8; 512];
        loop {
            let read = tokio::time::timeout(Duration::from_secs(60), stream.read(&mut buf));
            match read.await.expect("the daemon closes the connection") {
                Ok(0) | Err(_) => return got,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    }
    let mut idle = Vec::new();
    for _ in 0..1000 {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        idle.push(tokio::spawn(async move { answer(&mut stream).await }));
    }
    let slow = tokio::spawn(async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = b"GET /health/livez HTTP/1.1\r\nHost: daemon\r\n\r\n";
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        for byte in request {
            tick.tick().await;
            if stream.write_all(&[*byte]).await.is_err() {
                break;
            }
        }
        answer(&mut stream).await
    });
    let live = get(&addr.to_string(), "/health/livez", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!((live.status, live.body.as_str()), (200, "ok\n"));
    for connection in idle {
        assert_eq!(
            connection.await.unwrap(),
            b"",
            "idle connection closed unanswered"
        );
    }
    assert_eq!(
        slow.await.unwrap(),
        b"",
        "slow headers cut before they were complete"
    );
}
