//! A minimal HTTP/1.1 `GET` client ([`get`]) for the cluster's own plain-text
//! endpoints: `kv-router probe` (container health checks need no curl), the relay's
//! scrape of an engine's `/metrics` and read of its `/v1/models`, and tests. It
//! handles `Content-Length` and chunked bodies and nothing more; it is not a general
//! client. Every exchange has a deadline and a byte bound ([`get_within`]), so a
//! server that never ends its answer costs neither time nor memory without end.

use crate::Error;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A response of [`get`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Body, decoded as UTF-8 (lossily).
    pub body: String,
}

/// The value of the sample `name` with exactly `labels` (`k="v"` pairs, comma-separated
/// in exposition order; empty for an unlabelled metric) in Prometheus text `text`, as
/// `/metrics` serves it; for probes, measurement tools and tests.
pub fn metric_sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = if labels.is_empty() {
        name.to_owned()
    } else {
        format!("{name}{{{labels}}}")
    };
    text.lines()
        .find_map(|l| l.strip_prefix(&key)?.strip_prefix(' ')?.parse().ok())
}

/// Most bytes of a response [`get`] reads, head and body: 16 MiB, far above any
/// metrics page or health answer.
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// `GET http://{addr}{path}` with HTTP/1.1 and `Connection: close`, within `timeout`,
/// reading at most [`MAX_RESPONSE_BYTES`]. Handles `Content-Length` and chunked
/// bodies; enough for the daemon's own endpoints.
///
/// # Errors
/// [`Error::HttpRequest`] on connect, I/O or parse failure, timeout, or a response
/// over the bound.
pub async fn get(addr: &str, path: &str, timeout: Duration) -> Result<HttpResponse, Error> {
    get_within(addr, path, timeout, MAX_RESPONSE_BYTES).await
}

/// [`get`] reading at most `max_bytes` of the response (head and body, in bytes): a
/// longer one is an error, and is read no further.
///
/// # Errors
/// As [`get`].
pub async fn get_within(
    addr: &str,
    path: &str,
    timeout: Duration,
    max_bytes: usize,
) -> Result<HttpResponse, Error> {
    let target = format!("{addr}{path}");
    let fail = |reason: String| Error::HttpRequest {
        target: target.clone(),
        reason,
    };
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut raw = Vec::new();
        let limit = u64::try_from(max_bytes)
            .unwrap_or(u64::MAX)
            .saturating_add(1);
        (&mut stream)
            .take(limit)
            .read_to_end(&mut raw)
            .await
            .map_err(|e| format!("read: {e}"))?;
        if raw.len() > max_bytes {
            return Err(format!("the response is over {max_bytes} bytes"));
        }
        parse_response(&raw)
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result.map_err(fail),
        Err(_) => Err(fail(format!("no answer within {timeout:?}"))),
    }
}

fn parse_response(raw: &[u8]) -> Result<HttpResponse, String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or("bad status line")?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok(HttpResponse {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("bad chunk header")?;
        let size_text = String::from_utf8_lossy(&rest[..eol]);
        let size_hex = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16).map_err(|_| "bad chunk size")?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = rest.get(..size).ok_or("truncated chunk")?;
        out.extend_from_slice(chunk);
        rest = rest.get(size + 2..).ok_or("truncated chunk")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_length_and_chunked_bodies() {
        let plain = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\nno";
        assert_eq!(
            parse_response(plain).unwrap(),
            HttpResponse {
                status: 503,
                body: "no".into()
            }
        );
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked).unwrap().body, "abcde");
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
        assert!(parse_response(b"garbage\r\n\r\n").is_err());
    }

    /// A server that sends more than the bound is cut off with an error, and a
    /// response within it is read whole.
    #[tokio::test]
    async fn a_response_over_the_bound_is_an_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            for body_len in [10usize, 1000] {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut head = [0u8; 1024];
                let _ = socket.read(&mut head).await.unwrap();
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {body_len}\r\n\r\n{}",
                    "x".repeat(body_len)
                );
                // The client may close early: a failed write is what it does then.
                let _ = socket.write_all(answer.as_bytes()).await;
            }
        });
        let wait = Duration::from_secs(30);
        let small = get_within(&addr, "/", wait, 200).await.unwrap();
        assert_eq!(small.body.len(), 10);
        let err = get_within(&addr, "/", wait, 200).await.unwrap_err();
        assert!(err.to_string().contains("over 200 bytes"), "{err}");
        server.await.unwrap();
    }
}
