//! The gateway's forwarding flags: what engines receive, and the retries and
//! deadlines of each request on its way there and back.

use clap::{ArgAction, Args, ValueEnum};

/// What the engine receives as the prompt of a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PromptForward {
    /// The token ids the router hashed (vLLM accepts a list of ints as `prompt`), so
    /// the engine caches exactly the blocks the router predicted: parity by
    /// construction.
    Tokens,
    /// The client's text, re-tokenized by the engine; parity then rests on both
    /// sides using the same tokenizer.
    Text,
}

/// How a chat completion reaches the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ChatForward {
    /// Rendered and tokenized here, sent to the engine's `/v1/completions` as token
    /// ids, and the answer turned back into chat shape. Parity by construction; gives
    /// up the engine's tool-call and reasoning parsers (a request with `tools` is
    /// refused in this mode).
    Tokens,
    /// Sent unchanged to the engine's `/v1/chat/completions`: everything the engine
    /// does for chats keeps working; parity rests on the engine rendering the same
    /// template as the gateway.
    Passthrough,
}

/// How the chosen data-parallel rank is named to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineApi {
    /// vLLM: the `X-data-parallel-rank` request header.
    Vllm,
    /// SGLang: the `data_parallel_rank` field of the request body.
    Sglang,
}

/// What engines receive, retries and deadlines.
#[derive(Debug, Clone, Args)]
pub struct ForwardArgs {
    /// What a completion's engine request carries as its prompt.
    #[arg(long, help_heading = "Forwarding", env = "KV_GATEWAY_FORWARD", value_enum, default_value_t = PromptForward::Tokens)]
    pub forward: PromptForward,
    /// How chat completions reach the engine.
    #[arg(long, help_heading = "Forwarding", env = "KV_GATEWAY_CHAT_FORWARD", value_enum, default_value_t = ChatForward::Tokens)]
    pub chat_forward: ChatForward,
    /// The engines' API, for naming the data-parallel rank.
    #[arg(long, help_heading = "Forwarding", env = "KV_GATEWAY_ENGINE_API", value_enum, default_value_t = EngineApi::Vllm)]
    pub engine_api: EngineApi,
    /// Ask the router for a prefill worker too (`allow_disaggregation`): in a fleet
    /// with `prefill` workers, a request the router disaggregates runs its prefill
    /// there and its decode on the routed worker (docs/disaggregation.md). `false`:
    /// every request runs whole on one worker, never on a `prefill` worker.
    #[arg(long, help_heading = "Forwarding", env = "KV_GATEWAY_DISAGGREGATION", default_value_t = true, action = ArgAction::Set)]
    pub disaggregation: bool,
    /// Other workers tried when the chosen engine refuses the connection or fails
    /// before its first token.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_MAX_RETRIES",
        default_value_t = 2
    )]
    pub max_retries: u32,
    /// How long a routing query may take, in ms (above the router's queue wait,
    /// 5000 ms by default, so a queued request is answered rather than timed out),
    /// including a wait for the NATS connection and the asks of a query that finds
    /// no router subscribed.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ROUTE_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub route_timeout_ms: u64,
    /// Most lifecycle messages sent to the router in one NATS message (a batch of
    /// the messages queued when the publisher wakes; it never waits to fill one).
    /// `1` sends each on its own, the only form routers older than the batch form
    /// read: set it while any of them still serves (docs/protocol.md, "Lifecycle").
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_LIFECYCLE_BATCH",
        default_value_t = kv_events::limits::MAX_LIFECYCLE_BATCH,
        value_parser = lifecycle_batch
    )]
    pub lifecycle_batch: usize,
    /// Most route queries sent to the router in one NATS message. Queries that
    /// arrive while one of this gateway's is being answered wait for that answer (at
    /// most `--route-batch-hold-ms`) and leave together as one `route_batch`, which
    /// one router replica places seeing each query's booking (docs/gateway.md, "Route
    /// grouping"). `1` sends each on its own; above the router's `--max-route-batch`
    /// a batch is refused and asked again query by query.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ROUTE_BATCH",
        default_value_t = 32,
        value_parser = route_batch
    )]
    pub route_batch: usize,
    /// Longest a route query waits for the answer to the gateway's previous group
    /// before it leaves, in ms (0: it waits for nothing; queries queued together
    /// still leave together).
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ROUTE_BATCH_HOLD_MS",
        default_value_t = 2
    )]
    pub route_batch_hold_ms: u64,
    /// How long, in ms, this gateway sends its route queries to the router replica
    /// that answered one, before the queue group picks a replica again: that replica
    /// then places each query seeing this gateway's earlier bookings at once, not a
    /// replica sync later (docs/gateway.md, "Replica affinity"). `0`: every query
    /// through the queue group. A replica that is gone, slow (see
    /// `--route-affinity-patience-ms`) or overloaded is let go at once.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ROUTE_AFFINITY_MS",
        default_value_t = 1_000
    )]
    pub route_affinity_ms: u64,
    /// How long, in ms, a route query may go unanswered before the gateway suspects a
    /// stalled router replica: a pin to the replica it went to is let go (the next
    /// queries go through the queue group), and the replicas are pinged; if one stays
    /// silent for as long while another answers, the query is asked again of the one
    /// that answered, under a fresh request id (docs/gateway.md, "A replica that
    /// stalls"). Otherwise the query waits up to `--route-timeout-ms`. Nothing is
    /// pinged or asked again with `--route-affinity-ms 0`.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ROUTE_AFFINITY_PATIENCE_MS",
        default_value_t = 250,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub route_affinity_patience_ms: u64,
    /// Which router replica the gateway pins to once a query through the queue group
    /// is answered: `lowest`, the lowest replica id it has heard from and not found
    /// gone, silent, overloaded or slow, so that gateways agree on one replica and a
    /// burst spread over them is placed by one replica; `answered`, the replica that
    /// answered, spreading gateways over replicas (docs/gateway.md, "Replica
    /// affinity").
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ROUTE_AFFINITY_TARGET",
        value_enum,
        default_value_t = crate::router::PinTarget::Lowest
    )]
    pub route_affinity_target: crate::router::PinTarget,
    /// How long connecting to an engine may take, in ms.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ENGINE_CONNECT_TIMEOUT_MS",
        default_value_t = 2_000
    )]
    pub engine_connect_timeout_ms: u64,
    /// How long an idle connection to an engine is kept for reuse, in ms: below the
    /// engine's own keep-alive (vLLM's and SGLang's uvicorn: 5 s), so the gateway never
    /// sends a request onto a connection the engine is closing.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_ENGINE_IDLE_TIMEOUT_MS",
        default_value_t = 4_000,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub engine_idle_timeout_ms: u64,
    /// How long an engine may take to send a request's first token, in ms, from
    /// when it is sent there. Then the request is routed again without that worker
    /// (up to `--max-retries`), as for an engine that refused it; nothing has reached
    /// the client yet. Raise it for prompts whose prefill alone takes longer. It also
    /// bounds each attempt of `--tokenize-via engine` or `render` (504 after the last).
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_FIRST_TOKEN_TIMEOUT_MS",
        default_value_t = 60_000
    )]
    pub first_token_timeout_ms: u64,
    /// Longest silence between two events of an engine's stream after its first
    /// token, in ms. Then the engine is taken as hung: a streaming client gets an
    /// error event and `[DONE]`; a client that did not stream (and so has seen
    /// nothing) gets its request routed again without that worker.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_STREAM_IDLE_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub stream_idle_timeout_ms: u64,
    /// How long one request may take from routing to its last token, in seconds.
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_REQUEST_TIMEOUT_S",
        default_value_t = 600
    )]
    pub request_timeout_s: u64,
    /// Interval of `keep_alive` lifecycle messages for a running request, in seconds
    /// (well under the router's `--request-ttl-ms`, 600 s by default).
    #[arg(
        long,
        help_heading = "Forwarding",
        env = "KV_GATEWAY_KEEP_ALIVE_S",
        default_value_t = 120
    )]
    pub keep_alive_s: u64,
}

/// Parses `--route-batch`: 1 to [`crate::router::MAX_GROUP`].
fn route_batch(value: &str) -> Result<usize, String> {
    let max = crate::router::MAX_GROUP;
    match value.parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!("expected a number of queries from 1 to {max}")),
    }
}

/// Parses `--lifecycle-batch`: 1 to [`kv_events::limits::MAX_LIFECYCLE_BATCH`].
fn lifecycle_batch(value: &str) -> Result<usize, String> {
    let max = kv_events::limits::MAX_LIFECYCLE_BATCH;
    match value.parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!("expected a number of messages from 1 to {max}")),
    }
}
