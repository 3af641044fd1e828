//! One ext_proc stream: one HTTP request as the proxy sees it. The proxy sends the
//! request headers, then the body in chunks, and waits for nothing until the picker
//! answers the headers (`FULL_DUPLEX_STREAMED`, the protocol's body mode, or
//! `STREAMED` sending the body without waiting: `body_mode`). The picker
//! buffers the body (up to `--max-body-bytes`, else 413), and at its last chunk
//! tokenizes and routes it, answers the headers with the pick and passes the body on
//! unchanged as the body mode asks; or answers the whole request itself
//! (`ImmediateResponse`: 400, 413, 429, 500, 503, 504). The response then passes through:
//! the first response body chunk is the first token (`prefill_done`), and the stream
//! ending on any path — response end, the proxy closing or dropping the stream, an
//! error, a deadline — drops the [`kv_gateway::router::Booking`], which sends `freed`.
//!
//! Every wait is bounded: the proxy's next message while the body is incomplete by
//! `--body-timeout-ms`, the whole stream by the gateway's `--request-timeout-s`, and
//! each answer sent by the same stream deadline.

use crate::body_mode::Modes;
use crate::config::StreamLimits;
use crate::metrics::EppMetrics;
use crate::pick::{self, Pick};
use crate::wire;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    ProcessingRequest, ProcessingResponse, processing_request::Request,
};
use kv_events::DpRank;
use kv_gateway::error::ApiError;
use kv_gateway::flow::{BodyKind, Flow};
use kv_gateway::forward::DP_RANK_HEADER;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout_at};
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status, Streaming};
use tracing::{debug, warn};

/// Answers queued per stream before the picker waits for the proxy to read them.
const ANSWER_QUEUE: usize = 4;

/// The ext_proc service: one task per stream.
#[derive(Clone)]
pub struct Picker {
    flow: Arc<Flow>,
    limits: StreamLimits,
    fallbacks: u8,
    metrics: EppMetrics,
}

impl Picker {
    /// A picker tokenizing and routing with `flow`, bounded by `limits`, naming up
    /// to `fallbacks` alternates after each pick.
    pub fn new(flow: Flow, limits: StreamLimits, fallbacks: u8, metrics: EppMetrics) -> Self {
        Self {
            flow: Arc::new(flow),
            limits,
            fallbacks,
            metrics,
        }
    }
}

type Answers = Pin<Box<dyn futures::Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: GrpcRequest<Streaming<ProcessingRequest>>,
    ) -> Result<GrpcResponse<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, mut rx) = mpsc::channel(ANSWER_QUEUE);
        let stream = Stream {
            picker: self.clone(),
            tx,
            deadline: Instant::now() + self.limits.stream_timeout,
            modes: Modes::default(),
        };
        tokio::spawn(stream.run(inbound));
        let answers = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
        Ok(GrpcResponse::new(Box::pin(answers)))
    }
}

/// Where a stream is.
enum Phase {
    /// Waiting for the request headers.
    Start,
    /// Reading the request body.
    Body {
        kind: Option<BodyKind>,
        headers: axum::http::HeaderMap,
        subset: Option<Vec<String>>,
        body: Vec<u8>,
        /// Body messages received (a per-chunk mode answers each).
        chunks: usize,
    },
    /// Picked: the response passes through.
    Picked { pick: Box<Pick>, first_chunk: bool },
    /// Answered by an immediate response, or over.
    Done,
}

struct Stream {
    picker: Picker,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    deadline: Instant,
    /// The body modes, from the proxy's first message.
    modes: Modes,
}

impl Stream {
    async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        let metrics = self.picker.metrics.clone();
        metrics.stream_open(1);
        let mut phase = Phase::Start;
        loop {
            let reading_body = matches!(phase, Phase::Start | Phase::Body { .. });
            let wait = if reading_body {
                self.deadline
                    .min(Instant::now() + self.picker.limits.body_timeout)
            } else {
                self.deadline
            };
            let message = match timeout_at(wait, inbound.message()).await {
                Ok(Ok(Some(message))) => message,
                // The proxy closed the stream (request over) or dropped it.
                Ok(Ok(None)) => break,
                Ok(Err(e)) => {
                    debug!(error = %e, "ext_proc stream ended");
                    break;
                }
                Err(_) => {
                    if reading_body {
                        let error =
                            ApiError::body_too_slow("the request body did not arrive in time");
                        let _ = self.send(wire::immediate(&error)).await;
                    }
                    debug!("ext_proc stream deadline");
                    break;
                }
            };
            if matches!(phase, Phase::Start) {
                match Modes::of(message.protocol_config.as_ref()) {
                    Ok(modes) => self.modes = modes,
                    Err(e) => {
                        warn!(error = %e.message, "unsupported ext_proc body mode");
                        let _ = self.refuse(&e, Instant::now()).await;
                        break;
                    }
                }
            }
            // A failed step dropped its phase (and booking) already.
            match self.step(phase, message).await {
                Ok(next) => phase = next,
                Err(()) => {
                    phase = Phase::Done;
                    break;
                }
            }
        }
        // Dropping the phase drops any booking: `freed` on every path.
        drop(phase);
        metrics.stream_open(-1);
    }

    /// Sends an answer within the stream's deadline; `Err` when the proxy is gone.
    async fn send(&self, answer: ProcessingResponse) -> Result<(), ()> {
        match timeout_at(self.deadline, self.tx.send(Ok(answer))).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(()),
        }
    }

    async fn step(&self, phase: Phase, message: ProcessingRequest) -> Result<Phase, ()> {
        // The metadata is read only by the messages that carry what the picker needs
        // (the subset hint, the served endpoint), not once per body chunk.
        let ProcessingRequest {
            request,
            metadata_context: metadata,
            ..
        } = message;
        let Some(request) = request else {
            return Ok(phase);
        };
        match (phase, request) {
            (Phase::Start, Request::RequestHeaders(h)) => {
                let headers = match wire::header_map(&h) {
                    Ok(headers) => headers,
                    Err(e) => return self.refuse(&e, Instant::now()).await,
                };
                let kind = wire::pseudo_header(&h, ":path").and_then(body_kind);
                if h.end_of_stream {
                    let e = ApiError::bad_request("an inference request needs a JSON body");
                    return self.refuse(&e, Instant::now()).await;
                }
                if self.modes.headers_first() {
                    self.send(wire::request_headers()).await?;
                }
                Ok(Phase::Body {
                    kind,
                    headers,
                    subset: wire::subset_hint(metadata.as_ref()),
                    body: Vec::new(),
                    chunks: 0,
                })
            }
            (
                Phase::Body {
                    kind,
                    headers,
                    subset,
                    mut body,
                    chunks,
                },
                Request::RequestBody(chunk),
            ) => {
                let max = self.picker.limits.max_body_bytes;
                if body.len() + chunk.body.len() > max {
                    return self.refuse(&ApiError::too_large(max), Instant::now()).await;
                }
                body.extend_from_slice(&chunk.body);
                let chunks = chunks + 1;
                if !chunk.end_of_stream {
                    return Ok(Phase::Body {
                        kind,
                        headers,
                        subset,
                        body,
                        chunks,
                    });
                }
                self.pick(kind, &headers, subset, (body, chunks)).await
            }
            (phase @ Phase::Picked { .. }, Request::RequestTrailers(_)) => {
                self.send(wire::trailers(false)).await?;
                Ok(phase)
            }
            (
                Phase::Picked {
                    mut pick,
                    first_chunk,
                },
                Request::ResponseHeaders(h),
            ) => {
                let served =
                    wire::served_metadata(metadata.as_ref()).or_else(|| wire::served_header(&h));
                // Answer the proxy first; a booking move runs on its own.
                self.send(wire::response_headers()).await?;
                let flow = &self.picker.flow;
                pick.served(served, &flow.workers, &flow.router, &self.picker.metrics);
                if h.end_of_stream {
                    pick.held.free();
                    return Ok(Phase::Done);
                }
                Ok(Phase::Picked { pick, first_chunk })
            }
            (Phase::Picked { pick, first_chunk }, Request::ResponseBody(chunk)) => {
                if first_chunk {
                    pick.held.prefill_done();
                }
                let end = chunk.end_of_stream;
                self.send(self.modes.response_body(chunk.body, end)).await?;
                if end {
                    pick.held.free();
                    return Ok(Phase::Done);
                }
                Ok(Phase::Picked {
                    pick,
                    first_chunk: false,
                })
            }
            (Phase::Picked { pick, .. }, Request::ResponseTrailers(_)) => {
                pick.held.free();
                self.send(wire::trailers(true)).await?;
                Ok(Phase::Done)
            }
            (Phase::Done, Request::ResponseHeaders(_)) => {
                self.send(wire::response_headers()).await?;
                Ok(Phase::Done)
            }
            (Phase::Done, Request::ResponseBody(chunk)) => {
                let end = chunk.end_of_stream;
                self.send(self.modes.response_body(chunk.body, end)).await?;
                Ok(Phase::Done)
            }
            (Phase::Done, Request::ResponseTrailers(_)) => {
                self.send(wire::trailers(true)).await?;
                Ok(Phase::Done)
            }
            (_, other) => {
                warn!(message = ?std::mem::discriminant(&other), "ext_proc message out of order");
                Err(())
            }
        }
    }

    /// Answers the request with `error` (the proxy replies to the client itself).
    async fn refuse(&self, error: &ApiError, started: Instant) -> Result<Phase, ()> {
        self.picker
            .metrics
            .picked(error.status.as_str(), started.elapsed());
        self.send(wire::immediate(error)).await?;
        Ok(Phase::Done)
    }

    /// Tokenizes and routes the whole body (received in `chunks` messages); answers
    /// the headers with the pick and passes the body on.
    async fn pick(
        &self,
        kind: Option<BodyKind>,
        headers: &axum::http::HeaderMap,
        subset: Option<Vec<String>>,
        (body, chunks): (Vec<u8>, usize),
    ) -> Result<Phase, ()> {
        let started = Instant::now();
        let flow = &self.picker.flow;
        let fallbacks = self.picker.fallbacks;
        let choose = pick::choose(flow, fallbacks, kind, headers, subset.as_deref(), &body);
        let pick = match timeout_at(self.deadline, choose).await {
            Ok(Ok(pick)) => pick,
            Ok(Err(e)) => return self.refuse(&e, started).await,
            Err(_) => {
                let e = ApiError::timeout("no pick within the request timeout");
                return self.refuse(&e, started).await;
            }
        };
        let extra: Vec<(&str, String)> = if pick.dp_rank == DpRank(0) {
            Vec::new()
        } else {
            vec![(DP_RANK_HEADER, pick.dp_rank.0.to_string())]
        };
        self.picker.metrics.picked("picked", started.elapsed());
        let named = (&pick.endpoints[..], &extra[..]);
        for answer in self.modes.pick_answers(named, body, chunks) {
            self.send(answer).await?;
        }
        Ok(Phase::Picked {
            pick: Box::new(pick),
            first_chunk: true,
        })
    }
}

/// The OpenAI endpoint of a request, from its `:path` (query string ignored).
fn body_kind(path: &str) -> Option<BodyKind> {
    match path.split('?').next()? {
        "/v1/completions" => Some(BodyKind::Completion),
        "/v1/chat/completions" => Some(BodyKind::Chat),
        _ => None,
    }
}
