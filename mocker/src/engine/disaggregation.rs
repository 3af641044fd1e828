//! `kv-mocker engines` in a disaggregated fleet: the role flags every registering
//! participant shares (`--role`, `--kv-transfer`, `--bootstrap-port`, from
//! [`kv_cluster::args::DisaggregationArgs`]) and the mock's own: what a KV transfer
//! costs (`--transfer-ms-per-token`, the model's [`KvTransferConfig`]) and how long
//! an SGLang decode worker waits for its prefill (`--bootstrap-timeout-ms`).
//!
//! Every worker of one process takes the same role. An SGLang prefill worker `i`
//! serves its bootstrap endpoint on `--bootstrap-port` + `i` and registers that port.
//! What each role does with a request is in `http::transfer`; the flags cost
//! nothing after start-up.

use super::config::EngineConfigError;
use engine_model::KvTransferConfig;
use kv_cluster::args::{DisaggregationArgs, WorkerPlacement};
use kv_events::disaggregation::{KvTransfer, TransferProtocol, WorkerRole};
use std::time::Duration;

/// Default `--bootstrap-timeout-ms`: how long an SGLang decode worker waits for the
/// prefill worker of its bootstrap room, in ms.
pub const DEFAULT_BOOTSTRAP_TIMEOUT_MS: u64 = 30_000;

/// The disaggregation flags of `kv-mocker engines`.
#[derive(Debug, Clone, Copy, PartialEq, clap::Args)]
pub struct EngineDisaggregationArgs {
    /// The workers' role and transfer protocol, registered with each worker.
    #[command(flatten)]
    pub placement: DisaggregationArgs,
    /// The cost of pulling a prompt's KV over the transfer (decode workers).
    #[command(flatten, next_help_heading = "Disaggregation")]
    pub transfer: KvTransferConfig,
    /// How long an SGLang decode worker waits for the prefill worker of a request's
    /// bootstrap room, in ms; past it the request fails (as SGLang's decode aborts
    /// a failed transfer).
    #[arg(
        long,
        help_heading = "Disaggregation",
        default_value_t = DEFAULT_BOOTSTRAP_TIMEOUT_MS,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub bootstrap_timeout_ms: u64,
}

impl Default for EngineDisaggregationArgs {
    fn default() -> Self {
        Self {
            placement: DisaggregationArgs::default(),
            transfer: KvTransferConfig::default(),
            bootstrap_timeout_ms: DEFAULT_BOOTSTRAP_TIMEOUT_MS,
        }
    }
}

/// The validated disaggregation settings of every worker of the process.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DisaggregationConfig {
    /// The role and transfer protocol; an SGLang prefill worker's `bootstrap_port`
    /// here is the first worker's ([`Self::for_worker`] gives each its own).
    pub placement: WorkerPlacement,
    /// The transfer's cost.
    pub transfer: KvTransferConfig,
    /// An SGLang decode worker's wait for its bootstrap room.
    pub bootstrap_timeout: Duration,
}

impl EngineDisaggregationArgs {
    /// The settings, once the flags' combination and the transfer cost are checked.
    ///
    /// # Errors
    /// [`EngineConfigError::Placement`] naming the flag of a wrong role combination,
    /// [`EngineConfigError::Model`] for a bad transfer time.
    pub fn validate(&self) -> Result<DisaggregationConfig, EngineConfigError> {
        let placement = self
            .placement
            .placement()
            .map_err(|e| EngineConfigError::Placement(e.to_string()))?;
        self.transfer.validate()?;
        Ok(DisaggregationConfig {
            placement,
            transfer: self.transfer,
            bootstrap_timeout: Duration::from_millis(self.bootstrap_timeout_ms),
        })
    }
}

impl DisaggregationConfig {
    /// Worker `index`'s registration fields: an SGLang prefill worker's bootstrap
    /// port is the flag's plus `index`.
    ///
    /// # Errors
    /// [`EngineConfigError::BootstrapPortOverflow`] past port 65535.
    pub fn for_worker(&self, index: usize) -> Result<WorkerPlacement, EngineConfigError> {
        let Some(transfer) = self.placement.kv_transfer else {
            return Ok(self.placement);
        };
        let bootstrap_port = match transfer.bootstrap_port {
            None => None,
            Some(base) => Some(
                u16::try_from(index)
                    .ok()
                    .and_then(|i| base.checked_add(i))
                    .ok_or(EngineConfigError::BootstrapPortOverflow {
                        base,
                        workers: index + 1,
                    })?,
            ),
        };
        Ok(WorkerPlacement {
            role: self.placement.role,
            kv_transfer: Some(KvTransfer {
                protocol: transfer.protocol,
                bootstrap_port,
            }),
        })
    }

    /// The role of every worker.
    pub fn role(&self) -> WorkerRole {
        self.placement.role
    }

    /// The transfer protocol, for a prefill or decode worker.
    pub fn protocol(&self) -> Option<TransferProtocol> {
        self.placement.kv_transfer.map(|t| t.protocol)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(extra: &[&str]) -> EngineDisaggregationArgs {
        let args = std::iter::once("kv-mocker").chain(extra.iter().copied());
        kv_cluster::args::parse_flags(args).expect("flags parse")
    }

    fn sglang_prefill(port: &str) -> DisaggregationConfig {
        let args = ["--role", "prefill", "--kv-transfer", "sglang"];
        flags(&[&args[..], &["--bootstrap-port", port]].concat())
            .validate()
            .expect("valid")
    }

    #[test]
    fn each_sglang_prefill_worker_gets_its_own_bootstrap_port() {
        let config = sglang_prefill("9000");
        let port = |i| {
            config
                .for_worker(i)
                .expect("in range")
                .kv_transfer
                .and_then(|t| t.bootstrap_port)
        };
        assert_eq!((port(0), port(3)), (Some(9000), Some(9003)));
        assert!(matches!(
            sglang_prefill("65535").for_worker(1),
            Err(EngineConfigError::BootstrapPortOverflow { .. })
        ));
        let aggregated = flags(&[]).validate().expect("valid");
        assert_eq!(
            aggregated.for_worker(5).expect("no port"),
            WorkerPlacement::default()
        );
        let err = flags(&["--role", "decode"]).validate();
        let err = err.expect_err("no transfer protocol").to_string();
        assert!(err.contains("--kv-transfer"), "{err}");
    }
}
