//! Envoy's half of an ext_proc stream, from Envoy's own API definitions (the
//! `envoy-types` crate, generated from envoyproxy/data-plane-api): request headers
//! with the subset hint, the body in streamed chunks (full-duplex streamed mode),
//! then the response headers with the served endpoint and the response body.

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, body_mutation,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(15);

/// One stream, as Envoy drives it.
pub struct Envoy {
    tx: mpsc::Sender<ProcessingRequest>,
    inbound: tonic::Streaming<ProcessingResponse>,
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
    /// Opens a stream to the picker at `addr` and sends the request headers of a POST
    /// to `path`, with the subset hint `subset` when given.
    pub async fn open(addr: SocketAddr, path: &str, subset: Option<&[String]>) -> Self {
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
        let envoy = Self { tx, inbound };
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
                ..Default::default()
            })
            .await;
        envoy
    }

    async fn send(&self, message: ProcessingRequest) {
        self.tx.send(message).await.expect("the stream is open");
    }

    /// Sends `body` in `chunks` pieces, the last with end_of_stream.
    pub async fn body(&self, body: &[u8], chunks: usize) {
        let size = body.len().div_ceil(chunks).max(1);
        let pieces: Vec<&[u8]> = body.chunks(size).collect();
        for (i, piece) in pieces.iter().enumerate() {
            let chunk = HttpBody {
                body: piece.to_vec(),
                end_of_stream: i + 1 == pieces.len(),
                ..Default::default()
            };
            let message = ProcessingRequest {
                request: Some(Message::RequestBody(chunk)),
                ..Default::default()
            };
            // The picker may answer (413) and close the stream before the last chunk.
            if self.tx.send(message).await.is_err() {
                return;
            }
        }
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
        let message = self.message().await;
        match message.response.expect("an answer") {
            Answer::ImmediateResponse(refused) => Picked::Refused {
                status: refused.status.expect("a status").code,
                body: String::from_utf8_lossy(&refused.body).into_owned(),
            },
            Answer::RequestHeaders(headers) => {
                let common = headers.response.expect("a common response");
                assert!(common.clear_route_cache, "the route cache is cleared");
                let set = common.header_mutation.expect("headers set").set_headers;
                let find = |key: &str| {
                    set.iter()
                        .filter_map(|h| h.header.as_ref())
                        .find(|h| h.key == key)
                        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
                };
                let lb = message.dynamic_metadata.expect("dynamic metadata");
                let Some(Kind::StructValue(lb)) = lb.fields["envoy.lb"].kind.clone() else {
                    panic!("envoy.lb is a struct");
                };
                let Some(Kind::StringValue(metadata)) =
                    lb.fields["x-gateway-destination-endpoint"].kind.clone()
                else {
                    panic!("the endpoint metadata is a string");
                };
                let body = match self.next().await {
                    Answer::RequestBody(body) => {
                        let mutation = body.response.and_then(|r| r.body_mutation);
                        match mutation.and_then(|m| m.mutation) {
                            Some(body_mutation::Mutation::StreamedResponse(s)) => {
                                assert!(s.end_of_stream, "the body is echoed whole");
                                s.body
                            }
                            other => panic!("the body is streamed back: {other:?}"),
                        }
                    }
                    other => panic!("the body follows the headers: {other:?}"),
                };
                Picked::Endpoint {
                    header: find("x-gateway-destination-endpoint").expect("endpoint header"),
                    metadata,
                    dp_rank: find("x-data-parallel-rank"),
                    body,
                }
            }
            other => panic!("an answer to the request: {other:?}"),
        }
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
        match self.next().await {
            Answer::ResponseBody(body) => {
                let mutation = body.response.and_then(|r| r.body_mutation);
                match mutation.and_then(|m| m.mutation) {
                    Some(body_mutation::Mutation::StreamedResponse(s)) => {
                        assert_eq!(s.body, data);
                        assert_eq!(s.end_of_stream, end_of_stream);
                    }
                    other => panic!("the chunk is streamed back: {other:?}"),
                }
            }
            other => panic!("an answer to the chunk: {other:?}"),
        }
    }
}
