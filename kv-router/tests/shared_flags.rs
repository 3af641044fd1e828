//! The subcommands of the one binary declare the cluster flags they share from one
//! place (`kv_cluster::args`), so they cannot drift apart: same flag, environment
//! variable, default and help heading in `serve` and in `relay`.

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
