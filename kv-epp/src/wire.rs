//! Reading Envoy's ext_proc messages and building the picker's answers, as the
//! endpoint-picker protocol (GAIE `004-endpoint-picker-protocol`) names them.

use axum::http::{HeaderMap, HeaderName, HeaderValue as HttpHeaderValue};
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
    processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use kv_gateway::error::ApiError;

/// The request header and `envoy.lb` metadata key naming the picked endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the picked endpoint and of the subset hint.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The value of the pseudo-header `name` (`:path`, `:method`), which an HTTP header
/// map cannot hold.
pub fn pseudo_header<'a>(headers: &'a HttpHeaders, name: &str) -> Option<&'a str> {
    let h = headers
        .headers
        .as_ref()?
        .headers
        .iter()
        .find(|h| h.key == name)?;
    if h.raw_value.is_empty() {
        Some(h.value.as_str())
    } else {
        std::str::from_utf8(&h.raw_value).ok()
    }
}

/// The subset hint's key: a list of `ip:port` the pick must stay within.
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// The response header naming the endpoint the proxy actually used.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// Most headers read from one message (more is a 431).
const MAX_HEADERS: usize = 256;

/// The proxy's headers as an HTTP header map (values from `raw_value`, or `value`
/// for older proxies); names or values that are not valid HTTP are skipped.
///
/// # Errors
/// 400 when there are more than 256 headers.
pub fn header_map(headers: &HttpHeaders) -> Result<HeaderMap, ApiError> {
    let list = headers
        .headers
        .as_ref()
        .map(|h| h.headers.as_slice())
        .unwrap_or_default();
    if list.len() > MAX_HEADERS {
        return Err(ApiError::bad_request(format!(
            "more than {MAX_HEADERS} request headers"
        )));
    }
    let mut map = HeaderMap::with_capacity(list.len());
    for h in list {
        let raw = if h.raw_value.is_empty() {
            h.value.as_bytes()
        } else {
            &h.raw_value
        };
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.key.as_bytes()),
            HttpHeaderValue::from_bytes(raw),
        ) {
            map.append(name, value);
        }
    }
    Ok(map)
}

/// The subset hint in a request headers message's `metadata`: `None` when the proxy
/// sent none (every endpoint is eligible), else the listed `ip:port` (possibly none).
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let value = metadata?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET)?;
    let list = match &value.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            })
            .collect(),
        // One comma-separated string, as some proxies send it.
        Some(Kind::StringValue(s)) => s.split(',').map(|a| a.trim().to_owned()).collect(),
        _ => Vec::new(),
    };
    Some(list)
}

/// The endpoint the proxy served the request from (`ip:port`), as the protocol
/// reports it on the response path: the `envoy.lb` entry
/// `x-gateway-destination-endpoint-served` of a response headers message's
/// `metadata`.
pub fn served_metadata(metadata: Option<&Metadata>) -> Option<String> {
    let value = metadata?
        .filter_metadata
        .get(LB_NAMESPACE)?
        .fields
        .get(SERVED)?;
    match &value.kind {
        Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
        _ => None,
    }
}

/// The served endpoint from a response header of the same name, for proxies that
/// send it that way.
pub fn served_header(headers: &HttpHeaders) -> Option<String> {
    let map = header_map(headers).ok()?;
    Some(map.get(SERVED)?.to_str().ok()?.trim().to_owned())
}

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        ..HeaderValueOption::default()
    }
}

/// Where a pick rides: the request-headers answer, or (`BUFFERED`) the request-body
/// answer, whose header mutation the proxy applies to the headers it still holds.
pub type PickOn = fn(CommonResponse) -> Response;

/// The pick on the request-headers answer.
pub fn on_headers(common: CommonResponse) -> Response {
    Response::RequestHeaders(HeadersResponse {
        response: Some(common),
    })
}

/// The pick on the request-body answer (the body itself unchanged).
pub fn on_body(common: CommonResponse) -> Response {
    Response::RequestBody(BodyResponse {
        response: Some(common),
    })
}

/// The request headers let through unchanged (`BUFFERED`: answered before the body).
pub fn request_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse::default())),
        ..ProcessingResponse::default()
    }
}

/// The pick, on the answer `on`: setting `x-gateway-destination-endpoint` (and
/// `extra` headers, e.g. vLLM's dp rank) and clearing the route cache, with the
/// `envoy.lb` dynamic metadata naming `endpoints` (primary first, comma-separated).
/// The header and the metadata carry the same list, as the protocol requires (it
/// leaves undefined which one a proxy reads when they differ).
pub fn picked(endpoints: &[String], extra: &[(&str, String)], on: PickOn) -> ProcessingResponse {
    let destination = endpoints.join(",");
    let mut set_headers = vec![header(DESTINATION, &destination)];
    set_headers.extend(extra.iter().map(|(k, v)| header(k, v)));
    let mut lb = Struct::default();
    lb.fields.insert(
        DESTINATION.to_owned(),
        Value {
            kind: Some(Kind::StringValue(destination)),
        },
    );
    let mut metadata = Struct::default();
    metadata.fields.insert(
        LB_NAMESPACE.to_owned(),
        Value {
            kind: Some(Kind::StructValue(lb)),
        },
    );
    ProcessingResponse {
        response: Some(on(CommonResponse {
            header_mutation: Some(HeaderMutation {
                set_headers,
                ..HeaderMutation::default()
            }),
            clear_route_cache: true,
            ..CommonResponse::default()
        })),
        dynamic_metadata: Some(metadata),
        ..ProcessingResponse::default()
    }
}

/// A body chunk passed on unchanged (full-duplex streamed mode: the processor
/// returns the body it holds).
pub fn request_body(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    body_response(body, end_of_stream, Response::RequestBody)
}

/// A response body chunk passed on unchanged.
pub fn response_body(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    body_response(body, end_of_stream, Response::ResponseBody)
}

fn body_response(
    body: Vec<u8>,
    end_of_stream: bool,
    variant: fn(BodyResponse) -> Response,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(variant(BodyResponse {
            response: Some(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::StreamedResponse(
                        StreamedBodyResponse {
                            body,
                            end_of_stream,
                            ..StreamedBodyResponse::default()
                        },
                    )),
                }),
                ..CommonResponse::default()
            }),
        })),
        ..ProcessingResponse::default()
    }
}

/// Response headers let through unchanged.
pub fn response_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse::default())),
        ..ProcessingResponse::default()
    }
}

/// Trailers (of the request or the response) let through unchanged.
pub fn trailers(response: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if response {
            Response::ResponseTrailers(t)
        } else {
            Response::RequestTrailers(t)
        }),
        ..ProcessingResponse::default()
    }
}

/// The request answered by the proxy itself with `error`'s status and OpenAI error
/// body (503 nothing eligible, 429 shed, 413 body too large, 400 bad body).
pub fn immediate(error: &ApiError) -> ProcessingResponse {
    let body = error.body().to_string();
    let mut set_headers = vec![header("content-type", "application/json")];
    if let Some(s) = error.retry_after_s {
        set_headers.push(header("retry-after", &s.to_string()));
    }
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(error.status.as_u16()),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                ..HeaderMutation::default()
            }),
            body: body.into_bytes(),
            details: format!("kv-epp: {}", error.message),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}
