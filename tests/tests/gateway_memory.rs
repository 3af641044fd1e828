//! The gateway's memory bound under the largest prompts it accepts: with
//! `--tokenizer-threads 2` and `--max-prompt-bytes` 512 KiB, eight such prompts at once
//! keep the resident set under the bound docs/gateway.md states ("Tokenization
//! limits and memory"): a baseline plus, per tokenizer thread, one encode's peak of
//! at most [`PEAK_BYTES_PER_PROMPT_BYTE`] per prompt byte, plus the request bodies.
//!
//! The one test of its binary: `VmHWM`, the process's resident-set peak, is reset
//! through `/proc/self/clear_refs` before the prompts are sent, and nothing else of
//! this process allocates meanwhile but the stack it started (nats-server and etcd
//! are other processes).

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

// The fixture is shared with gateway.rs, which uses all of it.
#[allow(dead_code)]
#[path = "gateway/fixture.rs"]
mod fixture;

use fixture::{MODEL, Stack};
use serde_json::{Value, json};

/// The documented bound on one encode's resident-set peak, in bytes per prompt byte
/// (Hugging Face `tokenizers`; measured at 148–168 for a 32,000-token byte-level BPE
/// in docs/benchmarks.md).
const PEAK_BYTES_PER_PROMPT_BYTE: u64 = 256;
const MIB: u64 = 1 << 20;
const PROMPT_BYTES: usize = 512 << 10;
const THREADS: u64 = 2;
const PROMPTS: usize = 8;

/// `field` (`VmRSS:`, `VmHWM:`) of this process, in bytes.
fn status_bytes(field: &str) -> u64 {
    integration_tests::child_daemon::status_bytes("self", field).unwrap()
}

/// English-like text of exactly `bytes` bytes, different per `seed`.
fn text(bytes: usize, seed: usize) -> String {
    let words = [
        "the", "router", "sends", "each", "request", "to", "a", "worker", "whose", "cache",
        "already", "holds", "its", "prefix,", "while", "gateway", "keeps", "streams", "flowing.",
        "Latency", "matters;", "blocks", "of", "16", "tokens", "are", "hashed",
    ];
    let mut out = String::with_capacity(bytes + 16);
    let mut x = seed.wrapping_mul(0x9E37_79B9) | 1;
    while out.len() < bytes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(words[x % words.len()]);
        out.push(' ');
    }
    out.truncate(bytes);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_maximum_size_prompts_at_once_stay_under_the_memory_bound() {
    let cap = PROMPT_BYTES.to_string();
    let threads = THREADS.to_string();
    let stack = Stack::start(
        1,
        10.0,
        |_| {},
        &[
            "--tokenizer-threads",
            &threads,
            "--tokenizer-queue",
            "8",
            "--max-prompt-bytes",
            &cap,
        ],
    )
    .await;
    let bodies: Vec<String> = (0..PROMPTS)
        .map(|i| json!({"model": MODEL, "prompt": text(PROMPT_BYTES, i)}).to_string())
        .collect();
    // Warm up: every tokenizer thread has encoded once, the connections are open.
    for body in &bodies[..2] {
        let response = stack.post("/v1/completions", body.clone()).await;
        assert_eq!(response.status(), 400);
    }
    let baseline = status_bytes("VmRSS:");
    std::fs::write("/proc/self/clear_refs", "5").unwrap();

    let sends = bodies.into_iter().map(|body| {
        let (http, url) = (stack.http.clone(), format!("{}/v1/completions", stack.base));
        async move {
            let response = http.post(url).body(body).send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    });
    let answers = futures::future::join_all(sends).await;
    let peak = status_bytes("VmHWM:").saturating_sub(baseline);
    let after = status_bytes("VmRSS:").saturating_sub(baseline);
    for (status, error) in &answers {
        // Every prompt was tokenized (and is over the fixture's 8,000 tokens).
        assert_eq!(*status, 400, "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("tokens"), "{message}");
    }
    // Per request: the body, its parsed copy and the tokenizer's copy, on both sides
    // of the connection (the client is this process too), and slack.
    let bodies = PROMPTS as u64 * 6 * PROMPT_BYTES as u64 + 64 * MIB;
    let bound = THREADS * PEAK_BYTES_PER_PROMPT_BYTE * PROMPT_BYTES as u64 + bodies;
    println!(
        "peak {} MiB, resident after {} MiB above a {} MiB baseline; bound {} MiB",
        peak / MIB,
        after / MIB,
        baseline / MIB,
        bound / MIB
    );
    assert!(
        peak <= bound,
        "peak {} MiB over the bound {} MiB",
        peak / MIB,
        bound / MIB
    );
    stack.stop().await;
}
