//! The binary end to end: the config file, the environment and the flags layered in
//! that order by `kv-router config print`, and a bad file stopping `kv-router serve`
//! with the key named. No NATS or etcd is needed: every case stops before the network.

/// A file setting values that the environment and the flags partly override.
const FILE: &str = r#"
[nats]
url = ["nats://a:4222", "nats://b:4222"]

[etcd]
connect-timeout-ms = 1234

[cluster]
block-size = 16
namespace = "from-file"

[scheduler]
policy = "kv"
"#;

/// The binary end to end: `kv-router config print` with a file, an environment
/// variable and a flag setting overlapping values.
#[test]
fn the_binary_layers_file_then_environment_then_flags() {
    let path = std::env::temp_dir().join(format!("kv-router-config-{}.toml", std::process::id()));
    std::fs::write(&path, FILE).unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kv-router"))
        .env_clear()
        .env("KV_ROUTER_BLOCK_SIZE", "32")
        .env("KV_ROUTER_NAMESPACE", "from-env")
        .args(["config", "print", "--config"])
        .arg(&path)
        .args(["--policy", "random", "--namespace", "from-flag"])
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let file_note = format!("# config file {}", path.display());
    for (line, note) in [
        (
            "url = [\"nats://a:4222\", \"nats://b:4222\"]",
            file_note.as_str(),
        ),
        ("block-size = 32", "# environment KV_ROUTER_BLOCK_SIZE"),
        ("namespace = \"from-flag\"", "# command line"),
        ("policy = \"random\"", "# command line"),
        ("connect-timeout-ms = 1234", file_note.as_str()),
        ("max-inflight-routes = 256", "# default"),
    ] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(line) && l.ends_with(note)),
            "no `{line} ... {note}` in\n{stdout}"
        );
    }

    // A bad file stops it with the key named.
    let bad = std::env::temp_dir().join(format!("kv-router-bad-{}.toml", std::process::id()));
    std::fs::write(&bad, "[etcd]\nendpoint = \"x\"\n").unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kv-router"))
        .env_clear()
        .env("KV_ROUTER_CONFIG", &bad)
        .args(["serve"])
        .output()
        .unwrap();
    std::fs::remove_file(&bad).unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("unknown setting `etcd.endpoint`"),
        "{stderr}"
    );
}
