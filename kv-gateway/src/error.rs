//! The gateway's errors: [`GatewayError`] for starting and running it, and
//! [`ApiError`], what a client sees — OpenAI's error JSON with a fitting status.
//!
//! The statuses follow what OpenAI-compatible servers return, so client libraries
//! retry what is worth retrying: 400 for a request that can never succeed, 404 for an
//! unknown model, 408 for a body sent too slowly, 429 with `Retry-After` when the router is overloaded, 503 when there
//! is no worker or router, 502 when the engine failed, 504 when it took too long.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Why the gateway could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// A flag or a combination of flags is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The tokenizer files could not be loaded.
    #[error("cannot load the tokenizer: {0}")]
    Tokenizer(#[from] kv_tokenizer::TokenizerError),
    /// NATS or etcd could not be reached or used.
    #[error(transparent)]
    Cluster(#[from] kv_cluster::Error),
    /// The HTTP listener could not be bound or served.
    #[error("http server on {addr}: {source}")]
    Http {
        /// The listen address.
        addr: std::net::SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The HTTP client for engines could not be built.
    #[error("http client: {0}")]
    Client(#[from] reqwest::Error),
    /// The metrics could not be registered.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The tokenizer threads could not be started.
    #[error("cannot start the tokenizer threads: {0}")]
    Threads(#[source] std::io::Error),
    /// The shutdown did not finish in time (NATS unreachable, typically).
    #[error(transparent)]
    ShutdownIncomplete(#[from] kv_cluster::shutdown::ShutdownIncomplete),
}

/// An error answered to a client: status, OpenAI `type`, message, and for 429 how
/// long to wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// OpenAI's error `type` (`invalid_request_error`, ...).
    pub kind: &'static str,
    /// What went wrong, for a person.
    pub message: String,
    /// `Retry-After`, in seconds.
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            retry_after_s: None,
        }
    }

    /// 400: the request can never succeed as sent.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 404: no such model here.
    pub fn unknown_model(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("the model `{model}` does not exist"),
        )
    }

    /// 413: the body is over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body over {limit} bytes"),
        )
    }

    /// 408: the request body did not arrive in time (`--body-read-timeout-ms`,
    /// `--body-idle-timeout-ms`); the connection is closed after it.
    pub fn body_too_slow(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            message,
        )
    }

    /// 429 with `Retry-After`: every worker is busy and the router's queue is full.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            retry_after_s: Some(1),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
        }
    }

    /// 503: no worker, or no router answering.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            message,
        )
    }

    /// 502: the engine failed.
    pub fn engine_failed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "engine_error", message)
    }

    /// 504: the engine did not answer in time.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout", message)
    }

    /// 500: a bug or an unexpected state of ours.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }

    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": null,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overloaded_is_429_with_retry_after_and_openai_shape() {
        let response = ApiError::overloaded("every worker is busy").into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let body = ApiError::overloaded("every worker is busy").body();
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert_eq!(body["error"]["message"], "every worker is busy");
        assert_eq!(body["error"]["code"], 429);
        assert!(body["error"]["param"].is_null());
    }
}
