//! A completion through the gateway, with the response headers that say where it
//! went (the disaggregation tests' view of a request).

/// What a client of the gateway got, and where the gateway says it went.
pub struct Routed {
    /// The HTTP status.
    pub status: u16,
    /// The worker that served it (the decode worker of a disaggregated request).
    pub worker: Option<String>,
    /// The worker that prefilled a disaggregated request.
    pub prefill: Option<String>,
    /// The router's disaggregation decision.
    pub decision: Option<String>,
    /// The body.
    pub text: String,
}

/// POSTs a completion of `tokens` for `max_tokens` tokens to the gateway at `base`,
/// streamed or not, and reads the whole answer (within 30 s).
pub async fn complete(
    http: &reqwest::Client,
    base: &str,
    tokens: &[u32],
    stream: bool,
    max_tokens: u32,
) -> Routed {
    use kv_gateway::flow::{DISAGGREGATION_HEADER, PREFILL_WORKER_HEADER, WORKER_HEADER};
    let wait = std::time::Duration::from_secs(30);
    let body = serde_json::json!({"model": super::fixture::MODEL, "prompt": tokens, "max_tokens": max_tokens, "stream": stream});
    let response = http
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send();
    let response = tokio::time::timeout(wait, response)
        .await
        .expect("the gateway answers in time")
        .expect("the gateway answers");
    let header = |name: &str| {
        let value = response.headers().get(name)?;
        Some(value.to_str().expect("an ascii header").to_owned())
    };
    let (worker, prefill) = (header(WORKER_HEADER), header(PREFILL_WORKER_HEADER));
    let (status, decision) = (response.status().as_u16(), header(DISAGGREGATION_HEADER));
    let text = tokio::time::timeout(wait, response.text())
        .await
        .expect("the body ends in time")
        .expect("the body is read");
    Routed {
        status,
        worker,
        prefill,
        decision,
        text,
    }
}
