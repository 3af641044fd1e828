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

/// `kv-router config print` with [`FILE`] as the config file, only the environment
/// `env` and the flags `flags`: its output, and the note a value from the file has.
fn config_print(env: &[(&str, &str)], flags: &[&str]) -> (String, String) {
    let path = std::env::temp_dir().join(format!(
        "kv-router-config-{}-{}.toml",
        std::process::id(),
        flags.len()
    ));
    std::fs::write(&path, FILE).expect("the temporary directory is writable");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kv-router"))
        .env_clear()
        .envs(env.iter().copied())
        .args(["config", "print", "--config"])
        .arg(&path)
        .args(flags)
        .output()
        .expect("the kv-router binary runs");
    std::fs::remove_file(&path).expect("the file written above");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    (stdout, format!("# config file {}", path.display()))
}

/// The binary end to end: `kv-router config print` with a file, an environment
/// variable and a flag setting overlapping values.
#[test]
fn the_binary_layers_file_then_environment_then_flags() {
    let (stdout, file_note) = config_print(
        &[
            ("KV_ROUTER_BLOCK_SIZE", "32"),
            ("KV_ROUTER_NAMESPACE", "from-env"),
        ],
        &["--policy", "random", "--namespace", "from-flag"],
    );
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

/// The namespace from the config file's `[cluster]` table when neither the
/// environment nor a flag sets it.
#[test]
fn the_namespace_comes_from_the_config_file() {
    let (stdout, note) = config_print(&[], &[]);
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("namespace = \"from-file\"") && l.ends_with(&note)),
        "{stdout}"
    );
}
