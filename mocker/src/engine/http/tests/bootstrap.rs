//! SGLang's disaggregation protocol on the mock engines: both halves get
//! `bootstrap_host`, `bootstrap_port` and `bootstrap_room`; the decode engine waits
//! for the room on the prefill engine's bootstrap server, then loads and decodes.

use super::sample;
use super::transfer::{Pair, ids_of, next_stored, role};
use crate::engine::EngineDisaggregationArgs;
use kv_cluster::args::{RoleFlag, TransferFlag};
use kv_events::ExternalBlockHash;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn sglang_roles(
    port: u16,
    timeout_ms: u64,
) -> (EngineDisaggregationArgs, EngineDisaggregationArgs) {
    let decode = EngineDisaggregationArgs {
        bootstrap_timeout_ms: timeout_ms,
        ..role(RoleFlag::Decode, TransferFlag::Sglang, None)
    };
    (
        role(RoleFlag::Prefill, TransferFlag::Sglang, Some(port)),
        decode,
    )
}

/// Distinct prompts of 40 tokens.
fn tokens(i: u32) -> Vec<u32> {
    (0..40).map(|t| 5000 + i * 100 + t).collect()
}

fn body(tokens: &[u32], port: u16, room: u64, max_tokens: u64) -> Value {
    json!({"prompt": tokens, "max_tokens": max_tokens, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port, "bootstrap_room": room})
}

/// Six requests at once, each sent to both engines at the same moment (the decode
/// half sometimes first): every decode waits for its own room, loads the prompt
/// (publishing its blocks, counting them as external hits) and answers the client's
/// tokens; every prefill answers one token.
#[tokio::test]
async fn the_room_handshake_pairs_concurrent_requests() {
    let port = testbed::free_port().expect("a free port");
    let (prefill, decode) = sglang_roles(port, 30_000);
    let pair = Pair::start(prefill, decode).await;
    let mut stored = pair.kv_events(2).await;
    let requests = (0..6u32).map(|i| {
        let pair = &pair;
        async move {
            let room = (1 << 62) + u64::from(i);
            let b = body(&tokens(i), port, room, 3);
            let decode = pair.post(&pair.decode, "/v1/completions", &b);
            let prefill = async {
                if i % 2 == 0 {
                    // The decode half is already waiting.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                pair.post(&pair.prefill, "/v1/completions", &b).await
            };
            tokio::join!(decode, prefill)
        }
    });
    for ((d_status, d), (p_status, p)) in futures::future::join_all(requests).await {
        assert_eq!((d_status, p_status), (200, 200), "{d} {p}");
        assert_eq!(d["usage"]["completion_tokens"], 3, "the client's tokens");
        assert_eq!(
            p["usage"]["completion_tokens"], 1,
            "the prefill's one token"
        );
    }
    let m = pair.metrics(&pair.decode).await;
    let hits: f64 = ["engine=\"0\"", "engine=\"1\""]
        .iter()
        .filter_map(|rank| sample(&m, "vllm:external_prefix_cache_hits_total", rank))
        .sum();
    assert_eq!(
        hits,
        6.0 * 40.0,
        "every prompt was loaded over the transfer"
    );
    let mut published = Vec::new();
    while published.len() < 12 {
        // One batch per engine step, which may store several requests' blocks.
        published.extend(next_stored(&mut stored).await);
    }
    let mut expected: Vec<_> = (0..6)
        .flat_map(|i| ids_of(&tokens(i))[..2].to_vec())
        .map(ExternalBlockHash)
        .collect();
    published.sort();
    expected.sort();
    assert_eq!(
        published, expected,
        "each decode published its pulled blocks"
    );
}

/// A decode whose prefill request never comes fails cleanly at its deadline (an
/// error answer, nothing queued on the engine), and the engine serves on; a room
/// whose prefill failed fails its decode at once; a room can be claimed once.
#[tokio::test]
async fn a_room_never_prefilled_times_out_and_a_failed_prefill_fails_its_decode() {
    let port = testbed::free_port().expect("a free port");
    let (prefill, decode) = sglang_roles(port, 300);
    let pair = Pair::start(prefill, decode).await;
    let started = Instant::now();
    let (status, answer) = pair
        .post(
            &pair.decode,
            "/v1/completions",
            &body(&tokens(0), port, 11, 2),
        )
        .await;
    let waited = started.elapsed();
    assert_eq!(status, 500, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("room 11") && message.contains("300 ms"),
        "{message}"
    );
    assert!(waited >= Duration::from_millis(300), "waited {waited:?}");
    assert!(
        waited < Duration::from_secs(20),
        "gave up at its deadline, {waited:?}"
    );
    let m = pair.metrics(&pair.decode).await;
    assert_eq!(
        sample(&m, "vllm:num_requests_running", "engine=\"0\""),
        Some(0.0)
    );

    // A prefill the engine refuses (max_tokens past the context) fails its room.
    let mut refused = body(&tokens(1), port, 12, 1);
    refused["prompt"] = json!(vec![7; 2_000]);
    let (status, _) = pair.post(&pair.prefill, "/v1/completions", &refused).await;
    assert_eq!(status, 400);
    let started = Instant::now();
    let (status, answer) = pair
        .post(
            &pair.decode,
            "/v1/completions",
            &body(&tokens(1), port, 12, 2),
        )
        .await;
    assert_eq!(status, 500, "{answer}");
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "failed at once"
    );

    // A room is one request's: a second prefill of it is refused.
    let b = body(&tokens(2), port, 13, 1);
    let (status, _) = pair.post(&pair.prefill, "/v1/completions", &b).await;
    assert_eq!(status, 200);
    let (status, answer) = pair.post(&pair.prefill, "/v1/completions", &b).await;
    assert_eq!(status, 409, "{answer}");
    // Bad fields are a 400 naming them; the decode still pairs after all that.
    let (status, answer) = pair
        .post(
            &pair.decode,
            "/v1/completions",
            &body(&tokens(2), port, u64::MAX, 2),
        )
        .await;
    assert_eq!(status, 400, "{answer}");
    let mut no_host = body(&tokens(2), port, 14, 2);
    no_host["bootstrap_host"] = json!("evil/path@x");
    let (status, _) = pair.post(&pair.decode, "/v1/completions", &no_host).await;
    assert_eq!(status, 400);
    let (status, answer) = pair
        .post(
            &pair.decode,
            "/v1/completions",
            &body(&tokens(2), port, 13, 2),
        )
        .await;
    assert_eq!(status, 200, "room 13 was prefilled: {answer}");
}

/// Waits for a room end with the engines: a prefill engine that stops answers the
/// decode's long-poll at once (the decode fails, 500), and a decode engine that stops
/// while a request waits for its room answers it 503 — neither holds its shutdown
/// for the 30 s wait.
#[tokio::test]
async fn a_shutdown_ends_the_waits_for_a_room() {
    for stopping in ["prefill", "decode"] {
        let port = testbed::free_port().expect("a free port");
        let (prefill, decode) = sglang_roles(port, 30_000);
        let pair = Pair::start(prefill, decode).await;
        let started = Instant::now();
        let request = body(&tokens(0), port, 21, 2);
        let waiting = pair.post(&pair.decode, "/v1/completions", &request);
        let stop = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            match stopping {
                "prefill" => pair.prefill.shutdown(),
                _ => pair.decode.shutdown(),
            }
        };
        let ((status, answer), ()) = tokio::join!(waiting, stop);
        let expected = if stopping == "prefill" { 500 } else { 503 };
        assert_eq!(status, expected, "{stopping} stopped: {answer}");
        let waited = started.elapsed();
        assert!(
            waited < Duration::from_secs(10),
            "answered at once, {waited:?}"
        );
    }
}
