//! The replay client: asks an engine's replay ROUTER socket for the batches from a
//! given seq on, over a fresh DEALER connection per request.
//!
//! Used when an engine socket connects (from seq 0: the whole buffer) and for every
//! gap. A fresh connection per request keeps the client stateless (no stale replies
//! from an earlier, timed-out request can be mistaken for this one's) at the cost of
//! one TCP handshake per request; connects and gaps are rare. The whole exchange is
//! bounded by one timeout.

use crate::frames::{FrameError, ReplayItem, parse_replay, replay_request};
use bytes::Bytes;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

/// Why a replay did not complete.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// ZMQ connect, send or receive failed.
    #[error("replay socket {endpoint}: {source}")]
    Zmq {
        /// The replay endpoint.
        endpoint: String,
        /// The cause.
        source: zeromq::ZmqError,
    },
    /// No end marker within the timeout.
    #[error("replay from {endpoint} did not finish within {timeout:?}")]
    Timeout {
        /// The replay endpoint.
        endpoint: String,
        /// The limit.
        timeout: Duration,
    },
    /// A reply had the wrong framing.
    #[error("replay reply from {endpoint}: {source}")]
    Frame {
        /// The replay endpoint.
        endpoint: String,
        /// The cause.
        source: FrameError,
    },
}

/// Fetches every batch the engine at `endpoint` still buffers from `start_seq` on,
/// in the order sent, within `timeout`.
///
/// # Errors
/// [`ReplayError`] when the socket fails, a reply is malformed, or the end marker
/// does not arrive in time.
pub async fn fetch(
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, ReplayError> {
    let zmq = |source| ReplayError::Zmq {
        endpoint: endpoint.to_owned(),
        source,
    };
    let exchange = async {
        let mut options = SocketOptions::default();
        options.connect_timeout(timeout);
        let mut socket = DealerSocket::with_options(options);
        socket.connect(endpoint).await.map_err(zmq)?;
        let request = ZmqMessage::try_from(replay_request(start_seq))
            // The request always has two frames, so it is never empty.
            .map_err(|_| zmq(zeromq::ZmqError::NoMessage))?;
        socket.send(request).await.map_err(zmq)?;
        let mut batches = Vec::new();
        loop {
            let reply = socket.recv().await.map_err(zmq)?;
            match parse_replay(reply.into_vec()) {
                Ok(ReplayItem::Batch { seq, payload }) => batches.push((seq, payload)),
                Ok(ReplayItem::End) => return Ok(batches),
                Err(source) => {
                    return Err(ReplayError::Frame {
                        endpoint: endpoint.to_owned(),
                        source,
                    });
                }
            }
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| ReplayError::Timeout {
            endpoint: endpoint.to_owned(),
            timeout,
        })?
}

/// The batches of `replayed` that fill `from..to` exactly (`to` excluded), or `None`
/// when the engine no longer has all of them (its buffer starts later or has holes).
pub fn covering(replayed: &[(u64, Bytes)], from: u64, to: u64) -> Option<Vec<(u64, Bytes)>> {
    let mut expected = from;
    let mut out = Vec::new();
    for (seq, payload) in replayed {
        if *seq < expected {
            continue;
        }
        if *seq != expected || expected >= to {
            break;
        }
        out.push((*seq, payload.clone()));
        expected += 1;
    }
    (expected >= to).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batches(seqs: &[u64]) -> Vec<(u64, Bytes)> {
        seqs.iter()
            .map(|s| (*s, Bytes::from(vec![*s as u8])))
            .collect()
    }

    #[test]
    fn covering_needs_every_missing_seq() {
        let got = covering(&batches(&[2, 3, 4, 5]), 2, 4).unwrap();
        assert_eq!(got.iter().map(|b| b.0).collect::<Vec<_>>(), vec![2, 3]);
        assert!(
            covering(&batches(&[3, 4]), 2, 4).is_none(),
            "buffer starts too late"
        );
        assert!(covering(&batches(&[2, 4]), 2, 4).is_none(), "hole");
        assert!(covering(&batches(&[]), 2, 4).is_none());
        assert_eq!(covering(&batches(&[0, 1, 2]), 1, 2).unwrap().len(), 1);
        assert_eq!(covering(&batches(&[]), 3, 3), Some(vec![]));
    }
}
