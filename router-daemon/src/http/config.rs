//! The `[http]` flags of `kv-router serve` and the [`DaemonHttpConfig`] they validate into.
//!
//! Default binds, and why:
//! - `--http-listen 0.0.0.0:9090`: `/metrics` and `/health/*` are read from outside
//!   the pod or container (Prometheus, the kubelet's probes, a load balancer's
//!   health check), so they listen on every interface. They reveal counts and
//!   health, not the cluster's layout.
//! - `--http-debug-listen 127.0.0.1:9095`: `/debug/workers` names every worker, its
//!   etcd lease and its load. It is served on loopback only, reachable on the host
//!   or through `kubectl port-forward`, not by anyone who can reach port 9090.
//!
//! Every listener closes a connection that has not delivered a request's headers
//! within `--http-header-read-timeout-ms` (from accept, or from the head's first byte
//! on a keep-alive connection) and serves at most `--http-max-connections` at once,
//! closing idle ones first to make room (`kv_cluster::http::serve`).

use clap::Args;
use kv_cluster::http::{DEFAULT_HEADER_READ_TIMEOUT_MS, ListenAddr, ServerLimits};
use std::net::SocketAddr;
use std::num::NonZeroUsize;

/// Where `/debug/*` is served (`--http-debug-listen`): an address, `main` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DebugListen {
    /// On the main endpoint (`--http-listen`), beside `/metrics` and `/health/*`.
    Main,
    /// On a listener of its own at this address.
    Separate(SocketAddr),
    /// Nowhere: `/debug/*` answers 404.
    Off,
}

/// A `--http-debug-listen` value that is neither an address, `main` nor `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected an address (host:port), `main` or `off`, got {0:?}")]
pub struct DebugListenError(String);

impl std::str::FromStr for DebugListen {
    type Err = DebugListenError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("main") {
            Ok(Self::Main)
        } else if s.eq_ignore_ascii_case("off") {
            Ok(Self::Off)
        } else {
            s.parse()
                .map(Self::Separate)
                .map_err(|_| DebugListenError(s.to_owned()))
        }
    }
}

impl std::fmt::Display for DebugListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Main => f.write_str("main"),
            Self::Separate(addr) => write!(f, "{addr}"),
            Self::Off => f.write_str("off"),
        }
    }
}

/// The `[http]` flags of `kv-router serve`.
#[derive(Debug, Clone, Args)]
pub struct DaemonHttpArgs {
    /// Address of the HTTP endpoint (/metrics, /health/livez, /health/readyz), or
    /// `off`. Every interface by default: Prometheus and health probes come from
    /// outside the pod.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_ROUTER_HTTP_LISTEN",
        default_value = "0.0.0.0:9090"
    )]
    pub http_listen: ListenAddr,
    /// Where /debug/workers is served: an address of its own (loopback by default:
    /// it names every worker, lease and load), `main` (on --http-listen) or `off`.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_ROUTER_HTTP_DEBUG_LISTEN",
        default_value = "127.0.0.1:9095"
    )]
    pub http_debug_listen: DebugListen,
    /// Time a connection has to deliver a request's headers, in ms, from accept, or
    /// from the head's first byte on a kept-alive connection; then it is closed
    /// (idle ones are closed after 600 s, or first at the cap).
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_ROUTER_HTTP_HEADER_READ_TIMEOUT_MS",
        default_value_t = DEFAULT_HEADER_READ_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub http_header_read_timeout_ms: u64,
    /// Most connections served at once per listener; more wait in the listen backlog.
    #[arg(
        long,
        help_heading = "HTTP",
        env = "KV_ROUTER_HTTP_MAX_CONNECTIONS",
        default_value = "256"
    )]
    pub http_max_connections: NonZeroUsize,
}

/// Settings of the HTTP endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DaemonHttpConfig {
    /// Listen address (`off`: no endpoint). Default `0.0.0.0:9090`.
    pub listen: ListenAddr,
    /// Where `/debug/*` is served. Default `127.0.0.1:9095`.
    pub debug: DebugListen,
    /// Header-read, idle and body timeouts and connection cap of every listener.
    pub limits: ServerLimits,
}

impl DaemonHttpArgs {
    /// The endpoint's settings (every value was checked when it was parsed).
    pub(crate) fn to_config(&self) -> DaemonHttpConfig {
        DaemonHttpConfig {
            listen: self.http_listen,
            debug: self.http_debug_listen,
            limits: ServerLimits::from_flags(
                self.http_header_read_timeout_ms,
                self.http_max_connections,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_listen_values() {
        assert_eq!("main".parse(), Ok(DebugListen::Main));
        assert_eq!(" OFF ".parse(), Ok(DebugListen::Off));
        let addr: DebugListen = "127.0.0.1:9095".parse().unwrap();
        assert_eq!(
            addr,
            DebugListen::Separate("127.0.0.1:9095".parse().unwrap())
        );
        assert_eq!(addr.to_string(), "127.0.0.1:9095");
        let err = "loopback".parse::<DebugListen>().unwrap_err();
        assert!(err.to_string().contains("`main` or `off`"), "{err}");
    }

    #[test]
    fn defaults_and_zero_limits() {
        let args =
            kv_cluster::args::parse_flags::<DaemonHttpArgs, _, _>(["kv-router"]).expect("no flags");
        let config = args.to_config();
        assert_eq!(config.listen.to_string(), "0.0.0.0:9090");
        assert_eq!(config.debug.to_string(), "127.0.0.1:9095");
        assert_eq!(config.limits.header_read_timeout.as_millis(), 5000);
        assert_eq!(config.limits.max_connections.get(), 256);
        for flag in ["--http-max-connections", "--http-header-read-timeout-ms"] {
            assert!(
                kv_cluster::args::parse_flags::<DaemonHttpArgs, _, _>(["kv-router", flag, "0"])
                    .is_err(),
                "{flag} 0 is refused"
            );
        }
    }
}
