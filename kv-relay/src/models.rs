//! The engine's context length, from its OpenAI `GET /v1/models`.
//!
//! vLLM (and SGLang) answer `{"object": "list", "data": [{"id", …, "max_model_len"}]}`,
//! one entry per served name and LoRA adapter, all of one engine and so of one
//! context length. The relay registers the smallest `max_model_len` of the entries
//! ([`crate::facts`]), so a gateway in front of the engine refuses a prompt the engine
//! would refuse before routing it, and accepts every prompt it would take.
//!
//! Bounds: one read takes at most [`MAX_MODELS_BYTES`] of body and the scrape's
//! deadline; a
//! value outside `1..=`[`MAX_MODEL_LEN`] is not taken. Cost: one small GET per scrape
//! period until the engine answers once (an engine loading its weights refuses
//! connections for minutes), then none.

use kv_events::discovery::MAX_MODEL_LEN;
use serde::Deserialize;
use std::time::Duration;

/// Largest `/v1/models` body read, in bytes: 1 MiB, room for
/// thousands of LoRA adapters at a few hundred bytes each.
pub const MAX_MODELS_BYTES: usize = 1 << 20;

/// Where the engine's `/v1/models` is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelsEndpoint {
    /// `{engine-url}/v1/models` (the engine URL's path prefix kept).
    pub url: url::Url,
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelCard>,
}

#[derive(Deserialize)]
struct ModelCard {
    #[serde(default)]
    max_model_len: Option<u64>,
}

/// The smallest usable `max_model_len` (1 to [`MAX_MODEL_LEN`] tokens) of the models
/// in a `/v1/models` body; `Ok(None)` when no entry publishes one.
///
/// # Errors
/// The decoder's message when the body is not a model list.
pub fn parse_max_model_len(body: &str) -> Result<Option<u64>, String> {
    let list: ModelList = serde_json::from_str(body).map_err(|e| e.to_string())?;
    Ok(list
        .data
        .iter()
        .filter_map(|m| m.max_model_len)
        .filter(|len| (1..=MAX_MODEL_LEN).contains(len))
        .min())
}

impl ModelsEndpoint {
    /// Reads the engine's context length with `client` within `timeout`: `Ok(None)`
    /// when the engine answered but publishes none.
    ///
    /// # Errors
    /// Why the read failed: connection, TLS, deadline, a body over
    /// [`MAX_MODELS_BYTES`], a status other than 200, or a body that is no model list.
    pub async fn read(
        &self,
        client: &reqwest::Client,
        timeout: Duration,
    ) -> Result<Option<u64>, String> {
        let (status, body) =
            kv_cluster::http::get_text(client, self.url.clone(), timeout, MAX_MODELS_BYTES)
                .await
                .map_err(|e| e.to_string())?;
        if status != reqwest::StatusCode::OK {
            return Err(format!("http status {status}"));
        }
        parse_max_model_len(&body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smallest_published_length_is_taken() {
        let vllm = r#"{"object":"list","data":[
            {"id":"llama","object":"model","root":"meta/llama","parent":null,"max_model_len":8192,"permission":[]},
            {"id":"adapter","object":"model","root":"/a","parent":"llama","max_model_len":4096}]}"#;
        assert_eq!(parse_max_model_len(vllm), Ok(Some(4096)));
        let none = r#"{"object":"list","data":[{"id":"m","object":"model"},{"id":"n","max_model_len":null}]}"#;
        assert_eq!(parse_max_model_len(none), Ok(None));
        let nonsense =
            r#"{"data":[{"id":"m","max_model_len":0},{"id":"n","max_model_len":99999999999999}]}"#;
        assert_eq!(parse_max_model_len(nonsense), Ok(None), "out of range");
        for bad in ["", "[]", r#"{"data":[{"max_model_len":"4096"}]}"#, "<html>"] {
            assert!(parse_max_model_len(bad).is_err(), "{bad}");
        }
    }
}
