//! The flags that place a worker in a disaggregated fleet (`--role`,
//! `--kv-transfer`, `--bootstrap-port`), declared once for every participant that
//! registers a worker: `kv-router relay` (beside a vLLM or SGLang engine started as a
//! prefill or decode instance) and `kv-mocker engines`.
//!
//! Why here: the registration's `role` and `kv_transfer` must agree with how the
//! engine was started, and a wrong combination (a decode worker without a transfer
//! protocol, an SGLang prefill worker without its bootstrap port) would be refused by
//! every router when it reads the registration, far from the flag that caused it. So
//! the combination is checked at start, with an error naming the flag
//! ([`DisaggregationArgs::placement`]), by one code path for both commands. Cost:
//! nothing after start-up.

use crate::Error;
use clap::{Args, ValueEnum};
use kv_events::disaggregation::{KvTransfer, TransferProtocol, WorkerRole};

/// `--role`: what the worker does in a disaggregated fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum RoleFlag {
    /// Prefill and decode in one engine: whole requests (an aggregated worker).
    #[default]
    Both,
    /// Prefill only: prompts' KV is computed here and handed to a decode worker.
    Prefill,
    /// Decode, loading prompts' KV from a prefill worker (and whole requests the
    /// router keeps on it).
    Decode,
}

impl From<RoleFlag> for WorkerRole {
    fn from(flag: RoleFlag) -> Self {
        match flag {
            RoleFlag::Both => WorkerRole::Both,
            RoleFlag::Prefill => WorkerRole::Prefill,
            RoleFlag::Decode => WorkerRole::Decode,
        }
    }
}

/// `--kv-transfer`: the protocol of the engine's KV connector, as a frontend sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransferFlag {
    /// vLLM's KV connectors (NIXL, Mooncake, ...): `kv_transfer_params` go from the
    /// prefill worker's answer to the decode worker.
    Vllm,
    /// SGLang's disaggregation: both workers get `bootstrap_host`, `bootstrap_port`
    /// and `bootstrap_room`.
    Sglang,
}

impl From<TransferFlag> for TransferProtocol {
    fn from(flag: TransferFlag) -> Self {
        match flag {
            TransferFlag::Vllm => TransferProtocol::Vllm,
            TransferFlag::Sglang => TransferProtocol::Sglang,
        }
    }
}

/// The worker's place in a disaggregated fleet. `Default` is what no flag gives: an
/// aggregated worker (`both`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Args)]
pub struct DisaggregationArgs {
    /// The worker's role: both (whole requests, the default), prefill (prefill
    /// halves only) or decode (decode halves, and whole requests the router keeps
    /// on it). Must match how the engine was started (vLLM's `kv_role`, SGLang's
    /// `--disaggregation-mode`).
    #[arg(
        long,
        help_heading = "Disaggregation",
        env = "KV_ROUTER_WORKER_ROLE",
        value_enum,
        default_value_t = RoleFlag::Both
    )]
    pub role: RoleFlag,
    /// The engine's KV transfer protocol: vllm (kv_transfer_params, e.g. NIXL) or
    /// sglang (bootstrap host, port and room). Required with --role prefill or
    /// decode.
    #[arg(
        long,
        help_heading = "Disaggregation",
        env = "KV_ROUTER_KV_TRANSFER",
        value_enum
    )]
    pub kv_transfer: Option<TransferFlag>,
    /// The SGLang prefill engine's bootstrap port (its
    /// `--disaggregation-bootstrap-port`, on the host of the registered URL).
    /// Required with --role prefill --kv-transfer sglang; refused otherwise.
    #[arg(
        long,
        help_heading = "Disaggregation",
        env = "KV_ROUTER_BOOTSTRAP_PORT",
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    pub bootstrap_port: Option<u16>,
}

/// The registration fields the flags give: `role` and `kv_transfer` of a
/// [`kv_events::discovery::WorkerRegistration`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerPlacement {
    /// The role registered.
    pub role: WorkerRole,
    /// How a frontend runs a transfer with the worker; `None` for `both`.
    pub kv_transfer: Option<KvTransfer>,
}

fn invalid(field: &'static str, reason: &'static str) -> Error {
    Error::InvalidFlag { field, reason }
}

impl DisaggregationArgs {
    /// The registration's `role` and `kv_transfer`, once the combination is checked.
    ///
    /// # Errors
    /// [`Error::InvalidFlag`] naming the flag: `--kv-transfer` missing with role
    /// prefill or decode, or given with role both; `--bootstrap-port` missing for an
    /// SGLang prefill worker, or given to any other worker (it would register nothing).
    pub fn placement(&self) -> Result<WorkerPlacement, Error> {
        let role = WorkerRole::from(self.role);
        let protocol = match (role, self.kv_transfer) {
            (WorkerRole::Both, None) => {
                if self.bootstrap_port.is_some() {
                    return Err(invalid(
                        "bootstrap-port",
                        "only an sglang prefill worker has one (--role prefill \
                         --kv-transfer sglang)",
                    ));
                }
                return Ok(WorkerPlacement::default());
            }
            (WorkerRole::Both, Some(_)) => {
                return Err(invalid(
                    "kv-transfer",
                    "only a prefill or decode worker transfers kv: add --role prefill or \
                     --role decode, or drop --kv-transfer",
                ));
            }
            (_, None) => {
                return Err(invalid(
                    "kv-transfer",
                    "required with --role prefill or decode: vllm or sglang, the engine's \
                     transfer protocol",
                ));
            }
            (_, Some(flag)) => TransferProtocol::from(flag),
        };
        let bootstrap_port = match (role, protocol, self.bootstrap_port) {
            (WorkerRole::Prefill, TransferProtocol::Sglang, None) => {
                return Err(invalid(
                    "bootstrap-port",
                    "required with --role prefill --kv-transfer sglang: the engine's \
                     --disaggregation-bootstrap-port",
                ));
            }
            (WorkerRole::Prefill, TransferProtocol::Sglang, port) => port,
            (_, _, Some(_)) => {
                return Err(invalid(
                    "bootstrap-port",
                    "only an sglang prefill worker has one (--role prefill \
                     --kv-transfer sglang)",
                ));
            }
            (_, _, None) => None,
        };
        Ok(WorkerPlacement {
            role,
            kv_transfer: Some(KvTransfer {
                protocol,
                bootstrap_port,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_flags;
    use kv_events::WorkerId;
    use kv_events::discovery::WorkerRegistration;

    fn placement(flags: &[&str]) -> Result<WorkerPlacement, Error> {
        let args: DisaggregationArgs =
            parse_flags(std::iter::once("t").chain(flags.iter().copied())).expect("flags parse");
        args.placement()
    }

    fn refused_flag(flags: &[&str]) -> &'static str {
        match placement(flags) {
            Err(Error::InvalidFlag { field, .. }) => field,
            other => panic!("{flags:?} gave {other:?}"),
        }
    }

    /// Each valid combination yields a registration every router accepts.
    #[test]
    fn valid_combinations_register_their_role_and_transfer() {
        assert_eq!(placement(&[]).unwrap(), WorkerPlacement::default());
        let cases = [
            (&["--role", "prefill", "--kv-transfer", "vllm"][..], None),
            (&["--role", "decode", "--kv-transfer", "vllm"][..], None),
            (&["--role", "decode", "--kv-transfer", "sglang"][..], None),
            (
                &[
                    "--role",
                    "prefill",
                    "--kv-transfer",
                    "sglang",
                    "--bootstrap-port",
                    "8998",
                ][..],
                Some(8998),
            ),
        ];
        for (flags, port) in cases {
            let p = placement(flags).unwrap();
            assert_ne!(p.role, WorkerRole::Both, "{flags:?}");
            assert_eq!(p.kv_transfer.and_then(|t| t.bootstrap_port), port);
            let reg = WorkerRegistration {
                worker_id: WorkerId(1),
                dp_size: 1,
                block_size: 16,
                total_kv_blocks: 1,
                url: None,
                epoch: 0,
                max_model_len: None,
                role: p.role,
                kv_transfer: p.kv_transfer,
            };
            assert_eq!(reg.validate(), Ok(()), "{flags:?}");
        }
    }

    #[test]
    fn a_wrong_combination_names_the_flag() {
        assert_eq!(refused_flag(&["--role", "prefill"]), "kv-transfer");
        assert_eq!(refused_flag(&["--role", "decode"]), "kv-transfer");
        assert_eq!(refused_flag(&["--kv-transfer", "vllm"]), "kv-transfer");
        let sglang_prefill = ["--role", "prefill", "--kv-transfer", "sglang"];
        assert_eq!(refused_flag(&sglang_prefill), "bootstrap-port");
        for flags in [
            &["--bootstrap-port", "8998"][..],
            &[
                "--role",
                "prefill",
                "--kv-transfer",
                "vllm",
                "--bootstrap-port",
                "8998",
            ],
            &[
                "--role",
                "decode",
                "--kv-transfer",
                "sglang",
                "--bootstrap-port",
                "8998",
            ],
        ] {
            assert_eq!(refused_flag(flags), "bootstrap-port", "{flags:?}");
        }
        let parse = |flags: &[&str]| {
            parse_flags::<DisaggregationArgs, _, _>(
                std::iter::once("t").chain(flags.iter().copied()),
            )
        };
        assert!(parse(&["--role", "encode"]).is_err(), "no string modes");
        assert!(parse(&["--bootstrap-port", "0"]).is_err(), "port 0");
    }
}
