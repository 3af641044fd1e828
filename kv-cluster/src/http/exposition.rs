//! The one reader of the Prometheus text format in the workspace: the samples of a
//! `/metrics` page, for the relay's scrape of an engine and for probes, measurement
//! tools and tests ([`metric_sample`]).
//!
//! Why our own and not a crate: the crates for it are either unmaintained and split
//! label sets on every comma and `=` (`prometheus-parse`: vLLM's `cache_config_info`
//! carries free-form configuration values, which then tear the labels apart), or
//! LGPL-licensed and fail a whole page on one line they do not know
//! (`openmetrics-parser`), where an engine upgrade must not stop the scrape. This
//! reader is about a hundred lines, in one place.
//!
//! Only sample lines are read; comments (`# HELP`, `# TYPE`), blank and malformed
//! lines and non-finite values are skipped, so a page from a newer engine still
//! parses. Label values are read with the format's quoting rules (`\"`, `\\`, `\n`
//! escapes; commas and braces inside quotes). Bounds: the page is as large as the
//! HTTP read allowed ([`super::read_body`]); reading it is linear in its size and
//! allocates nothing per sample (samples borrow the page).

/// One sample line: `name{labels} value [timestamp]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    /// Metric name.
    pub name: &'a str,
    /// The raw label set between the braces, in exposition order (empty without
    /// labels).
    pub labels: &'a str,
    /// The sample value (finite).
    pub value: f64,
}

impl<'a> Sample<'a> {
    /// The raw value of label `name` (escapes are not undone); `None` when absent.
    pub fn label(&self, name: &str) -> Option<&'a str> {
        labels(self.labels).find_map(|(k, v)| (k == name).then_some(v))
    }
}

/// Iterates `key="value"` pairs of a label set, honouring quotes and escapes; stops
/// at the first malformed pair.
fn labels(set: &str) -> impl Iterator<Item = (&str, &str)> {
    let mut rest = set;
    std::iter::from_fn(move || {
        rest = rest.trim_start_matches([',', ' ']);
        let (key, after) = rest.split_once('=')?;
        let after = after.trim_start().strip_prefix('"')?;
        let end = closing_quote(after)?;
        rest = &after[end + 1..];
        Some((key.trim(), &after[..end]))
    })
}

/// Byte index of the quote closing a value that starts right after its opening quote.
fn closing_quote(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// Splits a sample line into name, raw labels and value; `None` for comments,
/// blank or malformed lines and non-finite values.
pub fn sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let (name, rest) = line.split_at(name_end);
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => {
            // The closing brace is the first one outside quotes.
            let mut in_quotes = false;
            let mut escaped = false;
            let close = inner.char_indices().find_map(|(i, c)| {
                match (escaped, c) {
                    (true, _) => escaped = false,
                    (false, '\\') => escaped = in_quotes,
                    (false, '"') => in_quotes = !in_quotes,
                    (false, '}') if !in_quotes => return Some(i),
                    _ => {}
                }
                None
            })?;
            (&inner[..close], &inner[close + 1..])
        }
        None => ("", rest),
    };
    let value = rest
        .split_whitespace()
        .next()?
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// The sample lines of a page, in order.
pub fn samples(page: &str) -> impl Iterator<Item = Sample<'_>> {
    page.lines().filter_map(sample)
}

/// The value of the sample `name` with exactly `labels` (`k="v"` pairs,
/// comma-separated in exposition order; empty for an unlabelled metric) in the page
/// `text`; `None` when the page has no such sample.
pub fn metric_sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    samples(text)
        .find(|s| s.name == name && s.labels == labels)
        .map(|s| s.value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_braces_commas_and_escapes_do_not_split_labels() {
        let s = sample(r#"m{a="x,}y",b="q\"}",engine="3"} 2 17"#).expect("a sample");
        assert_eq!((s.name, s.value), ("m", 2.0));
        assert_eq!(s.label("a"), Some("x,}y"));
        assert_eq!(s.label("b"), Some(r#"q\"}"#));
        assert_eq!(s.label("engine"), Some("3"));
        assert_eq!(sample("m{a=\"unterminated} 1"), None);
        assert_eq!(sample("# HELP m text"), None);
        assert_eq!(sample("m NaN"), None);
    }

    #[test]
    fn a_sample_is_found_by_name_and_exact_labels() {
        let page = "# TYPE a counter\na_total 3\na_total{k=\"v\"} 4.5 1700000000\n\
                    garbage line\na_total_more 9\n";
        assert_eq!(metric_sample(page, "a_total", ""), Some(3.0));
        assert_eq!(metric_sample(page, "a_total", "k=\"v\""), Some(4.5));
        assert_eq!(metric_sample(page, "a_total", "k=\"w\""), None);
        assert_eq!(
            metric_sample(page, "a", ""),
            None,
            "a prefix is not the name"
        );
    }
}
