//! Envoy's half of an ext_proc stream, from Envoy's own API definitions (the
//! `envoy-types` crate, generated from envoyproxy/data-plane-api): request headers
//! with the subset hint, the body in streamed chunks, then the response headers with
//! the served endpoint and the response body.
//!
//! Two body modes, as Envoy's ext_proc filter runs them: `FULL_DUPLEX_STREAMED` (the
//! processor hands the body back in `streamed_response`s) and `STREAMED` with
//! `send_body_without_waiting_for_header_response` (announced in the first message's
//! `protocol_config`; Envoy queues each chunk it sent and releases it upstream only on
//! that chunk's own answer, in order, applying the answer's body mutation to it).

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, CommonResponse, HttpBody, HttpHeaders, ImmediateResponse, ProcessingRequest,
    ProcessingResponse, ProtocolConfiguration, body_mutation,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(15);

/// The filter's body mode, both ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `FULL_DUPLEX_STREAMED`, with no `protocol_config` (as older Envoys send it).
    FullDuplex,
    /// `STREAMED` with `send_body_without_waiting_for_header_response: true`.
    Streamed,
    /// `STREAMED` alone: Envoy holds the body until the headers are answered.
    StreamedWaiting,
    /// `BUFFERED`: the body, whole in one message, after the headers' answer; the
    /// headers held until the body is answered too.
    Buffered,
}

impl Mode {
    fn protocol_config(self) -> Option<ProtocolConfiguration> {
        let streamed = |without_waiting| ProtocolConfiguration {
            request_body_mode: BodySendMode::Streamed as i32,
            response_body_mode: BodySendMode::Streamed as i32,
            send_body_without_waiting_for_header_response: without_waiting,
        };
        match self {
            Self::FullDuplex => None,
            Self::Streamed => Some(streamed(true)),
            Self::StreamedWaiting => Some(streamed(false)),
            Self::Buffered => Some(ProtocolConfiguration {
                request_body_mode: BodySendMode::Buffered as i32,
                response_body_mode: BodySendMode::Buffered as i32,
                send_body_without_waiting_for_header_response: false,
            }),
        }
    }
}

/// One stream, as Envoy drives it.
pub struct Envoy {
    tx: mpsc::Sender<ProcessingRequest>,
    inbound: tonic::Streaming<ProcessingResponse>,
    mode: Mode,
    /// Request body chunks sent and not yet answered (`STREAMED`: Envoy's queue).
    queued: Vec<Vec<u8>>,
    /// `BUFFERED`: a refusal that answered the headers, read before any body was sent.
    refused: Option<ImmediateResponse>,
}

/// What the picker answered to the request.
#[derive(Debug)]
pub enum Picked {
    /// The endpoint: the header, the `envoy.lb` metadata, the dp-rank header, and the
    /// request body as echoed.
    Endpoint {
        header: String,
        metadata: String,
        dp_rank: Option<String>,
        body: Vec<u8>,
    },
    /// An immediate response: status and body.
    Refused { status: i32, body: String },
}

fn header(key: &str, value: &str) -> HeaderValue {
    HeaderValue {
        key: key.into(),
        raw_value: value.as_bytes().to_vec(),
        ..Default::default()
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

impl Envoy {
    /// Opens a stream to the picker at `addr` in body mode `mode` and sends the
    /// request headers of a POST to `path`, with the subset hint `subset` when given.
    pub async fn open(addr: SocketAddr, mode: Mode, path: &str, subset: Option<&[String]>) -> Self {
        let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
            .await
            .expect("the picker accepts gRPC");
        let (tx, mut rx) = mpsc::channel(16);
        let outbound = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
        let inbound = client
            .process(outbound)
            .await
            .expect("the picker opens the stream")
            .into_inner();
        let metadata = subset.map(|subset| {
            let list = Value {
                kind: Some(Kind::ListValue(ListValue {
                    values: subset.iter().map(|s| string(s)).collect(),
                })),
            };
            let hint = Struct {
                fields: [("x-gateway-destination-endpoint-subset".to_owned(), list)]
                    .into_iter()
                    .collect(),
            };
            Metadata {
                filter_metadata: [("envoy.lb.subset_hint".to_owned(), hint)]
                    .into_iter()
                    .collect(),
                ..Default::default()
            }
        });
        let envoy = Self {
            tx,
            inbound,
            mode,
            queued: Vec::new(),
            refused: None,
        };
        let headers = HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    header(":method", "POST"),
                    header(":path", path),
                    header(":authority", "inference.example"),
                    header("content-type", "application/json"),
                ],
            }),
            end_of_stream: false,
            ..Default::default()
        };
        envoy
            .send(ProcessingRequest {
                metadata_context: metadata,
                request: Some(Message::RequestHeaders(headers)),
                protocol_config: mode.protocol_config(),
                ..Default::default()
            })
            .await;
        envoy
    }

    async fn send(&self, message: ProcessingRequest) {
        self.tx.send(message).await.expect("the stream is open");
    }

    /// Sends `body` in `chunks` pieces, the last with end_of_stream (`BUFFERED`: once
    /// the headers are answered, in one piece).
    pub async fn body(&mut self, body: &[u8], chunks: usize) {
        if self.mode == Mode::Buffered {
            match self.message().await.response {
                Some(Answer::RequestHeaders(h)) => {
                    assert_eq!(
                        h.response, None,
                        "the headers pass unchanged before the body"
                    );
                }
                // Refused on the headers alone (the picker then closes the stream).
                Some(Answer::ImmediateResponse(refused)) => {
                    self.refused = Some(refused);
                    return;
                }
                other => panic!("the headers are answered first: {other:?}"),
            }
            self.chunk(body, true).await;
            return;
        }
        let size = body.len().div_ceil(chunks).max(1);
        let pieces: Vec<&[u8]> = body.chunks(size).collect();
        for (i, piece) in pieces.iter().enumerate() {
            // The picker may answer (413) and close the stream before the last chunk.
            if !self.chunk(piece, i + 1 == pieces.len()).await {
                return;
            }
        }
    }

    /// Sends one request body chunk; false when the stream is gone.
    pub async fn chunk(&mut self, data: &[u8], end_of_stream: bool) -> bool {
        let chunk = HttpBody {
            body: data.to_vec(),
            end_of_stream,
            ..Default::default()
        };
        let message = ProcessingRequest {
            request: Some(Message::RequestBody(chunk)),
            ..Default::default()
        };
        self.queued.push(data.to_vec());
        self.tx.send(message).await.is_ok()
    }

    /// The picker's next message.
    async fn message(&mut self) -> ProcessingResponse {
        tokio::time::timeout(WAIT, self.inbound.message())
            .await
            .expect("the picker answers in time")
            .expect("the stream is healthy")
            .expect("the stream is open")
    }

    /// The picker's next answer.
    pub async fn next(&mut self) -> Answer {
        self.message().await.response.expect("an answer")
    }

    /// Reads the picker's answer to the request: the endpoint, or a refusal.
    pub async fn picked(&mut self) -> Picked {
        let refusal = |refused: ImmediateResponse| Picked::Refused {
            status: refused.status.expect("a status").code,
            body: String::from_utf8_lossy(&refused.body).into_owned(),
        };
        if let Some(refused) = self.refused.take() {
            return refusal(refused);
        }
        let message = self.message().await;
        let (common, body) = match message.response.expect("an answer") {
            Answer::ImmediateResponse(refused) => return refusal(refused),
            Answer::RequestHeaders(headers) if self.mode != Mode::Buffered => {
                let common = headers.response.expect("a common response");
                (common, None)
            }
            // `BUFFERED`: the pick rides on the body's answer, which keeps the body.
            Answer::RequestBody(body) if self.mode == Mode::Buffered => {
                let common = body.response.expect("a common response");
                assert_eq!(common.body_mutation, None, "the body passes unchanged");
                (common, Some(std::mem::take(&mut self.queued).concat()))
            }
            other => panic!("an answer to the request: {other:?}"),
        };
        self.endpoint(common, message.dynamic_metadata, body).await
    }

    /// The endpoint a pick names in `common` and the `metadata`, and the request body
    /// as it goes upstream (`body` when already known).
    async fn endpoint(
        &mut self,
        common: CommonResponse,
        metadata: Option<Struct>,
        body: Option<Vec<u8>>,
    ) -> Picked {
        assert!(common.clear_route_cache, "the route cache is cleared");
        let set = common.header_mutation.expect("headers set").set_headers;
        let find = |key: &str| {
            set.iter()
                .filter_map(|h| h.header.as_ref())
                .find(|h| h.key == key)
                .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
        };
        let lb = metadata.expect("dynamic metadata");
        let Some(Kind::StructValue(lb)) = lb.fields["envoy.lb"].kind.clone() else {
            panic!("envoy.lb is a struct");
        };
        let Some(Kind::StringValue(metadata)) =
            lb.fields["x-gateway-destination-endpoint"].kind.clone()
        else {
            panic!("the endpoint metadata is a string");
        };
        let body = match body {
            Some(body) => body,
            None => self.upstream_body().await,
        };
        Picked::Endpoint {
            header: find("x-gateway-destination-endpoint").expect("endpoint header"),
            metadata,
            dp_rank: find("x-data-parallel-rank"),
            body,
        }
    }

    /// The request body as it goes upstream, from the picker's answers to the body.
    async fn upstream_body(&mut self) -> Vec<u8> {
        let queued = std::mem::take(&mut self.queued);
        if self.mode == Mode::FullDuplex {
            // The processor owns the body: what it streams back is what goes upstream.
            return match self.next().await {
                Answer::RequestBody(body) => match streamed(body.response) {
                    Some(s) => {
                        assert!(s.end_of_stream, "the body is echoed whole");
                        s.body
                    }
                    None => panic!("the body is streamed back"),
                },
                other => panic!("the body follows the headers: {other:?}"),
            };
        }
        // STREAMED: each queued chunk is released by its own answer, in order.
        let mut upstream = Vec::new();
        for (i, chunk) in queued.into_iter().enumerate() {
            let answer = self.next().await;
            let Answer::RequestBody(body) = answer else {
                panic!("chunk {i} is answered with a body response: {answer:?}");
            };
            upstream.extend(apply(body.response.and_then(|r| r.body_mutation), chunk));
        }
        upstream
    }

    /// The upstream answered: response headers naming the endpoint `served` (as a
    /// response header, as some proxies report it).
    pub async fn response_headers(&mut self, served: &str) {
        self.response_headers_served(served, false).await;
    }

    /// The upstream answered, and the proxy reports the endpoint `served` as the
    /// protocol describes: in the `envoy.lb` metadata of the response headers
    /// message (`in_metadata`), or as a response header.
    pub async fn response_headers_served(&mut self, served: &str, in_metadata: bool) {
        const SERVED: &str = "x-gateway-destination-endpoint-served";
        let mut list = vec![
            header(":status", "200"),
            header("content-type", "text/event-stream"),
        ];
        let metadata = if in_metadata {
            let lb = Struct {
                fields: [(SERVED.to_owned(), string(served))].into_iter().collect(),
            };
            Some(Metadata {
                filter_metadata: [("envoy.lb".to_owned(), lb)].into_iter().collect(),
                ..Default::default()
            })
        } else {
            list.push(header(SERVED, served));
            None
        };
        let headers = HttpHeaders {
            headers: Some(HeaderMap { headers: list }),
            end_of_stream: false,
            ..Default::default()
        };
        self.send(ProcessingRequest {
            metadata_context: metadata,
            request: Some(Message::ResponseHeaders(headers)),
            ..Default::default()
        })
        .await;
        assert!(matches!(self.next().await, Answer::ResponseHeaders(_)));
    }

    /// A response body chunk, echoed back by the picker.
    pub async fn response_chunk(&mut self, data: &[u8], end_of_stream: bool) {
        let chunk = HttpBody {
            body: data.to_vec(),
            end_of_stream,
            ..Default::default()
        };
        self.send(ProcessingRequest {
            request: Some(Message::ResponseBody(chunk)),
            ..Default::default()
        })
        .await;
        let Answer::ResponseBody(body) = self.next().await else {
            panic!("an answer to the chunk");
        };
        if self.mode == Mode::FullDuplex {
            let s = streamed(body.response).expect("the chunk is streamed back");
            assert_eq!(s.body, data);
            assert_eq!(s.end_of_stream, end_of_stream);
        } else {
            let passed = apply(body.response.and_then(|r| r.body_mutation), data.to_vec());
            assert_eq!(passed, data, "the chunk passes unchanged");
        }
    }
}

type Common = Option<envoy_types::pb::envoy::service::ext_proc::v3::CommonResponse>;

/// A `FULL_DUPLEX_STREAMED` answer's body.
fn streamed(
    common: Common,
) -> Option<envoy_types::pb::envoy::service::ext_proc::v3::StreamedBodyResponse> {
    match common?.body_mutation?.mutation? {
        body_mutation::Mutation::StreamedResponse(s) => Some(s),
        _ => None,
    }
}

/// A `STREAMED` chunk after its answer's body mutation, as Envoy applies it: none
/// keeps the chunk, `body` replaces it, `clear_body` empties it. A `streamed_response`
/// belongs to `FULL_DUPLEX_STREAMED` only: a processor sending one here is answering
/// in the wrong mode.
fn apply(mutation: Option<BodyMutation>, chunk: Vec<u8>) -> Vec<u8> {
    match mutation.and_then(|m| m.mutation) {
        None => chunk,
        Some(body_mutation::Mutation::Body(body)) => body,
        Some(body_mutation::Mutation::ClearBody(true)) => Vec::new(),
        Some(body_mutation::Mutation::ClearBody(false)) => chunk,
        Some(other) => panic!("a STREAMED chunk answered with {other:?}"),
    }
}
