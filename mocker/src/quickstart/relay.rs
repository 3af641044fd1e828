//! The arguments of the quickstart's `kv-router relay` processes, one per mock worker
//! in vLLM mode, built in one place ([`relay_args`]).
//!
//! A relay is told where its engine is and a stable name, nothing the engine knows:
//! it claims a worker id derived from the name in etcd, and reads the block size and
//! the KV capacity from the engine's `/metrics` page (`vllm:cache_config_info`), as
//! it would beside a real vLLM.

/// What one relay needs to know about its engine worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RelayTarget {
    /// The worker's stable name (as a pod name would be); its worker id is derived
    /// from it.
    pub(super) name: String,
    /// The engine's OpenAI HTTP base URL, `http://host:port` (registered for the
    /// gateway; its `/metrics` is scraped for load, block size and capacity).
    pub(super) http_url: String,
    /// The engine's ZMQ PUB endpoint, `tcp://host:port`.
    pub(super) publish: String,
    /// The engine's ZMQ replay ROUTER endpoint, `tcp://host:port`.
    pub(super) replay: String,
}

/// Load scrape period, in ms: the mock engines publish their load every 100 ms in
/// NATS mode, so the router sees it as fresh through a relay.
const METRICS_INTERVAL_MS: &str = "100";

/// Every argument of `kv-router relay` for `engine`, after `connection` (the NATS,
/// etcd and namespace flags shared with the router).
pub(super) fn relay_args(engine: &RelayTarget, connection: &[&str]) -> Vec<String> {
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
            "--worker-name",
            &engine.name,
            "--metrics-interval-ms",
            METRICS_INTERVAL_MS,
        ]
        .map(str::to_owned),
    );
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relay_gets_its_engines_sockets_url_and_name_only() {
        let engine = RelayTarget {
            name: "engine-3".to_owned(),
            http_url: "http://127.0.0.1:4000".to_owned(),
            publish: "tcp://127.0.0.1:4008".to_owned(),
            replay: "tcp://127.0.0.1:4016".to_owned(),
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
        assert_eq!(flag("--worker-name"), "engine-3");
        // Nothing the engine publishes: the relay reads it from the engine.
        for learned in ["--worker-id", "--block-size", "--total-kv-blocks"] {
            assert!(!args.iter().any(|a| a == learned), "{learned} in {args:?}");
        }
    }
}
