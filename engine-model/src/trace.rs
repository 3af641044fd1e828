//! Mooncake trace loading.
//!
//! The replay drives the cluster with a real request trace rather than synthetic
//! prompts, because prefix reuse is what KV-aware routing exploits and only a real
//! trace has a realistic reuse pattern. The format is the Mooncake FAST'25 trace
//! (Qin et al., "Mooncake: Trading More Storage for Less Computation", FAST'25,
//! Apache-2.0): JSONL, one request a line,
//!
//! ```json
//! {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}
//! ```
//!
//! with `timestamp` in ms from the start of the trace (non-decreasing, ties common),
//! lengths in tokens, and one hash id per [`TRACE_BLOCK_SIZE`]-token block. Each hash
//! id stands for the whole prefix up to the end of its block: two requests share a
//! hash id at position `i` exactly when they share tokens `0..512 * (i + 1)`.
//!
//! Engines use smaller blocks (64 tokens by default), so [`BlockMapping`] splits each
//! trace block into `512 / block_size` engine blocks: sub-block `j` of trace hash id
//! `h` gets `LocalBlockHash(xxh3_64(seed = 1337, le_u32 words of h ‖ j))`. Because `h`
//! already names the whole prefix, the pair `(h, j)` names the prefix up to the end of
//! that engine block, so equal engine block hashes still mean equal prefixes. The
//! online replay and the offline lab both build prompts with this one mapping, so they
//! see the same blocks.
//!
//! Loading is a single pass over the file; a trace of `n` requests with `b` block
//! references costs `O(n + b)` time and about `8 b` bytes for the hash ids. Every row is
//! validated (monotone timestamps, `ceil(input_length / 512) == len(hash_ids)`), and
//! errors name the 1-based line number.
//!
//! A short excerpt of the conversation trace is compiled into the binary
//! ([`bundled_excerpt`]) so the quickstart needs no files at run time.

use kv_events::LocalBlockHash;
use serde::Deserialize;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// Tokens per hash id in Mooncake traces.
pub const TRACE_BLOCK_SIZE: u64 = 512;

/// The bundled excerpt: the first 2,000 lines (about 11 minutes of arrivals) of the
/// Mooncake FAST'25 `conversation_trace.jsonl`, unmodified. See `mocker/data/README.md`.
const BUNDLED_EXCERPT: &str = include_str!("../data/mooncake_conversation_excerpt.jsonl");

/// Display name of the bundled excerpt, used in progress lines and errors.
pub const BUNDLED_EXCERPT_NAME: &str = "bundled mooncake_conversation_excerpt.jsonl";

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TraceRequest {
    /// Arrival time, in ms from the start of the trace.
    #[serde(rename = "timestamp")]
    pub timestamp_ms: u64,
    /// Prompt length, in tokens.
    pub input_length: u64,
    /// Generated length, in tokens.
    pub output_length: u64,
    /// One prefix hash id per [`TRACE_BLOCK_SIZE`]-token prompt block (the last block
    /// may be partial).
    pub hash_ids: Vec<u64>,
}

/// The engine block size does not divide [`TRACE_BLOCK_SIZE`], so trace blocks cannot
/// be split into whole engine blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "engine block size {0} tokens does not divide the trace block size of {TRACE_BLOCK_SIZE} tokens"
)]
pub struct TraceBlockSizeMismatch(pub u32);

/// How trace blocks ([`TRACE_BLOCK_SIZE`] tokens) map onto engine blocks of
/// `engine_block_size` tokens: each trace block becomes `512 / engine_block_size`
/// engine blocks (see the module docs for the hash). The one mapping used by the
/// online replay and the offline lab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMapping {
    engine_block_size: u32,
    sub_blocks: u64,
}

impl BlockMapping {
    /// The mapping onto engine blocks of `engine_block_size` tokens.
    ///
    /// # Errors
    /// [`TraceBlockSizeMismatch`] unless `engine_block_size` is a divisor of 512 (1, 2, 4,
    /// …, 64, …, 512).
    pub fn new(engine_block_size: u32) -> Result<Self, TraceBlockSizeMismatch> {
        let bs = u64::from(engine_block_size);
        if bs == 0 || !TRACE_BLOCK_SIZE.is_multiple_of(bs) {
            return Err(TraceBlockSizeMismatch(engine_block_size));
        }
        Ok(Self {
            engine_block_size,
            sub_blocks: TRACE_BLOCK_SIZE / bs,
        })
    }

    /// Tokens per engine block.
    pub fn engine_block_size(&self) -> u32 {
        self.engine_block_size
    }

    /// Engine blocks per trace block.
    pub fn sub_blocks(&self) -> u64 {
        self.sub_blocks
    }

    /// The local block hash of engine sub-block `j` of the trace block with hash id
    /// `trace_hash`: xxh3-64 (seed 1337) over the little-endian `u32` words
    /// `[low(h), high(h), j]`.
    pub fn sub_block_hash(trace_hash: u64, j: u32) -> LocalBlockHash {
        // Truncation is the point: split the id into its low and high 32-bit words.
        let words = [trace_hash as u32, (trace_hash >> 32) as u32, j];
        kv_events::hash_block(&words)
    }

    /// One local block hash per engine block of `request`'s prompt,
    /// `ceil(input_length / engine_block_size)` of them in prefix order (the last may
    /// be partial, as the router and engines expect). A request whose `hash_ids` are
    /// too short for its `input_length` (impossible for a parsed trace) gets hashes
    /// only for the engine blocks its ids cover.
    pub fn block_hashes(&self, request: &TraceRequest) -> Vec<LocalBlockHash> {
        let blocks = request
            .input_length
            .div_ceil(u64::from(self.engine_block_size));
        (0..blocks)
            .map_while(|k| {
                let trace_hash = *request.hash_ids.get((k / self.sub_blocks) as usize)?;
                // k % sub_blocks < 512 fits in u32.
                Some(Self::sub_block_hash(
                    trace_hash,
                    (k % self.sub_blocks) as u32,
                ))
            })
            .collect()
    }
}

/// Why a trace could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// The trace file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A line could not be read (for example invalid UTF-8).
    #[error("line {line}: cannot read: {source}")]
    Read {
        /// 1-based line number.
        line: usize,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A line is not a JSON request object with the expected fields.
    #[error("line {line}: malformed request: {source}")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// A line parsed but breaks a rule of the format.
    #[error("line {line}: {reason}")]
    Invalid {
        /// 1-based line number.
        line: usize,
        /// Which rule, lowercase.
        reason: String,
    },
}

/// Loads a Mooncake JSONL trace from `path`, skipping blank lines.
///
/// # Errors
/// [`TraceError::Io`] if the file cannot be opened; otherwise as [`parse_trace`].
pub fn load_trace(path: impl AsRef<Path>) -> Result<Vec<TraceRequest>, TraceError> {
    let path = path.as_ref();
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: path.to_owned(),
        source,
    })?;
    parse_trace(std::io::BufReader::new(file))
}

/// The bundled conversation-trace excerpt (2,000 requests), parsed.
///
/// # Errors
/// None in practice: the excerpt is validated by this module's tests; the `Result`
/// keeps the signature honest should the data file be replaced.
pub fn bundled_excerpt() -> Result<Vec<TraceRequest>, TraceError> {
    parse_trace(BUNDLED_EXCERPT.as_bytes())
}

/// Parses a Mooncake JSONL trace from a reader, skipping blank lines.
///
/// # Errors
/// [`TraceError::Read`], [`TraceError::Malformed`] or [`TraceError::Invalid`] for the
/// first bad line, naming its 1-based number. Invalid means: a timestamp smaller than
/// the previous one, `input_length == 0`, or `len(hash_ids) != ceil(input_length / 512)`.
pub fn parse_trace(reader: impl BufRead) -> Result<Vec<TraceRequest>, TraceError> {
    let mut requests = Vec::new();
    let mut previous_ms = 0;
    for (index, line) in reader.lines().enumerate() {
        let line_no = index + 1;
        let line = line.map_err(|source| TraceError::Read {
            line: line_no,
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let request: TraceRequest =
            serde_json::from_str(&line).map_err(|source| TraceError::Malformed {
                line: line_no,
                source,
            })?;
        validate(&request, previous_ms).map_err(|reason| TraceError::Invalid {
            line: line_no,
            reason,
        })?;
        previous_ms = request.timestamp_ms;
        requests.push(request);
    }
    Ok(requests)
}

/// Checks one row against the format's rules; `Err` carries a lowercase reason.
fn validate(request: &TraceRequest, previous_ms: u64) -> Result<(), String> {
    if request.timestamp_ms < previous_ms {
        return Err(format!(
            "timestamp {} ms is before the previous request's {} ms",
            request.timestamp_ms, previous_ms
        ));
    }
    if request.input_length == 0 {
        return Err("input_length is 0".to_owned());
    }
    let expected_blocks = request.input_length.div_ceil(TRACE_BLOCK_SIZE);
    if request.hash_ids.len() as u64 != expected_blocks {
        return Err(format!(
            "{} hash_ids for input_length {} (expected {expected_blocks} blocks of {TRACE_BLOCK_SIZE} tokens)",
            request.hash_ids.len(),
            request.input_length
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]}
{"timestamp": 0, "input_length": 512, "output_length": 5, "hash_ids": [0]}

{"timestamp": 250, "input_length": 1025, "output_length": 0, "hash_ids": [0, 1, 7]}
"#;

    #[test]
    fn parses_rows_and_skips_blank_lines() {
        let trace = parse_trace(SAMPLE.as_bytes()).unwrap();
        assert_eq!(trace.len(), 3);
        assert_eq!(
            trace[0],
            TraceRequest {
                timestamp_ms: 0,
                input_length: 1000,
                output_length: 20,
                hash_ids: vec![0, 1],
            }
        );
        assert_eq!(trace[2].timestamp_ms, 250);
    }

    #[test]
    fn mapping_splits_each_trace_block_into_engine_blocks() {
        let trace = parse_trace(SAMPLE.as_bytes()).unwrap();
        let sub = BlockMapping::sub_block_hash;
        let m512 = BlockMapping::new(512).unwrap();
        assert_eq!(m512.sub_blocks(), 1);
        assert_eq!(
            m512.block_hashes(&trace[2]),
            vec![sub(0, 0), sub(1, 0), sub(7, 0)]
        );
        let m64 = BlockMapping::new(64).unwrap();
        assert_eq!(m64.sub_blocks(), 8);
        // 1,000 tokens: 16 engine blocks (the last partial), 8 per trace block.
        let hashes = m64.block_hashes(&trace[0]);
        assert_eq!(hashes.len(), 16);
        assert_eq!(hashes[0], sub(0, 0));
        assert_eq!(hashes[7], sub(0, 7));
        assert_eq!(hashes[8], sub(1, 0));
        assert_eq!(hashes[15], sub(1, 7));
        // Requests sharing trace block 0 share its 8 engine blocks, and only those.
        let other = m64.block_hashes(&trace[2]);
        assert_eq!(hashes[..8], other[..8]);
        assert_eq!(hashes[8..16], other[8..16]);
        assert_eq!(other.len(), 17);
        assert_eq!(other[16], sub(7, 0));
        // Distinct (id, j) pairs give distinct hashes; the id's high word matters.
        assert_ne!(sub(0, 1), sub(1, 0));
        assert_ne!(sub(1, 0), sub(1 << 32 | 1, 0));
    }

    #[test]
    fn mapping_rejects_block_sizes_that_do_not_divide_512() {
        for bs in [0, 3, 48, 100, 1024] {
            assert_eq!(BlockMapping::new(bs), Err(TraceBlockSizeMismatch(bs)));
        }
        for bs in [1, 16, 64, 128, 512] {
            assert_eq!(BlockMapping::new(bs).unwrap().engine_block_size(), bs);
        }
        let err = BlockMapping::new(48).unwrap_err().to_string();
        assert!(err.contains("48") && err.contains("512"), "{err}");
    }

    #[test]
    fn mapping_stops_where_hash_ids_end() {
        let short = TraceRequest {
            timestamp_ms: 0,
            input_length: 1024,
            output_length: 1,
            hash_ids: vec![5],
        };
        assert_eq!(
            BlockMapping::new(256).unwrap().block_hashes(&short).len(),
            2
        );
    }

    #[test]
    fn malformed_json_names_the_line() {
        let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n\nnot json\n";
        let err = parse_trace(text.as_bytes()).unwrap_err();
        assert!(
            matches!(err, TraceError::Malformed { line: 3, .. }),
            "{err}"
        );
        assert!(err.to_string().starts_with("line 3: malformed request"));
    }

    #[test]
    fn missing_field_is_malformed() {
        let text = r#"{"timestamp": 0, "input_length": 10, "hash_ids": [0]}"#;
        let err = parse_trace(text.as_bytes()).unwrap_err();
        assert!(
            matches!(err, TraceError::Malformed { line: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("output_length"), "{err}");
    }

    #[test]
    fn decreasing_timestamp_is_invalid() {
        let text = concat!(
            r#"{"timestamp": 10, "input_length": 10, "output_length": 1, "hash_ids": [0]}"#,
            "\n",
            r#"{"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [0]}"#,
        );
        let err = parse_trace(text.as_bytes()).unwrap_err();
        assert!(matches!(err, TraceError::Invalid { line: 2, .. }), "{err}");
        assert!(err.to_string().contains("before the previous"), "{err}");
    }

    #[test]
    fn block_count_must_match_input_length() {
        let text = r#"{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [0]}"#;
        let err = parse_trace(text.as_bytes()).unwrap_err();
        assert!(matches!(err, TraceError::Invalid { line: 1, .. }), "{err}");
        assert!(err.to_string().contains("expected 2 blocks"), "{err}");

        let empty = r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}"#;
        let err = parse_trace(empty.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("input_length is 0"), "{err}");
    }

    #[test]
    fn missing_file_is_an_io_error() {
        let err = load_trace("/nonexistent/trace.jsonl").unwrap_err();
        assert!(matches!(err, TraceError::Io { .. }));
        assert!(err.to_string().contains("/nonexistent/trace.jsonl"));
    }

    #[test]
    fn load_trace_reads_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        std::fs::write(&path, SAMPLE).unwrap();
        assert_eq!(load_trace(&path).unwrap().len(), 3);
    }

    #[test]
    fn bundled_excerpt_is_valid() {
        let trace = bundled_excerpt().unwrap();
        assert_eq!(trace.len(), 2000);
        assert_eq!(trace[0].hash_ids.first(), Some(&0));
        // The excerpt has prefix reuse, which is what makes KV-aware routing matter.
        let mut seen = std::collections::HashSet::new();
        let reused = trace
            .iter()
            .flat_map(|r| r.hash_ids.iter())
            .filter(|id| !seen.insert(**id))
            .count();
        assert!(reused > 0);
    }
}
