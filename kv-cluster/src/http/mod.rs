//! A participant's HTTP plumbing: the listen-address flag value ([`ListenAddr`],
//! `ADDR` or `off`), the one way every HTTP server of the cluster serves its
//! connections ([`serve`], bounded by [`ServerLimits`]), the client side around
//! reqwest ([`get_text`], [`read_body`]: deadlines and byte bounds), and the reader of
//! the Prometheus text pages those endpoints serve ([`exposition`]).
//!
//! # Layout
//! - [`server`]: [`serve`] and [`ServerLimits`]: header-read, idle keep-alive and
//!   request body deadlines, and the connection cap (closing idle connections first),
//!   for the daemon's, the gateway's, the relay's and the mock engine's servers alike.
//! - `connection` (private): one connection's record and the watchdog that closes it.
//! - `request` (private): requests counted in flight, bodies under deadlines
//!   ([`BodyTimeout`]), answers marked for what the connection does next.
//! - [`client`](mod@client): reqwest clients with the process's one crypto provider
//!   ([`client_builder`]), bounded body reads ([`read_body`]) and [`get_text`].
//! - [`exposition`]: the samples of a Prometheus text page ([`metric_sample`]).

pub mod client;
mod connection;
pub mod exposition;
mod limits;
mod request;
pub mod server;

pub use client::{
    MAX_RESPONSE_BYTES, client, client_builder, get_once, get_text, install_crypto_provider,
    read_body,
};
pub use exposition::metric_sample;
pub use limits::{
    BodyTimeouts, DEFAULT_BODY_IDLE_TIMEOUT_MS, DEFAULT_BODY_READ_TIMEOUT_MS,
    DEFAULT_HEADER_READ_TIMEOUT_MS, DEFAULT_IDLE_TIMEOUT_S, ServerLimits,
};
pub use request::BodyTimeout;
pub use server::serve;

use std::net::SocketAddr;

/// Where an HTTP endpoint listens: a socket address, or `off` (case-insensitive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddr(pub Option<SocketAddr>);

impl std::str::FromStr for ListenAddr {
    type Err = std::net::AddrParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("off") {
            Ok(Self(None))
        } else {
            s.trim().parse().map(|a| Self(Some(a)))
        }
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(addr) => write!(f, "{addr}"),
            None => f.write_str("off"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addr_parses_addresses_and_off() {
        let on: ListenAddr = "127.0.0.1:9090".parse().unwrap();
        assert_eq!(on.to_string(), "127.0.0.1:9090");
        let off: ListenAddr = "OFF".parse().unwrap();
        assert_eq!(off, ListenAddr(None));
        assert_eq!(off.to_string(), "off");
        assert!("nine-thousand".parse::<ListenAddr>().is_err());
    }
}
