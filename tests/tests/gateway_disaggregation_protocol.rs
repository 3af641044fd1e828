//! The gateway's side of the disaggregation protocols, message by message: vLLM's
//! two steps (`kv_transfer_params` from the prefill worker's answer to the decode
//! worker) and SGLang's concurrent requests (`bootstrap_host`, `bootstrap_port`, one
//! `bootstrap_room`), the decode worker's answer streamed or assembled for the
//! client, each half failed over (refused, 5xx, hung, malformed parameters), and every
//! booking freed. The gateway, nats-server and etcd are real; the engines are loopback
//! HTTP servers that answer each protocol and record what they receive, and the
//! router is a NATS responder that pairs the first prefill and decode workers a
//! request does not exclude and records every lifecycle message (module
//! `gateway/pd.rs`), so each message can be checked. `gateway_disaggregation.rs` runs
//! the same gateway in front of the real router and mock engines.

// Test helpers unwrap: a failed setup step must fail the test loudly.
#![allow(clippy::unwrap_used)]

// The fixture is shared with gateway.rs, which uses all of it.
#[allow(dead_code)]
#[path = "gateway/fixture.rs"]
mod fixture;
#[path = "gateway/pd.rs"]
mod pd;
#[path = "gateway/pd_stack.rs"]
mod pd_stack;
#[path = "gateway/routed.rs"]
mod routed;

use fixture::MODEL;
use futures::StreamExt;
use kv_events::disaggregation::{TransferProtocol, WorkerRole};
use kv_events::routing::LifecycleEvent::{Freed, PrefillDone, RemotePrefillDone};
use pd::Behaviour;
use pd_stack::{Member, PAIR, PdStack, SERVE, assert_params_forwarded, prompt};
use serde_json::{Value, json};
use std::time::Duration;

#[tokio::test]
async fn the_openai_client_is_answered_by_the_decode_worker_with_the_prefill_workers_params() {
    let fleet = PAIR;
    let flags = ["--max-prompt-tokens", "8000"];
    let stack = PdStack::start(TransferProtocol::Vllm, &fleet, Duration::ZERO, &flags).await;
    let (python, script) = fixture::openai_python("gateway_client.py").await;
    let seen = integration_tests::python::run_json(&python, &script, &[&stack.base, MODEL]).await;

    // What the client sees is the decode worker's answer, as for a whole request.
    fixture::assert_openai_client_saw(&seen);
    assert_eq!(seen["completion"]["text"], " t1 t2 t3 t4 t5");
    assert_eq!(seen["completion_stream"]["text"], " t1 t2 t3 t4 t5 t6");
    assert_eq!(seen["chat"]["content"], " t1 t2 t3 t4");

    // vLLM's first step: one token, not streamed, asking for a remote decode.
    let (prefill, decode) = (stack.engine(11), stack.engine(21));
    let prefilled = prefill.received();
    assert_eq!(prefilled.len(), 4, "one prefill per answered request");
    for request in &prefilled {
        let body = &request.body;
        assert_eq!(body["max_tokens"], 1, "{body}");
        assert_eq!(body["stream"], false, "{body}");
        assert!(body.get("stream_options").is_none(), "{body}");
        assert_eq!(
            body["kv_transfer_params"]["do_remote_decode"], true,
            "{body}"
        );
        assert_eq!(
            body["kv_transfer_params"]["do_remote_prefill"], false,
            "{body}"
        );
    }
    assert_eq!(assert_params_forwarded(prefill, decode), 4);

    stack.all_freed().await;
    for routed in stack.router.routed() {
        assert!(routed.allow_disaggregation);
        let events = stack.router.events(&routed.request_id);
        assert_eq!(
            events,
            [RemotePrefillDone, PrefillDone, Freed],
            "{}",
            routed.request_id
        );
    }
    assert_eq!(stack.metrics().routed_count("long_uncached"), 4);
    assert_eq!(stack.metrics().remote_prefills("vllm"), 4);
    stack.stop().await;
}

#[tokio::test]
async fn sglangs_halves_go_out_together_with_one_room_and_the_prefill_workers_bootstrap() {
    let fleet = PAIR;
    let stack = PdStack::start(TransferProtocol::Sglang, &fleet, Duration::ZERO, &[]).await;
    let streamed = stack.complete(&prompt(100), true, 3).await;
    assert_eq!(streamed.status, 200, "{}", streamed.text);
    assert!(
        streamed.text.contains(r#""text":" t3""#),
        "{}",
        streamed.text
    );
    assert!(
        streamed.text.ends_with("data: [DONE]\n\n"),
        "{}",
        streamed.text
    );
    assert_eq!(streamed.worker.as_deref(), Some("21"));
    assert_eq!(streamed.prefill.as_deref(), Some("11"));
    assert_eq!(streamed.decision.as_deref(), Some("long_uncached"));
    let whole = stack.complete(&prompt(200), false, 3).await;
    assert_eq!(whole.status, 200, "{}", whole.text);
    let whole: Value = serde_json::from_str(&whole.text).unwrap();
    assert_eq!(whole["choices"][0]["text"], " t1 t2 t3", "{whole}");
    assert_eq!(whole["usage"]["completion_tokens"], 3, "{whole}");

    let (prefill, decode) = (stack.engine(11), stack.engine(21));
    let (prefilled, decoded) = (prefill.received(), decode.received());
    assert_eq!((prefilled.len(), decoded.len()), (2, 2));
    let mut rooms = Vec::new();
    for (p, d) in prefilled.iter().zip(&decoded) {
        assert_eq!(
            p.request_id, d.request_id,
            "the same request on both workers"
        );
        for body in [&p.body, &d.body] {
            assert_eq!(body["bootstrap_host"], "127.0.0.1", "{body}");
            assert_eq!(
                body["bootstrap_port"],
                json!(prefill.bootstrap_port.unwrap())
            );
            assert!(body.get("kv_transfer_params").is_none(), "{body}");
        }
        assert_eq!(p.body["bootstrap_room"], d.body["bootstrap_room"]);
        assert!(p.body["bootstrap_room"].as_u64().unwrap() < 1 << 63);
        assert_eq!(
            (&p.body["stream"], &d.body["stream"]),
            (&json!(false), &json!(true))
        );
        rooms.push(p.body["bootstrap_room"].clone());
    }
    assert_ne!(rooms[0], rooms[1], "one room per request");

    stack.all_freed().await;
    for routed in stack.router.routed() {
        let events = stack.router.events(&routed.request_id);
        // The prefill answer and the first token race: remote_prefill_done is sent
        // only when the prefill answer came first.
        let expected: &[_] = match events.len() {
            3 => &[RemotePrefillDone, PrefillDone, Freed],
            _ => &[PrefillDone, Freed],
        };
        assert_eq!(events, expected, "{}", routed.request_id);
    }
    assert_eq!(stack.metrics().remote_prefills("sglang"), 2);
    stack.stop().await;
}

/// Prefill workers 11.. fail as `bad` says, in order; the last one serves.
async fn prefill_failover(protocol: TransferProtocol, bad: &[Behaviour], killed: bool) {
    let mut fleet: Vec<Member> = (11..)
        .zip(bad)
        .map(|(w, b)| (w, WorkerRole::Prefill, *b))
        .collect();
    let mut next = 11 + bad.len() as u64;
    let killed_worker = killed.then(|| {
        fleet.push((next, WorkerRole::Prefill, SERVE));
        next += 1;
        next - 1
    });
    let good = next;
    fleet.extend([
        (good, WorkerRole::Prefill, SERVE),
        (21, WorkerRole::Decode, SERVE),
    ]);
    let retries = (bad.len() + usize::from(killed)).to_string();
    let flags = [
        "--max-retries",
        &retries,
        "--first-token-timeout-ms",
        "1000",
    ];
    let stack = PdStack::start(protocol, &fleet, Duration::ZERO, &flags).await;
    if let Some(worker) = killed_worker {
        stack.engine(worker).kill();
    }
    let answer = stack.complete(&prompt(300), true, 2).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert!(!answer.text.contains("error"), "{}", answer.text);
    assert_eq!(answer.prefill, Some(good.to_string()));
    assert_eq!(answer.worker.as_deref(), Some("21"));

    let routed = stack.router.routed();
    let excluded = stack.router.excluded();
    let expected: Vec<Vec<u64>> = (11..=good).map(|last| (11..last).collect()).collect();
    assert_eq!(
        excluded, expected,
        "each failed prefill worker excluded in turn"
    );
    stack.all_freed().await;
    let (last, failed) = routed.split_last().unwrap();
    for request in failed {
        assert_eq!(stack.router.events(&request.request_id), [Freed]);
    }
    let events = stack.router.events(&last.request_id);
    assert_eq!(events.last(), Some(&Freed));
    assert!(events.contains(&PrefillDone), "{events:?}");
    let retried: u64 = ["connect", "engine_error", "first_token_timeout"]
        .iter()
        .map(|reason| stack.metrics().half_retries("prefill", reason))
        .sum();
    assert_eq!(retried, good - 11);
    if protocol == TransferProtocol::Vllm {
        let decoded = stack.engine(21).received();
        assert_eq!(
            decoded.len(),
            1,
            "no failed prefill reached the decode worker"
        );
        assert_params_forwarded(stack.engine(good), stack.engine(21));
    }
    stack.stop().await;
}

#[tokio::test]
async fn a_vllm_prefill_worker_that_fails_before_its_answer_is_excluded_and_the_request_routed_again()
 {
    let bad = [Behaviour::NoParams, Behaviour::Fail, Behaviour::Hang];
    prefill_failover(TransferProtocol::Vllm, &bad, true).await;
}

#[tokio::test]
async fn an_sglang_prefill_worker_that_fails_is_excluded_and_the_request_routed_again() {
    prefill_failover(TransferProtocol::Sglang, &[Behaviour::Fail], true).await;
}

/// Decode worker 21 fails with 500, 22 is killed, 23 serves.
async fn decode_failover(protocol: TransferProtocol) {
    let fleet = [
        (11, WorkerRole::Prefill, SERVE),
        (21, WorkerRole::Decode, Behaviour::Fail),
        (22, WorkerRole::Decode, SERVE),
        (23, WorkerRole::Decode, SERVE),
    ];
    let stack = PdStack::start(protocol, &fleet, Duration::ZERO, &[]).await;
    stack.engine(22).kill();
    let answer = stack.complete(&prompt(400), false, 2).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert_eq!(answer.worker.as_deref(), Some("23"));
    let routed = stack.router.routed();
    let excluded = stack.router.excluded();
    assert_eq!(excluded, [vec![], vec![21], vec![21, 22]]);
    let metrics = stack.metrics();
    assert_eq!(metrics.half_retries("decode", "engine_error"), 1);
    assert_eq!(metrics.half_retries("decode", "connect"), 1);
    assert_eq!(
        metrics.retries("engine_error") + metrics.retries("connect"),
        2
    );
    stack.all_freed().await;
    if protocol == TransferProtocol::Vllm {
        // The prefill is run again for each decode worker (SGLang's may be cut
        // before it is sent, when the decode worker refuses at once).
        assert_eq!(stack.engine(11).received().len(), 3);
        let (first, last) = (&routed[0].request_id, &routed[2].request_id);
        assert_eq!(stack.router.events(first), [RemotePrefillDone, Freed]);
        assert_eq!(
            stack.router.events(last),
            [RemotePrefillDone, PrefillDone, Freed]
        );
        for decode in [21, 23] {
            let decoded = assert_params_forwarded(stack.engine(11), stack.engine(decode));
            assert_eq!(decoded, 1, "worker {decode}");
        }
    }
    stack.stop().await;
}

#[tokio::test]
async fn a_vllm_decode_worker_that_fails_before_its_first_token_is_excluded_and_the_prefill_rerun()
{
    decode_failover(TransferProtocol::Vllm).await;
}

#[tokio::test]
async fn an_sglang_decode_worker_that_fails_before_its_first_token_is_excluded() {
    decode_failover(TransferProtocol::Sglang).await;
}

#[tokio::test]
async fn both_halves_are_freed_when_clients_go_away() {
    // Mid-stream: three clients read their first token and leave.
    let fleet = PAIR;
    let pause = Duration::from_millis(100);
    let stack = PdStack::start(TransferProtocol::Vllm, &fleet, pause, &[]).await;
    let mut streams = Vec::new();
    for i in 0..3 {
        let body = json!({"model": MODEL, "prompt": prompt(500 + i * 100), "max_tokens": 500, "stream": true});
        let response = stack
            .http
            .post(format!("{}/v1/completions", stack.base))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let mut chunks = response.bytes_stream();
        chunks.next().await.unwrap().unwrap();
        streams.push(chunks);
    }
    assert_eq!(stack.router.booked(), 3);
    drop(streams);
    stack.all_freed().await;
    for routed in stack.router.routed() {
        let events = stack.router.events(&routed.request_id);
        assert_eq!(events, [RemotePrefillDone, PrefillDone, Freed]);
    }
    stack.stop().await;

    // Before anything: the client gives up while the prefill worker hangs.
    let fleet = [
        (11, WorkerRole::Prefill, Behaviour::Hang),
        (21, WorkerRole::Decode, SERVE),
    ];
    let stack = PdStack::start(TransferProtocol::Sglang, &fleet, Duration::ZERO, &[]).await;
    let body = json!({"model": MODEL, "prompt": prompt(900), "max_tokens": 2});
    let request = stack
        .http
        .post(format!("{}/v1/completions", stack.base))
        .header("content-type", "application/json")
        .body(body.to_string())
        .timeout(Duration::from_millis(500))
        .send()
        .await;
    assert!(request.is_err(), "the client gave up");
    stack.all_freed().await;
    let routed = stack.router.routed();
    assert_eq!(routed.len(), 1);
    assert_eq!(stack.router.events(&routed[0].request_id), [Freed]);
    stack.stop().await;
}

#[tokio::test]
async fn with_disaggregation_turned_off_requests_run_whole_on_one_worker() {
    let fleet = PAIR;
    let flags = ["--disaggregation", "false"];
    let stack = PdStack::start(TransferProtocol::Vllm, &fleet, Duration::ZERO, &flags).await;
    let answer = stack.complete(&prompt(600), true, 2).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    assert_eq!((answer.prefill, answer.decision), (None, None));
    assert!(stack.engine(11).received().is_empty());
    let decoded = stack.engine(21).received();
    assert!(decoded[0].body.get("kv_transfer_params").is_none());
    let routed = stack.router.routed();
    assert!(!routed[0].allow_disaggregation);
    stack.all_freed().await;
    assert_eq!(
        stack.router.events(&routed[0].request_id),
        [PrefillDone, Freed]
    );
    assert_eq!(stack.metrics().routed_count("aggregated"), 1);
    stack.stop().await;
}
