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
//! id stands for the whole prefix up to the end of its block, so the ids can be used
//! directly as [`LocalBlockHash`]es: two requests share a block hash at position `i`
//! exactly when they share tokens `0..512 * (i + 1)`.
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

impl TraceRequest {
    /// The hash ids as router block hashes, in prefix order.
    pub fn block_hashes(&self) -> Vec<LocalBlockHash> {
        self.hash_ids.iter().copied().map(LocalBlockHash).collect()
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
        assert_eq!(
            trace[2].block_hashes(),
            vec![LocalBlockHash(0), LocalBlockHash(1), LocalBlockHash(7)]
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
