//! The `Limits` flags: the bounds every reader of the protocol puts on messages from
//! NATS and records from etcd ([`kv_events::limits::Limits`]), declared once for the
//! daemon (which applies all of them) and the gateway (which reads registrations).
//!
//! Their help heading, `Limits`, is their TOML table in `serve`'s configuration file.
//! A value of 0 is refused: it would refuse every message.

use crate::Error;
use clap::Args;
use kv_events::limits::Limits;

/// Bounds on messages and registrations; see [`Limits`] for why each default fits.
#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Largest NATS payload decoded, in bytes; a longer one is refused unread.
    #[arg(long, help_heading = "Limits", env = "KV_ROUTER_MAX_MESSAGE_BYTES", default_value_t = Limits::default().max_message_bytes)]
    pub max_message_bytes: usize,
    /// Largest `dp_size` a worker may register, in ranks.
    #[arg(long, help_heading = "Limits", env = "KV_ROUTER_MAX_DP_SIZE", default_value_t = Limits::default().max_dp_size)]
    pub max_dp_size: u32,
    /// Largest KV capacity of one rank, in blocks (registrations and load metrics).
    #[arg(long, help_heading = "Limits", env = "KV_ROUTER_MAX_KV_BLOCKS", default_value_t = Limits::default().max_kv_blocks)]
    pub max_kv_blocks: u64,
    /// Longest prompt of a route request or a replica's booking, in tokens.
    #[arg(long, help_heading = "Limits", env = "KV_ROUTER_MAX_ROUTE_TOKENS", default_value_t = Limits::default().max_route_tokens)]
    pub max_route_tokens: u64,
    /// Most events in one KV event batch.
    #[arg(long, help_heading = "Limits", env = "KV_ROUTER_MAX_BATCH_EVENTS", default_value_t = Limits::default().max_batch_events)]
    pub max_batch_events: usize,
    /// Most blocks one KV event batch stores or removes, over all its events.
    #[arg(long, help_heading = "Limits", env = "KV_ROUTER_MAX_BATCH_BLOCKS", default_value_t = Limits::default().max_batch_blocks)]
    pub max_batch_blocks: usize,
}

impl LimitArgs {
    /// The limits, each above 0.
    ///
    /// # Errors
    /// [`Error::InvalidFlag`] naming the first flag that is 0.
    pub fn to_limits(&self) -> Result<Limits, Error> {
        let limits = Limits {
            max_message_bytes: self.max_message_bytes,
            max_dp_size: self.max_dp_size,
            max_kv_blocks: self.max_kv_blocks,
            max_route_tokens: self.max_route_tokens,
            max_batch_events: self.max_batch_events,
            max_batch_blocks: self.max_batch_blocks,
        };
        for (field, value) in [
            ("max-message-bytes", limits.max_message_bytes as u64),
            ("max-dp-size", u64::from(limits.max_dp_size)),
            ("max-kv-blocks", limits.max_kv_blocks),
            ("max-route-tokens", limits.max_route_tokens),
            ("max-batch-events", limits.max_batch_events as u64),
            ("max-batch-blocks", limits.max_batch_blocks as u64),
        ] {
            if value == 0 {
                return Err(Error::InvalidFlag {
                    field,
                    reason: "must be above 0: it would refuse every message",
                });
            }
        }
        Ok(limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_flags;

    #[test]
    fn defaults_are_the_protocol_defaults_and_zero_is_refused() {
        let args: LimitArgs = parse_flags(["kv-router"]).expect("defaults parse");
        assert_eq!(args.to_limits().expect("valid"), Limits::default());
        let args: LimitArgs = parse_flags([
            "kv-router",
            "--max-dp-size",
            "8",
            "--max-route-tokens",
            "4096",
        ])
        .expect("flags parse");
        let limits = args.to_limits().expect("valid");
        assert_eq!((limits.max_dp_size, limits.max_route_tokens), (8, 4096));
        let zero: LimitArgs =
            parse_flags(["kv-router", "--max-batch-blocks", "0"]).expect("flags parse");
        assert!(
            matches!(
                zero.to_limits(),
                Err(Error::InvalidFlag {
                    field: "max-batch-blocks",
                    ..
                })
            ),
            "zero refused"
        );
    }
}
