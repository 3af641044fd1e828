//! The binary end to end: `kv-router serve` and `kv-router relay` read the same
//! `KV_ROUTER_NATS_*` environment variables into their NATS configuration, and reject
//! the same bad combinations with the same message. No NATS or etcd is needed: every
//! case stops at validation or at loading the credentials file, before any network.

use std::process::Output;

/// Relay flags that are valid on their own (the engine need not exist).
const RELAY: &[&str] = &[
    "relay",
    "--engine-endpoint",
    "tcp://127.0.0.1:1",
    "--worker-id",
    "1",
    "--worker-name",
    "relay-1",
];

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kv-router"))
        .env_clear()
        .envs(env.iter().copied())
        .args(args)
        .output()
        .expect("the kv-router binary runs")
}

fn failure(args: &[&str], env: &[(&str, &str)]) -> String {
    let output = run(args, env);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !output.status.success(),
        "{args:?} {env:?} succeeded: {stderr}"
    );
    stderr
}

#[test]
fn both_commands_reject_the_same_bad_environment() {
    for (env, named) in [
        (
            ("KV_ROUTER_NATS_TLS_CERT", "/s/client.pem"),
            "--nats-tls-key",
        ),
        (
            ("KV_ROUTER_NATS_TLS_KEY", "/s/client-key.pem"),
            "--nats-tls-cert",
        ),
        (("KV_ROUTER_NATS_USER", "router"), "--nats-password"),
        (("KV_ROUTER_NATS_PASSWORD", "hunter2"), "--nats-user"),
    ] {
        for args in [&["serve"][..], RELAY] {
            let stderr = failure(args, &[env]);
            assert!(
                stderr.contains(&format!("invalid {named}: required with")),
                "{} with {env:?}: {stderr}",
                args[0]
            );
            assert!(!stderr.contains("hunter2"), "{stderr}");
        }
    }
}

#[test]
fn the_relay_connects_with_the_credentials_from_the_environment() {
    let stderr = failure(
        RELAY,
        &[("KV_ROUTER_NATS_CREDS", "/nonexistent/relay.creds")],
    );
    assert!(
        stderr.contains("cannot load nats credentials from /nonexistent/relay.creds"),
        "{stderr}"
    );
}

#[test]
fn serve_reads_the_same_environment() {
    let output = run(
        &["config", "print"],
        &[
            ("KV_ROUTER_NATS_CREDS", "/s/router.creds"),
            ("KV_ROUTER_NATS_TLS_CA", "/s/ca.pem"),
        ],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    for line in [
        "creds = \"/s/router.creds\"   # environment KV_ROUTER_NATS_CREDS",
        "tls-ca = \"/s/ca.pem\"   # environment KV_ROUTER_NATS_TLS_CA",
    ] {
        assert!(
            stdout.lines().any(|l| l == line),
            "no `{line}` in\n{stdout}"
        );
    }
}
