//! The harness's encoding of a multi-part input (ZMQ multipart frames, or the NATS
//! messages of one chunked reply) as one byte string, so that every input, whatever
//! its target, is reported and replayed as a single hex string.
//!
//! Layout: a count byte, then per part a little-endian `u32` length and the bytes.
//! [`split`] is total: a count or length running past the end is cut short, so random
//! bytes still make some parts.

/// At most this many parts are read (a count byte above it is taken modulo).
pub const MAX_PARTS: usize = 16;

/// The parts of `bytes` (see the module docs).
pub fn split(bytes: &[u8]) -> Vec<Vec<u8>> {
    let Some((&count, mut rest)) = bytes.split_first() else {
        return Vec::new();
    };
    let mut parts = Vec::new();
    for _ in 0..usize::from(count) % (MAX_PARTS + 1) {
        let (len, after) = match rest.split_first_chunk::<4>() {
            Some((len, after)) => (u32::from_le_bytes(*len) as usize, after),
            None => (rest.len(), &[][..]),
        };
        let len = len.min(after.len());
        parts.push(after[..len].to_vec());
        rest = &after[len..];
    }
    parts
}

/// The input holding `parts` (at most [`MAX_PARTS`]; more are dropped).
pub fn join(parts: &[Vec<u8>]) -> Vec<u8> {
    let parts = &parts[..parts.len().min(MAX_PARTS)];
    let mut out = vec![parts.len() as u8];
    for part in parts {
        // A part is at most a few MB: the generators never build more.
        out.extend_from_slice(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(part);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_round_trip_and_garbage_still_splits() {
        let parts = vec![b"kv".to_vec(), Vec::new(), vec![0xff; 8]];
        assert_eq!(split(&join(&parts)), parts);
        assert_eq!(split(&[2, 9, 0, 0, 0, 1, 2]), vec![vec![1, 2], vec![]]);
        assert!(split(&[]).is_empty());
    }
}
