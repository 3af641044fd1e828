//! The cluster's HTTP client side: [`reqwest`], plus the two things every caller
//! needs around it and that reqwest leaves to its user.
//!
//! - A byte bound: [`read_body`] streams a response body and stops at a caller's
//!   limit, so an endpoint that never ends its answer (or announces a huge one) costs
//!   no memory past the bound; [`get_text`] is a `GET` under a deadline with it, and
//!   [`get_once`] the same on a connection of its own.
//! - One rustls crypto provider per process, ring ([`install_crypto_provider`]), the
//!   one etcd and NATS use. reqwest is built without one of its own
//!   (`rustls-no-provider`: its default, aws-lc-rs, would add a second C crypto
//!   library, and cmake, to every build) and panics if none is installed, so every
//!   reqwest client in the workspace comes from [`client_builder`] or [`client`],
//!   which install ring first; NATS and etcd connections install it too, so each
//!   works whichever starts first.
//!
//! Callers: `kv-router probe` (container health checks need no curl), the relay's
//! scrape of an engine's `/metrics` (`http://` or `https://`) and its read of
//! `/v1/models`, the mock engine tools and tests. Cost: reqwest's connection pool per
//! client; build one client per task and reuse it.

use crate::Error;
use reqwest::{IntoUrl, StatusCode};
use std::time::Duration;

/// Most bytes of a response body [`get_text`] callers read by default: 16 MiB, far
/// above any metrics page or health answer.
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// Installs rustls's ring provider as the process default, unless a default is
/// installed already (then that one stays). Idempotent and cheap; called before
/// every TLS client the cluster builds.
pub fn install_crypto_provider() {
    // An error only means a default is installed already, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A [`reqwest::ClientBuilder`] with the process's crypto provider installed: https
/// with the platform's root certificates (on Linux the system store, or the
/// `SSL_CERT_FILE` / `SSL_CERT_DIR` it names) plus any the caller adds.
pub fn client_builder() -> reqwest::ClientBuilder {
    install_crypto_provider();
    reqwest::Client::builder()
}

/// A default client from [`client_builder`].
///
/// # Errors
/// [`Error::HttpRequest`] when the TLS set-up fails (no usable root store).
pub fn client() -> Result<reqwest::Client, Error> {
    build(client_builder(), "(client)".to_owned())
}

/// `builder`'s client; a failure is an [`Error::HttpRequest`] for `target`.
fn build(builder: reqwest::ClientBuilder, target: String) -> Result<reqwest::Client, Error> {
    builder.build().map_err(|e| Error::HttpRequest {
        target,
        reason: format!("cannot build the http client: {e}"),
    })
}

/// Reads `response`'s body, at most `max_bytes` of it: a longer body (announced by
/// `Content-Length` or found while streaming) is an error and is read no further.
/// The body's deadline is the request's (`RequestBuilder::timeout`).
///
/// # Errors
/// The reason, lowercase: a body over the bound, or the transfer failing.
pub async fn read_body(
    mut response: reqwest::Response,
    max_bytes: usize,
) -> Result<Vec<u8>, String> {
    let over = || format!("the response body is over {max_bytes} bytes");
    let announced = response.content_length().unwrap_or(0);
    if usize::try_from(announced).map_or(true, |n| n > max_bytes) {
        return Err(over());
    }
    // The announced length is within the bound, so this allocation is too.
    let mut body = Vec::with_capacity(usize::try_from(announced).unwrap_or(0));
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("reading the body: {e}"))?
    {
        if body.len() + chunk.len() > max_bytes {
            return Err(over());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// `GET url` with `client` within `timeout` (connect to last body byte), reading at
/// most `max_bytes` of the body ([`read_body`]): the status and the body decoded as
/// UTF-8 (lossily).
///
/// # Errors
/// [`Error::HttpRequest`] naming the URL on a bad URL, connect or TLS failure,
/// timeout, or a body over the bound. A status other than 200 is not an error.
pub async fn get_text(
    client: &reqwest::Client,
    url: impl IntoUrl,
    timeout: Duration,
    max_bytes: usize,
) -> Result<(StatusCode, String), Error> {
    let url = url.into_url().map_err(|e| Error::HttpRequest {
        target: "(url)".to_owned(),
        reason: e.to_string(),
    })?;
    let fail = |reason: String| Error::HttpRequest {
        target: url.to_string(),
        reason,
    };
    let response = client
        .get(url.clone())
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| fail(describe(&e)))?;
    let status = response.status();
    let body = read_body(response, max_bytes).await.map_err(fail)?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// `GET http://{addr}{path}` on a connection of its own, closed after the answer,
/// within `timeout`, reading at most [`MAX_RESPONSE_BYTES`]: for one-shot callers
/// (`kv-router probe`, tests) that keep no client.
///
/// # Errors
/// As [`get_text`], and [`Error::HttpRequest`] when the client cannot be built.
pub async fn get_once(
    addr: impl std::fmt::Display,
    path: &str,
    timeout: Duration,
) -> Result<(StatusCode, String), Error> {
    let client = build(
        client_builder().pool_max_idle_per_host(0),
        format!("{addr}{path}"),
    )?;
    get_text(
        &client,
        format!("http://{addr}{path}"),
        timeout,
        MAX_RESPONSE_BYTES,
    )
    .await
}

/// A reqwest error with its causes (reqwest's own message omits them: "error sending
/// request" says nothing of a refused connection or an unknown certificate).
fn describe(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    if error.is_timeout() {
        text.push_str(" (deadline passed)");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server that sends more than the bound is cut off with an error, whether it
    /// announces its length or streams chunks, and a response within it is read
    /// whole.
    #[tokio::test]
    async fn a_response_over_the_bound_is_an_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let answers = [
                "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nxxxxxxxxxx".to_owned(),
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{}",
                    "x".repeat(1000)
                ),
                format!(
                    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{}0\r\n\r\n",
                    format!("64\r\n{}\r\n", "x".repeat(100)).repeat(3)
                ),
            ];
            for answer in answers {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut head = [0u8; 1024];
                let _ = socket.read(&mut head).await.unwrap();
                // The client may close early: a failed write is what it does then.
                let _ = socket.write_all(answer.as_bytes()).await;
            }
        });
        let client = client().unwrap();
        let url = format!("http://{addr}/");
        let wait = Duration::from_secs(30);
        let (status, body) = get_text(&client, &url, wait, 200).await.unwrap();
        assert_eq!((status, body.len()), (StatusCode::OK, 10));
        for what in ["announced", "streamed"] {
            let err = get_text(&client, &url, wait, 200).await.unwrap_err();
            assert!(err.to_string().contains("over 200 bytes"), "{what}: {err}");
        }
        server.await.unwrap();
    }

    /// A server that accepts and never answers is given up at the deadline.
    #[tokio::test]
    async fn a_silent_server_is_given_up_at_the_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(socket);
        });
        let client = client().unwrap();
        let err = get_text(
            &client,
            format!("http://{addr}/"),
            Duration::from_millis(200),
            MAX_RESPONSE_BYTES,
        )
        .await
        .unwrap_err();
        assert!(err.to_string().contains("deadline"), "{err}");
        server.abort();
    }
}
