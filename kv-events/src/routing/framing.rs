//! A [`RouteBatchRequest`] framed around requests already encoded.
//!
//! Why: a frontend that groups the route requests arriving together (the gateway's
//! route grouping) encodes each request once, when it is asked for, and learns its
//! size then; whether it leaves alone (the payload as it is) or in a batch is decided
//! later. Framing the batch around those payloads costs a copy of their bytes, not a
//! second encoding of every prompt.

use super::{BatchOrder, RouteBatchRequest};
use crate::CodecError;

/// Bytes of a batch's framing beyond its requests' own: a 2-key map, the two key
/// strings, the array header (at most 5 bytes) and the order string.
pub const BATCH_FRAME_BYTES: usize = 1 + 9 + 5 + 6 + 16;

impl RouteBatchRequest {
    /// The payload of a batch of `requests` placed in `order`, where each element of
    /// `requests` is one [`super::RouteRequest`] as [`crate::encode`] wrote it. The
    /// result is byte for byte what [`crate::encode`] writes for the same
    /// `RouteBatchRequest`; its length is the requests' lengths plus at most
    /// [`BATCH_FRAME_BYTES`].
    ///
    /// # Errors
    /// [`CodecError::Encode`] when the order cannot be encoded (never for these types).
    pub fn frame<B: AsRef<[u8]>>(requests: &[B], order: BatchOrder) -> Result<Vec<u8>, CodecError> {
        let len: usize = requests.iter().map(|r| r.as_ref().len()).sum();
        let mut out = Vec::with_capacity(len + BATCH_FRAME_BYTES);
        // Writing to a `Vec` cannot fail; `rmp_serde` reports its error type.
        let fail = |e: rmp::encode::ValueWriteError| {
            CodecError::Encode(rmp_serde::encode::Error::InvalidValueWrite(e))
        };
        rmp::encode::write_map_len(&mut out, 2).map_err(fail)?;
        rmp::encode::write_str(&mut out, "requests").map_err(fail)?;
        let count = u32::try_from(requests.len()).unwrap_or(u32::MAX);
        rmp::encode::write_array_len(&mut out, count).map_err(fail)?;
        for request in requests {
            out.extend_from_slice(request.as_ref());
        }
        rmp::encode::write_str(&mut out, "order").map_err(fail)?;
        out.extend_from_slice(&crate::encode(&order)?);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::{Prompt, RouteRequest};
    use crate::{RequestId, WorkerId, encode};

    fn request(id: &str, tokens: u32) -> RouteRequest {
        let mut request = RouteRequest::new(
            RequestId(id.into()),
            Prompt::Tokens {
                token_ids: (0..tokens).collect(),
            },
        );
        request.exclude_workers = vec![WorkerId(7)];
        request
    }

    #[test]
    fn frames_exactly_what_serde_encodes() {
        // Counts around the fixarray / array16 boundary (15 / 16) and both orders.
        for count in [1usize, 2, 15, 16, 17] {
            let requests: Vec<RouteRequest> = (0..count)
                .map(|i| request(&format!("r-{i}"), 40 + i as u32))
                .collect();
            let encoded: Vec<Vec<u8>> = requests.iter().map(|r| encode(r).unwrap()).collect();
            for order in [BatchOrder::AsGiven, BatchOrder::GroupByPrefix] {
                let framed = RouteBatchRequest::frame(&encoded, order).unwrap();
                let whole = encode(&RouteBatchRequest {
                    requests: requests.clone(),
                    order,
                })
                .unwrap();
                assert_eq!(framed, whole, "{count} requests, {order:?}");
                let parts: usize = encoded.iter().map(Vec::len).sum();
                assert!(framed.len() <= parts + BATCH_FRAME_BYTES);
            }
        }
    }
}
