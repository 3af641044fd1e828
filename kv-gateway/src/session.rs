//! The session header: `x-session-id` names the conversation (or agent run) a request
//! belongs to, passed to the router as the route request's `session_id` so the
//! conversation's turns prefer the rank that holds its context (`docs/gateway.md`,
//! "Session affinity").
//!
//! Why a header and not OpenAI's `user` field: `user` names an end user, who may run
//! many conversations at once, and sticking all of them to one rank would load it for
//! no cache gain; a header also works for every endpoint without parsing the body,
//! and is what peers use (`X-Dynamo-Session-ID`, SGLang's `X-SMG-Routing-Key`).

use crate::error::ApiError;
use axum::http::HeaderMap;
use kv_events::routing::SessionId;

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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

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
