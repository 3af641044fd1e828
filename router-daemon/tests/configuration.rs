//! The configuration layers (TOML file < environment < flags), their errors, the
//! `config print` round trip, and `docs/configuration.md` against the flags.

use clap::FromArgMatches;
use router_daemon::config::file::{
    ConfigFile, ConfigFileError, effective_toml, locate, reference_markdown,
};
use router_daemon::config::{DaemonConfig, ServeArgs, serve_command};
use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

const BEGIN: &str = "<!-- BEGIN GENERATED: kv-router config reference -->\n";
const END: &str = "<!-- END GENERATED -->";

fn parse(text: &str) -> Result<ConfigFile, ConfigFileError> {
    ConfigFile::parse(Path::new("test.toml"), text, &serve_command())
}

fn config(file: &ConfigFile, argv: &[&str]) -> DaemonConfig {
    let matches = file
        .apply(serve_command())
        .try_get_matches_from(std::iter::once("serve").chain(argv.iter().copied()))
        .expect("flags parse");
    let args = ServeArgs::from_arg_matches(&matches).expect("matches are serve args");
    DaemonConfig::from_args(&args).expect("valid configuration")
}

const FILE: &str = r#"
[nats]
url = ["nats://a:4222", "nats://b:4222"]
tls-required = true

[etcd]
connect-timeout-ms = 1234

[cluster]
block-size = 16

[scheduler]
policy = "round-robin"
"#;

#[test]
fn file_values_are_used_where_nothing_overrides_them() {
    let file = parse(FILE).unwrap();
    let from_file = config(&file, &[]);
    assert_eq!(from_file.nats.servers, ["nats://a:4222", "nats://b:4222"]);
    assert!(from_file.nats.tls.required);
    assert_eq!(from_file.etcd.connect_timeout, Duration::from_millis(1234));
    assert_eq!(from_file.route.block_size.map(|b| b.get()), Some(16));
    assert_eq!(from_file.scheduler.policy.kind().to_string(), "round-robin");
    let flags = config(
        &file,
        &["--policy", "random", "--etcd-connect-timeout-ms", "99"],
    );
    assert_eq!(flags.scheduler.policy.kind().to_string(), "random");
    assert_eq!(flags.etcd.connect_timeout, Duration::from_millis(99));
    assert_eq!(flags.nats.servers, from_file.nats.servers);
}

#[test]
fn bad_files_name_the_key_and_the_file() {
    let unknown = parse("[nats]\nulr = \"x\"\n").unwrap_err();
    assert_eq!(
        unknown.to_string(),
        "unknown setting `nats.ulr` in config file test.toml"
    );
    let top = parse("policy = \"kv\"\n").unwrap_err();
    assert!(top.to_string().contains("`policy`"), "{top}");
    let bad = parse("[cluster]\nblock-size = \"big\"\n").unwrap_err();
    let text = bad.to_string();
    assert!(
        text.contains("`cluster.block-size` (--block-size)") && text.contains("test.toml"),
        "{text}"
    );
    let list = parse("[cluster]\nnamespace = [\"a\", \"b\"]\n").unwrap_err();
    assert!(list.to_string().contains("single value"), "{list}");
    let flag = parse("[nats]\ntls-required = \"yes\"\n").unwrap_err();
    assert!(flag.to_string().contains("true or false"), "{flag}");
    let nested = parse("[nats.tls]\nca = \"x\"\n").unwrap_err();
    assert!(nested.to_string().contains("nats.tls"), "{nested}");
    assert!(matches!(
        parse("[nats\n"),
        Err(ConfigFileError::Parse { .. })
    ));
    // Valid per key, invalid together: reported by validation, naming the flag.
    let file = parse("[cluster]\nblock-size = 0\n").unwrap();
    let matches = file
        .apply(serve_command())
        .try_get_matches_from(["serve"])
        .unwrap();
    let args = ServeArgs::from_arg_matches(&matches).unwrap();
    let err = DaemonConfig::from_args(&args).unwrap_err();
    assert!(err.to_string().contains("--block-size"), "{err}");
}

#[test]
fn printed_configuration_loads_back_to_the_same_settings() {
    let file = parse(FILE).unwrap();
    let command = file.apply(serve_command());
    let matches = command
        .clone()
        .try_get_matches_from([
            "serve",
            "--nats-token",
            "s3cret",
            "--etcd-user",
            "router",
            "--etcd-password",
            "hunter2",
            "--shards",
            "3",
        ])
        .unwrap();
    let printed = effective_toml(&serve_command(), &matches, Some(&file));
    assert!(
        printed.contains("block-size = 16   # config file test.toml"),
        "{printed}"
    );
    assert!(printed.contains("shards = 3   # command line"), "{printed}");
    assert!(printed.contains("policy = \"round-robin\""), "{printed}");
    assert!(!printed.contains("s3cret") && printed.contains("token = \"<redacted>\""));
    assert!(!printed.contains("hunter2") && printed.contains("password = \"<redacted>\""));

    // Without the secret (redacted), the printed file reproduces every setting.
    let reloadable: String = printed
        .lines()
        .filter(|l| !l.contains("<redacted>"))
        .map(|l| format!("{l}\n"))
        .collect();
    let again = parse(&reloadable).unwrap();
    let matches_again = again
        .apply(serve_command())
        .try_get_matches_from(["serve"])
        .unwrap();
    let strip = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| !l.contains("<redacted>") && !l.starts_with('#'))
            .map(|l| l.split("   #").next().unwrap_or_default().to_owned())
            .collect()
    };
    let reprinted = effective_toml(&serve_command(), &matches_again, Some(&again));
    assert_eq!(strip(&printed), strip(&reprinted));
}

#[test]
fn the_config_flag_is_found_before_parsing() {
    let argv = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
    assert_eq!(
        locate(&argv(&["kv-router", "serve", "--config", "/etc/a.toml"])),
        Some("/etc/a.toml".into())
    );
    assert_eq!(
        locate(&argv(&[
            "kv-router",
            "serve",
            "--config=/etc/b.toml",
            "--shards",
            "2"
        ])),
        Some("/etc/b.toml".into())
    );
    assert_eq!(
        locate(&argv(&["kv-router", "serve", "--", "--config", "x"])),
        None
    );
}

#[test]
fn every_setting_has_a_table_and_an_environment_variable() {
    let command = serve_command();
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if matches!(long, "help" | "config") {
            continue;
        }
        assert!(
            arg.get_help_heading().is_some(),
            "--{long} has no TOML table (help heading)"
        );
        let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
        assert_eq!(
            env,
            Some(format!(
                "KV_ROUTER_{}",
                long.to_ascii_uppercase().replace('-', "_")
            )),
            "--{long} has the wrong environment variable"
        );
    }
}

#[test]
fn docs_configuration_md_matches_the_flags() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let start = doc.find(BEGIN).expect("begin marker") + BEGIN.len();
    let end = doc.find(END).expect("end marker");
    let generated = reference_markdown(&serve_command());
    if std::env::var_os("UPDATE_DOCS").is_some() {
        let updated = format!("{}{}{}", &doc[..start], generated, &doc[end..]);
        std::fs::write(&path, updated).unwrap();
        return;
    }
    assert!(
        doc[start..end] == generated,
        "docs/configuration.md is out of date with the flags; regenerate with \
         UPDATE_DOCS=1 cargo test -p router-daemon --test configuration"
    );
}

#[test]
fn the_shipped_example_file_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/systemd/kv-router.toml");
    let file = ConfigFile::load(&path, &serve_command()).unwrap();
    let config = config(&file, &[]);
    assert_eq!(config.http.listen.to_string(), "127.0.0.1:9090");
    assert_eq!(config.route.block_size, None);
}
