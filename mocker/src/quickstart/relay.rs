//! The arguments of the quickstart's `kv-router relay` processes, one per mock worker
//! in vLLM mode, built in one place ([`relay_args`]).

use kv_events::WorkerId;

/// What one relay needs to know about its engine worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RelayTarget {
    /// The worker id the relay registers and publishes as.
    pub(super) worker_id: WorkerId,
    /// The engine's OpenAI HTTP base URL, `http://host:port` (registered for the
    /// gateway; its `/metrics` is scraped for load).
    pub(super) http_url: String,
    /// The engine's ZMQ PUB endpoint, `tcp://host:port`.
    pub(super) publish: String,
    /// The engine's ZMQ replay ROUTER endpoint, `tcp://host:port`.
    pub(super) replay: String,
    /// Tokens per KV block of the engine.
    pub(super) block_size: u32,
    /// KV cache capacity of the engine's rank, in blocks.
    pub(super) total_kv_blocks: u64,
}

/// Load scrape period, in ms: the mock engines publish their load every 100 ms in
/// NATS mode, so the router sees it as fresh through a relay.
const METRICS_INTERVAL_MS: &str = "100";

/// Every argument of `kv-router relay` for `engine`, after `connection` (the NATS,
/// etcd and namespace flags shared with the router).
pub(super) fn relay_args(engine: &RelayTarget, connection: &[&str]) -> Vec<String> {
    let metrics_url = format!("{}/metrics", engine.http_url);
    let mut args: Vec<String> = ["relay"]
        .iter()
        .chain(connection)
        .map(|s| (*s).to_owned())
        .collect();
    args.extend(
        [
            "--engine-endpoint",
            &engine.publish,
            "--replay-endpoint",
            &engine.replay,
            "--engine-url",
            &engine.http_url,
            "--metrics-url",
            &metrics_url,
            "--metrics-interval-ms",
            METRICS_INTERVAL_MS,
        ]
        .map(str::to_owned),
    );
    // --- What the engine itself can tell the relay -------------------------------
    // The relay is about to derive the worker id (from `--worker-name`), the block
    // size and the KV capacity from the engine (its `/metrics` cache_config_info).
    // Then delete this block, and the fields it reads from `RelayTarget`.
    args.extend([
        "--worker-id".to_owned(),
        engine.worker_id.0.to_string(),
        "--block-size".to_owned(),
        engine.block_size.to_string(),
        "--total-kv-blocks".to_owned(),
        engine.total_kv_blocks.to_string(),
    ]);
    // -------------------------------------------------------------------------------
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relay_gets_its_engines_sockets_url_and_identity() {
        let engine = RelayTarget {
            worker_id: WorkerId(3),
            http_url: "http://127.0.0.1:4000".to_owned(),
            publish: "tcp://127.0.0.1:4008".to_owned(),
            replay: "tcp://127.0.0.1:4016".to_owned(),
            block_size: 512,
            total_kv_blocks: 1024,
        };
        let args = relay_args(&engine, &["--namespace", "quickstart"]);
        let flag = |name: &str| {
            let at = args.iter().position(|a| a == name).expect(name);
            args[at + 1].as_str()
        };
        assert_eq!(args[..3], ["relay", "--namespace", "quickstart"]);
        assert_eq!(flag("--engine-endpoint"), "tcp://127.0.0.1:4008");
        assert_eq!(flag("--replay-endpoint"), "tcp://127.0.0.1:4016");
        assert_eq!(flag("--engine-url"), "http://127.0.0.1:4000");
        assert_eq!(flag("--metrics-url"), "http://127.0.0.1:4000/metrics");
        assert_eq!(flag("--worker-id"), "3");
        assert_eq!(flag("--block-size"), "512");
        assert_eq!(flag("--total-kv-blocks"), "1024");
    }
}
