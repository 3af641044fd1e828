//! The two halves of a disaggregated request: the prompt is prefilled on the prefill
//! worker the router named (`disaggregation.prefill`), its KV is transferred to the
//! routed (decode) worker, and the decode worker's answer is the client's — streamed
//! or assembled exactly as a whole request's ([`crate::answer`]).
//!
//! How the halves are joined is the prefill worker's registered
//! `kv_transfer.protocol` (both workers of a pair share it):
//!
//! - **vLLM** (its KV connectors: NIXL, Mooncake, …), two steps, as vLLM's own proxy
//!   does: the prefill worker gets the request not streamed, for one token, with
//!   `kv_transfer_params: {"do_remote_decode": true, …}`; the `kv_transfer_params`
//!   object of its answer then goes, unchanged, with the client's request to the
//!   decode worker. TTFT is the prefill's round trip plus the decode's first token.
//! - **SGLang**, one step: the request goes to both workers at once, each with
//!   `bootstrap_host` (the host of the prefill worker's URL), `bootstrap_port` (its
//!   registered one) and a random `bootstrap_room`; the decode worker waits for the
//!   prefill worker of that room. The prefill answer is read to its end and
//!   discarded — in the background once the decode worker's first token has come,
//!   so it never delays the client.
//!
//! The prefill half is bounded like a first token: its answer must be whole within
//! `--first-token-timeout-ms` of its sending (and the request's deadline), and at most
//! [`crate::forward::MAX_PREFILL_ANSWER_BYTES`]. The lifecycle names the request id
//! only; the router applies it to both halves: `remote_prefill_done` when the prefill
//! answer is whole (before the decode's first token), `prefill_done` at the decode
//! worker's first token (the transfer is over), and `freed` on every path, from the
//! attempt's one [`Booking`].
//!
//! **Failover.** A prefill half that fails before its answer (refused, 5xx, late,
//! too long, or without `kv_transfer_params`) excludes the prefill worker from the next
//! route; a decode half that fails before its first token excludes the decode worker.
//! Either way the whole attempt's booking is freed and the request routed again,
//! within `--max-retries`. After a decode failure the prefill is run again rather than
//! its transfer reused: the transfer parameters name blocks the first decode worker
//! may already have pulled or the prefill worker released, and the re-run prefill
//! finds the prompt in the prefix cache of the prefill worker that computed it (the
//! router sees those blocks stored), so it costs a cache hit rather than a prefill.

use super::{Failed, Flow, Plan};
use crate::answer::answer_usage;
use crate::forward::{AttemptFailure, EngineCall, Events};
use crate::openai::{Bootstrap, EngineTarget, Step};
use crate::parity::Pending;
use crate::router::Booking;
use eventsource_stream::Event;
use futures::FutureExt as _;
use futures::future::FusedFuture as _;
use kv_events::disaggregation::{PrefillPlacement, TransferProtocol};
use kv_events::routing::RouteDecision;
use kv_events::{DpRank, RequestId, WorkerId};
use serde_json::{Map, Value};
use tokio::time::Instant;

/// The half of a disaggregated request that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Half {
    /// The prefill worker's request.
    Prefill,
    /// The decode worker's request.
    Decode,
}

impl Half {
    /// The metric label.
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Half::Prefill => "prefill",
            Half::Decode => "decode",
        }
    }
}

/// One worker of the pair.
struct Side {
    worker: WorkerId,
    url: String,
    dp_rank: DpRank,
}

/// One disaggregated attempt of a request.
struct Pair<'a> {
    flow: &'a Flow,
    plan: &'a Plan,
    request_id: RequestId,
    prefill: Side,
    decode: Side,
    deadline: Instant,
}

type HalfResult<T> = Result<T, (Half, AttemptFailure)>;

impl Flow {
    /// Runs the prefill half of `plan` on `prefill` and opens its decode half on the
    /// routed worker: the decode worker's first event, the rest of its stream, and
    /// its URL. Sends `remote_prefill_done` on `booking` when the prefill answer is
    /// whole before the decode's first token.
    ///
    /// # Errors
    /// [`Failed`] naming the half, and the worker, that failed.
    pub(super) async fn open_halves(
        &self,
        plan: &Plan,
        decision: &RouteDecision,
        prefill: PrefillPlacement,
        booking: &mut Booking,
        deadline: Instant,
    ) -> Result<(Event, Events, String), Failed> {
        let failed = |half, failure| Failed {
            worker: match half {
                Half::Prefill => prefill.worker_id,
                Half::Decode => decision.worker_id,
            },
            half: Some(half),
            failure,
        };
        let no_url = |worker: WorkerId| AttemptFailure::Retry {
            reason: "no_url",
            detail: format!("worker {worker} registered no engine url"),
        };
        let Some(decode_url) = self.workers.url(decision.worker_id) else {
            return Err(failed(Half::Decode, no_url(decision.worker_id)));
        };
        let Some(endpoint) = self.workers.endpoint(prefill.worker_id) else {
            return Err(failed(Half::Prefill, no_url(prefill.worker_id)));
        };
        let no_transfer = |detail: String| {
            let failure = AttemptFailure::Retry {
                reason: "no_transfer",
                detail: format!("prefill worker {} {detail}", prefill.worker_id),
            };
            failed(Half::Prefill, failure)
        };
        let Some(transfer) = endpoint.kv_transfer else {
            return Err(no_transfer("registered no kv_transfer".into()));
        };
        let pair = Pair {
            flow: self,
            plan,
            request_id: booking.request_id().clone(),
            prefill: Side {
                worker: prefill.worker_id,
                url: endpoint.url,
                dp_rank: prefill.dp_rank,
            },
            decode: Side {
                worker: decision.worker_id,
                url: decode_url,
                dp_rank: decision.dp_rank,
            },
            deadline,
        };
        // The prefill worker computes the prompt: its answer's cached tokens are judged.
        let parity = (self.parity).pending(
            prefill.worker_id,
            prefill.overlap_blocks,
            0,
            plan.tokens.len(),
        );
        let opened = match transfer.protocol {
            TransferProtocol::Vllm => pair.vllm(booking, parity).await,
            TransferProtocol::Sglang => {
                let Some(port) = transfer.bootstrap_port else {
                    return Err(no_transfer(
                        "registered sglang with no bootstrap_port".into(),
                    ));
                };
                let Some(host) = url_host(&pair.prefill.url) else {
                    return Err(no_transfer(format!(
                        "has no host in its url {}",
                        pair.prefill.url
                    )));
                };
                let bootstrap = Bootstrap {
                    host,
                    port,
                    // 0..2^63, as SGLang's own router draws it.
                    room: rand::random::<u64>() >> 1,
                };
                pair.sglang(booking, &bootstrap, parity).await
            }
        };
        match opened {
            Ok((first, events)) => Ok((first, events, pair.decode.url)),
            Err((half, failure)) => Err(failed(half, failure)),
        }
    }
}

impl Pair<'_> {
    /// The body for `side` at `step`.
    fn body(&self, side: &Side, step: Step<'_>) -> Result<Map<String, Value>, AttemptFailure> {
        let target = EngineTarget {
            api: self.flow.model.engine_api,
            dp_rank: side.dp_rank,
            step,
        };
        self.plan
            .request
            .body(&self.plan.tokens, target)
            .map_err(AttemptFailure::Final)
    }

    fn call<'a>(&'a self, side: &'a Side, body: &'a Map<String, Value>) -> EngineCall<'a> {
        EngineCall {
            url: &side.url,
            path: self.plan.request.path(),
            body,
            dp_rank: side.dp_rank,
            request_id: &self.request_id,
        }
    }

    /// vLLM's two steps: the prefill worker's answer (judged by `parity`), then the
    /// decode worker's first token.
    async fn vllm(
        &self,
        booking: &mut Booking,
        parity: Option<Pending>,
    ) -> HalfResult<(Event, Events)> {
        let flow = self.flow;
        let prefill = |failure| (Half::Prefill, failure);
        let body = self
            .body(&self.prefill, Step::VllmPrefill)
            .map_err(prefill)?;
        let sent = Instant::now();
        let answer = flow
            .engine
            .prefill(
                self.call(&self.prefill, &body),
                flow.first_token(sent, self.deadline),
            )
            .await
            .map_err(prefill)?;
        let params = transfer_params(&answer).map_err(|why| {
            prefill(AttemptFailure::Retry {
                reason: "engine_error",
                detail: format!(
                    "{} (worker {}) {why}",
                    self.prefill.url, self.prefill.worker
                ),
            })
        })?;
        flow.metrics
            .remote_prefill(TransferProtocol::Vllm.as_str(), sent.elapsed());
        if let Some(parity) = parity {
            parity.judge(answer_usage(&answer));
        }
        booking.remote_prefill_done();
        let decode = |failure| (Half::Decode, failure);
        let body = self
            .body(&self.decode, Step::VllmDecode(&params))
            .map_err(decode)?;
        flow.engine
            .open(
                self.call(&self.decode, &body),
                flow.first_token(Instant::now(), self.deadline),
            )
            .await
            .map_err(decode)
    }

    /// SGLang's one step: both requests at once; the decode worker's first token,
    /// once the prefill worker has not failed first. The prefill answer is judged by
    /// `parity`.
    async fn sglang(
        &self,
        booking: &mut Booking,
        bootstrap: &Bootstrap,
        parity: Option<Pending>,
    ) -> HalfResult<(Event, Events)> {
        let flow = self.flow;
        let as_prefill = |failure| (Half::Prefill, failure);
        let prefill_body = self
            .body(&self.prefill, Step::SglangPrefill(bootstrap))
            .map_err(as_prefill)?;
        let decode_body = self
            .body(&self.decode, Step::SglangDecode(bootstrap))
            .map_err(|failure| (Half::Decode, failure))?;
        let sent = Instant::now();
        let first_token = flow.first_token(sent, self.deadline);
        // The prefill request owns what it needs, so it can outlive this wait (below).
        let mut prefill = {
            let (engine, metrics) = (flow.engine.clone(), flow.metrics.clone());
            let (url, request_id) = (self.prefill.url.clone(), self.request_id.clone());
            let (path, dp_rank) = (self.plan.request.path(), self.prefill.dp_rank);
            async move {
                let call = EngineCall {
                    url: &url,
                    path,
                    body: &prefill_body,
                    dp_rank,
                    request_id: &request_id,
                };
                let answer = engine.prefill(call, first_token).await;
                if let Ok(answer) = &answer {
                    metrics.remote_prefill(TransferProtocol::Sglang.as_str(), sent.elapsed());
                    if let Some(parity) = parity {
                        parity.judge(answer_usage(answer));
                    }
                }
                answer.map(drop)
            }
            .boxed()
            // Polled no more once it has answered (below).
            .fuse()
        };
        let decode = flow
            .engine
            .open(self.call(&self.decode, &decode_body), first_token);
        tokio::pin!(decode);
        loop {
            tokio::select! {
                // A prefill answer and a first token ready together: the lifecycle
                // says remote_prefill_done before prefill_done.
                biased;
                answer = &mut prefill, if !prefill.is_terminated() => match answer {
                    Ok(()) => booking.remote_prefill_done(),
                    Err(failure) => return Err(as_prefill(failure)),
                },
                opened = &mut decode => {
                    return match opened {
                        Ok(first) => {
                            if !prefill.is_terminated() {
                                // Read to its end (bounded by its deadline), so the
                                // prefill worker sees its request complete, not cut.
                                tokio::spawn(prefill);
                            }
                            Ok(first)
                        }
                        // A decode worker that gives up on a prefill worker which
                        // has failed too: the prefill worker is to blame. (An
                        // answered prefill is not polled again: it stays pending.)
                        Err(failure) => Err(match prefill.now_or_never() {
                            Some(Err(prefill_failure)) => as_prefill(prefill_failure),
                            _ => (Half::Decode, failure),
                        }),
                    };
                }
            }
        }
    }
}

/// The host of `url` (an IPv6 address without its brackets), for `bootstrap_host`.
fn url_host(url: &str) -> Option<String> {
    let url = reqwest::Url::parse(url).ok()?;
    let host = url.host_str()?;
    Some(
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned(),
    )
}

/// The `kv_transfer_params` object of a vLLM prefill worker's answer, to forward
/// unchanged to the decode worker.
///
/// # Errors
/// Why the answer cannot be used: not a JSON object, an error, or no
/// `kv_transfer_params` object (the worker's KV connector is not a producer).
fn transfer_params(answer: &[u8]) -> Result<Map<String, Value>, String> {
    let mut answer: Map<String, Value> = serde_json::from_slice(answer)
        .map_err(|e| format!("answered its prefill with no JSON object: {e}"))?;
    if let Some(error) = answer.get("error") {
        return Err(format!("answered its prefill with an error: {error}"));
    }
    match answer.remove("kv_transfer_params") {
        Some(Value::Object(params)) => Ok(params),
        None | Some(Value::Null) => Err(
            "answered its prefill without kv_transfer_params (is its KV connector a kv_producer?)"
                .into(),
        ),
        Some(other) => Err(format!(
            "answered its prefill with kv_transfer_params that are not an object: {other}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_prefill_answers_transfer_params_are_taken_whole_and_unchanged() {
        let params = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [3, 4, 5], "remote_engine_id": "e-1",
            "remote_host": "10.0.0.2", "remote_port": 5600, "tp_size": 1,
            "a_future_field": {"kept": true}});
        let answer = json!({"id": "cmpl-1", "object": "text_completion",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 1},
            "kv_transfer_params": params});
        let taken = transfer_params(answer.to_string().as_bytes()).unwrap();
        assert_eq!(Value::Object(taken), params);
    }

    #[test]
    fn a_prefill_answer_without_usable_params_is_refused_with_the_reason() {
        for (answer, why) in [
            (&b"<html>"[..], "no JSON object"),
            (b"[1, 2]", "no JSON object"),
            (br#"{"choices": []}"#, "without kv_transfer_params"),
            (
                br#"{"kv_transfer_params": null}"#,
                "without kv_transfer_params",
            ),
            (br#"{"kv_transfer_params": [1]}"#, "not an object"),
            (br#"{"error": {"message": "boom"}}"#, "boom"),
        ] {
            let found = transfer_params(answer).unwrap_err();
            assert!(
                found.contains(why),
                "{}: {found}",
                String::from_utf8_lossy(answer)
            );
        }
    }

    #[test]
    fn the_bootstrap_host_is_the_prefill_workers_url_host() {
        assert_eq!(
            url_host("http://10.0.0.7:30000").as_deref(),
            Some("10.0.0.7")
        );
        assert_eq!(
            url_host("http://prefill-0.svc:8000/").as_deref(),
            Some("prefill-0.svc")
        );
        assert_eq!(
            url_host("http://[fd00::7]:8000").as_deref(),
            Some("fd00::7")
        );
        assert_eq!(url_host("not a url"), None);
    }
}
