//! The body modes the proxy may run the ext_proc filter in, and how each is answered.
//!
//! To pick on the prompt, the picker must see the whole request body before it
//! answers the request headers: Envoy forwards the headers (and the router filter
//! chooses the upstream host) as soon as the headers are answered. Which exchanges
//! allow that, as Envoy's ext_proc filter implements them:
//!
//! - `FULL_DUPLEX_STREAMED` (the protocol's mode): body chunks follow the headers
//!   without waiting for any answer; the processor owns the body and must hand it
//!   back itself (`streamed_response`), else the upstream gets an empty body. The
//!   picker answers the headers, then the whole body in one `streamed_response`.
//! - `STREAMED` with `send_body_without_waiting_for_header_response: true`: chunks
//!   also follow the headers at once, and the headers stay held until answered; but
//!   the proxy keeps each chunk queued and expects exactly one `BodyResponse` per
//!   chunk, in order, each passing its chunk on (an answer without a body mutation
//!   keeps the chunk as it is). The picker answers the headers with the pick, then
//!   one empty answer per chunk it received. A `streamed_response` here would not be
//!   the body's echo: one answer would release only the first chunk (replaced by the
//!   whole body) and leave the others queued until the proxy's message timeout.
//! - `STREAMED` alone: the proxy sends no body until the headers are answered, and
//!   then forwards them, so the pick could not see the prompt. The picker refuses such
//!   a stream at once with a 500 naming the filter settings that work, rather than
//!   waiting for a body that cannot come.
//! - `BUFFERED`: the proxy sends the body only after the headers are answered, but
//!   holds the headers until the body, buffered whole in one message, is answered
//!   too, and applies that answer's header mutation to them. The picker answers the
//!   headers at once unchanged, and puts the pick (headers, metadata, route cache) on
//!   the body's answer, which leaves the body as it is.
//! - `BUFFERED_PARTIAL` (a body cut at the proxy's buffer limit would hide the
//!   prompt's end) and `NONE` (no body): refused with the same 500.
//!
//! The proxy names its modes in the first message's `protocol_config` (Envoy 1.34 and
//! later); without it the protocol's `FULL_DUPLEX_STREAMED` is assumed. The response
//! body is answered per its own mode: `FULL_DUPLEX_STREAMED` chunks are handed back
//! (`streamed_response`), any other mode's chunks pass with an empty answer.
//!
//! Cost: nothing per chunk beyond the answers the proxy requires; the body is
//! buffered the same way (up to `--max-body-bytes`) in both supported modes.

use crate::wire;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, ProcessingResponse, ProtocolConfiguration,
    processing_response::Response,
};
use kv_gateway::error::ApiError;

/// How the proxy exchanges one direction's body with the picker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    /// `FULL_DUPLEX_STREAMED`: the picker hands the body back itself.
    FullDuplex,
    /// Any mode where each body message gets one answer that passes its chunk on
    /// (`STREAMED`, and for responses also `BUFFERED`, `BUFFERED_PARTIAL`).
    PerChunk,
    /// `BUFFERED` requests: the headers are answered at once, the pick rides on the
    /// answer to the one body message.
    Buffered,
}

/// The modes of one stream's request and response bodies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Modes {
    /// The request body's.
    pub request: BodyMode,
    /// The response body's.
    pub response: BodyMode,
}

impl Default for Modes {
    /// The protocol's: full duplex both ways.
    fn default() -> Self {
        Self {
            request: BodyMode::FullDuplex,
            response: BodyMode::FullDuplex,
        }
    }
}

impl Modes {
    /// The modes the proxy announced in its first message (`None`: the protocol's).
    ///
    /// # Errors
    /// 500 when the request body mode lets the proxy forward the headers before the
    /// picker has seen the body (`STREAMED` without
    /// `send_body_without_waiting_for_header_response`, `BUFFERED`, `NONE`, ...).
    pub fn of(config: Option<&ProtocolConfiguration>) -> Result<Self, ApiError> {
        let Some(config) = config else {
            return Ok(Self::default());
        };
        let request = match BodySendMode::try_from(config.request_body_mode) {
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            Ok(BodySendMode::Streamed) if config.send_body_without_waiting_for_header_response => {
                BodyMode::PerChunk
            }
            Ok(BodySendMode::Buffered) => BodyMode::Buffered,
            other => {
                let mode = other.map_or("an unknown mode", |m| m.as_str_name());
                return Err(ApiError::internal(format!(
                    "the ext_proc filter sends the request body in {mode}{}, which the \
                     picker does not serve: it must read the prompt before it answers \
                     the request headers; set request_body_mode FULL_DUPLEX_STREAMED, or \
                     STREAMED with send_body_without_waiting_for_header_response: true, or \
                     BUFFERED",
                    if other == Ok(BodySendMode::Streamed) {
                        " without send_body_without_waiting_for_header_response"
                    } else {
                        ""
                    }
                )));
            }
        };
        let response = match BodySendMode::try_from(config.response_body_mode) {
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            _ => BodyMode::PerChunk,
        };
        Ok(Self { request, response })
    }

    /// Whether the request headers are answered (unchanged) as soon as they arrive:
    /// `BUFFERED`, where the proxy sends the body only then.
    pub fn headers_first(self) -> bool {
        self.request == BodyMode::Buffered
    }

    /// The answers naming the pick `endpoints` (with `extra` headers) and passing
    /// the request body on: `body` is the whole body, received in `chunks` messages.
    pub fn pick_answers(
        self,
        (endpoints, extra): (&[String], &[(&str, String)]),
        body: Vec<u8>,
        chunks: usize,
    ) -> Vec<ProcessingResponse> {
        let on_headers = || wire::picked(endpoints, extra, wire::on_headers);
        match self.request {
            BodyMode::FullDuplex => vec![on_headers(), wire::request_body(body, true)],
            BodyMode::PerChunk => std::iter::once(on_headers())
                .chain((0..chunks).map(|_| pass(Response::RequestBody)))
                .collect(),
            BodyMode::Buffered => vec![wire::picked(endpoints, extra, wire::on_body)],
        }
    }

    /// The answer passing one response body chunk on.
    pub fn response_body(self, body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
        match self.response {
            BodyMode::FullDuplex => wire::response_body(body, end_of_stream),
            BodyMode::PerChunk | BodyMode::Buffered => pass(Response::ResponseBody),
        }
    }
}

/// An answer to one body message that keeps its chunk as it is.
fn pass(variant: fn(BodyResponse) -> Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(variant(BodyResponse {
            response: Some(CommonResponse::default()),
        })),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(request: BodySendMode, without_waiting: bool) -> ProtocolConfiguration {
        ProtocolConfiguration {
            request_body_mode: request as i32,
            response_body_mode: BodySendMode::Streamed as i32,
            send_body_without_waiting_for_header_response: without_waiting,
        }
    }

    #[test]
    fn modes_from_the_protocol_config() {
        assert_eq!(Modes::of(None).ok(), Some(Modes::default()));
        let streamed = Modes::of(Some(&config(BodySendMode::Streamed, true))).ok();
        assert_eq!(
            streamed,
            Some(Modes {
                request: BodyMode::PerChunk,
                response: BodyMode::PerChunk
            })
        );
        let buffered = Modes::of(Some(&config(BodySendMode::Buffered, false))).ok();
        assert_eq!(buffered.map(Modes::headers_first), Some(true));
        for (mode, waiting) in [
            (BodySendMode::Streamed, false),
            (BodySendMode::BufferedPartial, true),
            (BodySendMode::None, false),
        ] {
            let refused = Modes::of(Some(&config(mode, waiting))).err();
            assert_eq!(refused.map(|e| e.status.as_u16()), Some(500), "{mode:?}");
        }
    }

    #[test]
    fn per_chunk_answers_one_empty_body_response_per_chunk() {
        let modes = Modes::of(Some(&config(BodySendMode::Streamed, true))).ok();
        let pick = (&["10.0.0.1:8000".to_owned()][..], &[][..]);
        let answers = modes.map(|m| m.pick_answers(pick, b"abc".to_vec(), 3));
        let answers = answers.unwrap_or_default();
        assert_eq!(answers.len(), 4, "the pick, then one per chunk");
        assert!(matches!(
            answers[0].response,
            Some(Response::RequestHeaders(_))
        ));
        for answer in answers.into_iter().skip(1) {
            let Some(Response::RequestBody(body)) = answer.response else {
                panic!("a request body answer");
            };
            assert_eq!(body.response, Some(CommonResponse::default()));
        }
    }
}
