//! The subcommands of the one binary declare the cluster flags they share from one
//! place (`kv_cluster::args`), so they cannot drift apart: same flag, environment
//! variable, default and help heading in `serve` and in `relay`, and one
//! `--namespace` in every subcommand that takes it.

use clap::{Args as _, Command};
use kv_cluster::args::{EtcdArgs, NatsArgs};
use router_daemon::config::serve_command;

/// Every NATS and etcd flag exists in `serve` and in `relay` with the same
/// environment variable, default and help heading (its TOML table in `serve`).
#[test]
fn serve_and_relay_declare_the_same_connection_flags() {
    let serve = serve_command();
    let relay = kv_relay::RelayArgs::augment_args(Command::new("relay"));
    let shared = NatsArgs::augment_args(EtcdArgs::augment_args(Command::new("t")));
    let mut count = 0;
    for arg in shared.get_arguments() {
        let long = arg
            .get_long()
            .expect("every connection flag is a long flag");
        let env = arg.get_env().expect("every connection flag has a variable");
        assert!(
            env.to_string_lossy().starts_with("KV_ROUTER_NATS_")
                || env.to_string_lossy().starts_with("KV_ROUTER_ETCD_"),
            "{env:?}"
        );
        for command in [&serve, &relay] {
            let same = command
                .get_arguments()
                .find(|a| a.get_long() == Some(long))
                .unwrap_or_else(|| panic!("--{long} missing in {}", command.get_name()));
            assert_eq!(same.get_env(), Some(env), "--{long}");
            assert_eq!(same.get_default_values(), arg.get_default_values());
            assert_eq!(same.get_help_heading(), arg.get_help_heading());
        }
        count += 1;
    }
    assert_eq!(count, 17);
}

/// `--namespace` is one flag everywhere: the same environment variable, default and
/// help in `serve`, `relay`, `gateway` and `security nats-users`; under `Cluster`
/// (`serve`'s config file table) in the commands that group their flags.
#[test]
fn every_subcommand_declares_the_same_namespace_flag() {
    let commands = [
        (serve_command(), Some("Cluster")),
        (
            kv_relay::RelayArgs::augment_args(Command::new("relay")),
            Some("Cluster"),
        ),
        (
            kv_gateway::GatewayArgs::augment_args(Command::new("gateway")),
            Some("Cluster"),
        ),
        (
            kv_cluster::security::cli::NatsUsersArgs::augment_args(Command::new("nats-users")),
            None,
        ),
    ];
    let mut helps = Vec::new();
    for (command, heading) in &commands {
        let name = command.get_name();
        let arg = command
            .get_arguments()
            .find(|a| a.get_long() == Some("namespace"))
            .unwrap_or_else(|| panic!("--namespace missing in {name}"));
        assert_eq!(
            arg.get_env().and_then(|e| e.to_str()),
            Some("KV_ROUTER_NAMESPACE"),
            "{name}"
        );
        let defaults: Vec<_> = arg.get_default_values().iter().collect();
        assert_eq!(defaults, ["kv-router"], "{name}");
        assert_eq!(arg.get_help_heading(), *heading, "{name}");
        helps.push(arg.get_help().map(ToString::to_string));
    }
    helps.dedup();
    assert_eq!(helps.len(), 1, "the help of --namespace differs: {helps:?}");
}
