//! The session of a request: the `x-session-id` header, or else the body's
//! `prompt_cache_key`, names the conversation (or agent run) a request belongs to,
//! passed to the router as the route request's `session_id` so the conversation's
//! turns prefer the rank that holds its context (`docs/gateway.md`, "Session
//! affinity").
//!
//! `prompt_cache_key` is OpenAI's own field for the same purpose (its API routes
//! requests with one key to the same cache), so an unmodified OpenAI client that sets
//! it gets affinity without a custom header. The gateway consumes it: it means
//! nothing to an engine, whose prefix cache is automatic.
//!
//! Why a header and not OpenAI's `user` field: `user` names an end user, who may run
//! many conversations at once, and sticking all of them to one rank would load it for
//! no cache gain; a header also works for every endpoint without parsing the body,
//! and is what peers use (`X-Dynamo-Session-ID`, SGLang's `X-SMG-Routing-Key`).

use crate::error::ApiError;
use axum::http::HeaderMap;
use kv_events::routing::SessionId;
use serde_json::{Map, Value};

/// The header carrying the session id.
pub const SESSION_HEADER: &str = "x-session-id";

/// The request's session id: `None` without the header.
///
/// # Errors
/// 400 for a header that is repeated, not visible ASCII, empty or longer than
/// [`kv_events::routing::MAX_SESSION_ID_BYTES`] bytes (checked before it is copied).
pub fn session_of(headers: &HeaderMap) -> Result<Option<SessionId>, ApiError> {
    let mut values = headers.get_all(SESSION_HEADER).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(ApiError::bad_request(format!(
            "{SESSION_HEADER} is given more than once"
        )));
    }
    let text = value
        .to_str()
        .map_err(|_| ApiError::bad_request(format!("{SESSION_HEADER} must be visible ASCII")))?;
    SessionId::new(text)
        .map(Some)
        .map_err(|e| ApiError::bad_request(format!("{SESSION_HEADER}: {e}")))
}

/// The body field OpenAI clients set to group requests that share a prompt prefix.
pub const PROMPT_CACHE_KEY: &str = "prompt_cache_key";

/// Takes `prompt_cache_key` out of a request body (it is not forwarded): `None` when
/// absent or null.
///
/// # Errors
/// 400 when it is not a string, is empty or is longer than
/// [`kv_events::routing::MAX_SESSION_ID_BYTES`] bytes.
pub fn take_prompt_cache_key(body: &mut Map<String, Value>) -> Result<Option<SessionId>, ApiError> {
    match body.remove(PROMPT_CACHE_KEY) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(key)) => SessionId::new(&key)
            .map(Some)
            .map_err(|e| ApiError::bad_request(format!("`{PROMPT_CACHE_KEY}`: {e}"))),
        Some(_) => Err(ApiError::bad_request(format!(
            "`{PROMPT_CACHE_KEY}` must be a string"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde_json::json;

    fn body(key: Value) -> Map<String, Value> {
        match json!({"model": "m", PROMPT_CACHE_KEY: key}) {
            Value::Object(map) => map,
            _ => unreachable!("a JSON object literal"),
        }
    }

    #[test]
    fn the_prompt_cache_key_is_taken_out_of_the_body_and_bounded() {
        let mut given = body(json!("conv-9"));
        let key = take_prompt_cache_key(&mut given).expect("a valid key");
        assert_eq!(key.map(|s| s.to_string()), Some("conv-9".to_owned()));
        assert!(!given.contains_key(PROMPT_CACHE_KEY), "not forwarded");
        assert_eq!(given.len(), 1, "the rest of the body is kept");
        assert_eq!(take_prompt_cache_key(&mut given).expect("absent"), None);
        assert_eq!(
            take_prompt_cache_key(&mut body(Value::Null)).expect("null"),
            None
        );
        for bad in [
            json!(7),
            json!(""),
            json!("k".repeat(kv_events::routing::MAX_SESSION_ID_BYTES + 1)),
        ] {
            let err = take_prompt_cache_key(&mut body(bad.clone())).expect_err("refused");
            assert_eq!(err.status.as_u16(), 400, "{bad}");
        }
    }

    #[test]
    fn the_header_is_optional_single_and_bounded() {
        let mut headers = HeaderMap::new();
        assert_eq!(session_of(&headers).expect("absent is fine"), None);
        headers.insert(SESSION_HEADER, HeaderValue::from_static("conv-1"));
        assert_eq!(
            session_of(&headers).expect("valid").map(|s| s.to_string()),
            Some("conv-1".to_owned())
        );
        headers.append(SESSION_HEADER, HeaderValue::from_static("conv-2"));
        assert!(session_of(&headers).is_err(), "repeated");
        let mut long = HeaderMap::new();
        let value = "x".repeat(kv_events::routing::MAX_SESSION_ID_BYTES + 1);
        long.insert(
            SESSION_HEADER,
            HeaderValue::from_str(&value).expect("ascii"),
        );
        let err = session_of(&long).expect_err("too long");
        assert_eq!(err.status.as_u16(), 400);
        let mut empty = HeaderMap::new();
        empty.insert(SESSION_HEADER, HeaderValue::from_static(""));
        assert!(session_of(&empty).is_err(), "empty");
    }
}
