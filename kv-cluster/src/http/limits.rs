//! The bounds every HTTP server of the cluster serves within ([`ServerLimits`]) and
//! their defaults; what each one does is in the `server` module's docs.

use std::num::NonZeroUsize;
use std::time::Duration;

/// Default [`ServerLimits::header_read_timeout`] of every server, in ms: a client
/// sends its headers in one packet, right after connecting or all at once when it
/// reuses a connection.
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 5_000;

/// Default [`ServerLimits::idle_timeout`], in seconds: twice the longest idle pool of
/// common clients (aiohttp as aiperf sets it: 300 s; Go's `net/http`, reqwest and
/// SMG: 90 s), so the client, not the server, retires an idle connection. An idle
/// connection costs a task and a few KiB, and at the cap idle ones are closed first,
/// so a long idle timeout cannot lock new clients out.
pub const DEFAULT_IDLE_TIMEOUT_S: u64 = 600;

/// Default [`BodyTimeouts::total`], in ms: the largest body the gateway accepts by
/// default (8 MiB) arrives whole at about 2.2 Mbit/s or more.
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 30_000;

/// Default [`BodyTimeouts::idle`], in ms: a client sends its body right after its
/// head, so a gap as long as the header-read timeout means a stalled or hostile
/// client; TCP's retransmissions (1, 2, 4 s backoff) fit under it once or twice.
pub const DEFAULT_BODY_IDLE_TIMEOUT_MS: u64 = 5_000;

/// Deadlines of a request body; missing one is answered 408 with `Connection:
/// close`. A request without a body (`Content-Length: 0`, a `GET`) has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyTimeouts {
    /// Longest a body may take to arrive whole, from when its request's head was read.
    pub total: Duration,
    /// Longest wait for the body's next chunk (or its first), from the previous one.
    pub idle: Duration,
}

impl Default for BodyTimeouts {
    fn default() -> Self {
        Self {
            total: Duration::from_millis(DEFAULT_BODY_READ_TIMEOUT_MS),
            idle: Duration::from_millis(DEFAULT_BODY_IDLE_TIMEOUT_MS),
        }
    }
}

/// How one HTTP server bounds its connections (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Longest a connection may take to deliver a request's headers: from accept for
    /// its first request, from the first byte of the head for the next ones. Then it
    /// is closed unanswered.
    pub header_read_timeout: Duration,
    /// Longest a connection stays open with no request in flight and no bytes
    /// received; then it is closed (gracefully: never mid-answer). Advertised to
    /// clients in whole seconds as `Keep-Alive: timeout=N`.
    pub idle_timeout: Duration,
    /// Deadlines of request bodies.
    pub body: BodyTimeouts,
    /// Most connections served at once; at the cap the longest-idle one is closed
    /// for a new one, or the new one waits (see the module docs).
    pub max_connections: NonZeroUsize,
}

impl ServerLimits {
    /// The limits from their flag values, the header-read timeout in milliseconds
    /// (flags refuse 0) and the cap; the idle timeout and the body deadlines are the
    /// defaults ([`DEFAULT_IDLE_TIMEOUT_S`], [`BodyTimeouts::default`]). Set those
    /// fields afterwards to change them.
    pub fn from_flags(header_read_timeout_ms: u64, max_connections: NonZeroUsize) -> Self {
        Self {
            header_read_timeout: Duration::from_millis(header_read_timeout_ms),
            idle_timeout: Duration::from_secs(DEFAULT_IDLE_TIMEOUT_S),
            body: BodyTimeouts::default(),
            max_connections,
        }
    }
}
