//! One pass over a msgpack value that checks it is complete and shallow enough to
//! decode, without allocating: every `str`, `bin` and ext length must fit in the
//! bytes that follow, every array and map must announce no more elements than
//! bytes follow (each element takes at least one), and arrays and maps may nest
//! at most [`MAX_DEPTH`] deep.

/// Deepest nesting of arrays and maps in a message. Our deepest message, a stored
/// index snapshot, nests 9 levels (snapshot, index, batches, batch, events, event,
/// data, blocks, block); the rest is room for fields added later. The engine
/// decoders use the same limit (`engines::MAX_DEPTH`).
pub const MAX_DEPTH: usize = 32;

/// Why a msgpack value cannot be decoded safely. Offsets are in bytes from the start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// The value ends before its last byte (or is empty).
    #[error("truncated at byte {at}")]
    Truncated {
        /// Where more bytes were needed.
        at: usize,
    },
    /// A header announces more bytes or elements than the input holds.
    #[error("the header at byte {at} announces {announced} bytes or elements, {left} bytes follow")]
    Overlong {
        /// Offset of the header's marker.
        at: usize,
        /// What it announces.
        announced: u64,
        /// Bytes after the header.
        left: usize,
    },
    /// Arrays and maps nest deeper than [`MAX_DEPTH`].
    #[error("nesting deeper than {MAX_DEPTH} levels at byte {at}")]
    TooDeep {
        /// Offset of the array or map that is one level too deep.
        at: usize,
    },
    /// The marker byte 0xc1, which msgpack never uses.
    #[error("reserved marker 0xc1 at byte {at}")]
    Reserved {
        /// Its offset.
        at: usize,
    },
}

/// A big-endian unsigned integer of `width` bytes at `*at`, advancing past it.
fn uint(bytes: &[u8], at: &mut usize, width: usize) -> Result<u64, ShapeError> {
    let field = bytes
        .get(*at..*at + width)
        .ok_or(ShapeError::Truncated { at: bytes.len() })?;
    *at += width;
    Ok(field.iter().fold(0, |n, &b| (n << 8) | u64::from(b)))
}

/// Checks the first msgpack value of `bytes` (see the module docs).
///
/// # Errors
/// [`ShapeError`] for the first problem found.
pub fn check(bytes: &[u8]) -> Result<(), ShapeError> {
    // Values still to read in each open array or map; level 0 is the top value.
    let mut open = [0u64; MAX_DEPTH + 1];
    open[0] = 1;
    let mut depth = 0;
    let mut at = 0;
    loop {
        while open[depth] == 0 {
            if depth == 0 {
                return Ok(());
            }
            depth -= 1;
        }
        open[depth] -= 1;
        let start = at;
        let marker = *bytes.get(at).ok_or(ShapeError::Truncated { at })?;
        at += 1;
        // Bytes to skip after the header, and values nested in it.
        let (skip, nested) = match marker {
            0x00..=0x7f | 0xc0 | 0xc2 | 0xc3 | 0xe0..=0xff => (0, 0),
            0x80..=0x8f => (0, 2 * u64::from(marker & 0x0f)),
            0x90..=0x9f => (0, u64::from(marker & 0x0f)),
            0xa0..=0xbf => (u64::from(marker & 0x1f), 0),
            0xc1 => return Err(ShapeError::Reserved { at: start }),
            0xc4..=0xc6 => (uint(bytes, &mut at, 1 << (marker - 0xc4))?, 0),
            0xc7..=0xc9 => (uint(bytes, &mut at, 1 << (marker - 0xc7))? + 1, 0),
            0xca => (4, 0),
            0xcb => (8, 0),
            0xcc..=0xcf => (1 << (marker - 0xcc), 0),
            0xd0..=0xd3 => (1 << (marker - 0xd0), 0),
            0xd4..=0xd8 => (1 + (1 << (marker - 0xd4)), 0),
            0xd9..=0xdb => (uint(bytes, &mut at, 1 << (marker - 0xd9))?, 0),
            0xdc => (0, uint(bytes, &mut at, 2)?),
            0xdd => (0, uint(bytes, &mut at, 4)?),
            0xde => (0, 2 * uint(bytes, &mut at, 2)?),
            0xdf => (0, 2 * uint(bytes, &mut at, 4)?),
        };
        let left = bytes.len() - at;
        let overlong = |announced| ShapeError::Overlong {
            at: start,
            announced,
            left,
        };
        // `skip` and `nested` are below 2^33: the casts and sums cannot overflow.
        if skip > left as u64 {
            return Err(overlong(skip));
        }
        at += skip as usize;
        if nested > 0 {
            if nested > left as u64 {
                return Err(overlong(nested));
            }
            if depth == MAX_DEPTH {
                return Err(ShapeError::TooDeep { at: start });
            }
            depth += 1;
            open[depth] = nested;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded<T: serde::Serialize>(value: &T) -> Vec<u8> {
        rmp_serde::to_vec_named(value).unwrap()
    }

    #[test]
    fn complete_values_of_every_kind_pass() {
        let value = (
            (u64::MAX, -5i64, i64::MIN, 1.5f64, 2.5f32, true, ()),
            (
                "é".repeat(40),
                serde_bytes_like(300),
                vec![vec![1u8; 20]; 3],
            ),
            std::collections::BTreeMap::from([("k".to_owned(), vec![Some(1u32), None])]),
        );
        let bytes = encoded(&value);
        assert_eq!(check(&bytes), Ok(()));
        // Trailing bytes are not the value's business.
        let mut more = bytes.clone();
        more.push(0xc1);
        assert_eq!(check(&more), Ok(()));
        for cut in 0..bytes.len() {
            assert!(check(&bytes[..cut]).is_err(), "a {cut}-byte prefix passed");
        }
    }

    fn serde_bytes_like(n: usize) -> Vec<u8> {
        (0..n).map(|i| i as u8).collect()
    }

    #[test]
    fn ext_values_pass() {
        // fixext 1, fixext 16, ext 8 with 3 bytes, in a 3-array.
        let mut bytes = vec![0x93, 0xd4, 1, 9, 0xd8, 2];
        bytes.extend([0; 16]);
        bytes.extend([0xc7, 3, 5, 1, 2, 3]);
        assert_eq!(check(&bytes), Ok(()));
        assert!(check(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn lying_lengths_are_refused_at_their_header() {
        assert_eq!(
            check(&[0x91, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]),
            Err(ShapeError::Overlong {
                at: 1,
                announced: u64::from(u32::MAX),
                left: 1
            })
        );
        assert_eq!(
            check(&[0xdf, 0, 0, 0, 1, 0x01]),
            Err(ShapeError::Overlong {
                at: 0,
                announced: 2,
                left: 1
            })
        );
        assert_eq!(
            check(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a']),
            Err(ShapeError::Overlong {
                at: 0,
                announced: u64::from(u32::MAX),
                left: 1
            })
        );
        assert_eq!(check(&[0xc6, 0, 0]), Err(ShapeError::Truncated { at: 3 }));
        assert_eq!(check(&[]), Err(ShapeError::Truncated { at: 0 }));
        assert_eq!(check(&[0x92, 0xc1, 0]), Err(ShapeError::Reserved { at: 1 }));
    }

    #[test]
    fn nesting_is_capped() {
        let nest = |levels: usize| {
            let mut bytes = vec![0x91; levels];
            bytes.push(0x00);
            bytes
        };
        assert_eq!(check(&nest(MAX_DEPTH)), Ok(()));
        assert_eq!(
            check(&nest(MAX_DEPTH + 1)),
            Err(ShapeError::TooDeep { at: MAX_DEPTH })
        );
        // Maps count as levels too.
        let mut maps = [0x81, 0x00].repeat(MAX_DEPTH + 1);
        maps.push(0x00);
        assert!(matches!(check(&maps), Err(ShapeError::TooDeep { .. })));
    }
}
