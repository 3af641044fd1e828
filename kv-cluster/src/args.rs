//! The NATS and etcd connection flags, declared once for every participant
//! (`kv-router serve`, `kv-router relay`, the coming gateway).
//!
//! Both commands talk to the same NATS cluster and the same etcd, usually with the
//! same credentials: a relay sidecar and the router daemon can share one environment
//! (a ConfigMap of `KV_ROUTER_NATS_*` / `KV_ROUTER_ETCD_*` variables) and one Secret
//! mount (`.creds` file, token, TLS material). So the flags, their environment
//! variables, defaults and help texts live here, flattened into each command's flags
//! (`serve`'s and `relay`'s), and so does their validation into [`NatsConfig`] and
//! [`EtcdConfig`]: one code path, one set of error messages, whichever command parses
//! them.
//!
//! Each flag's help heading (`NATS`, `etcd`) is its TOML table in `serve`'s
//! configuration file.

use crate::Error;
use crate::etcd::EtcdConfig;
use crate::nats::{ClientCertificate, NatsAuth, NatsConfig, NatsTls};
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

/// How to reach and authenticate to NATS.
#[derive(Debug, Clone, Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated (a cluster's seed list).
    #[arg(
        long,
        help_heading = "NATS",
        env = "KV_ROUTER_NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        value_delimiter = ','
    )]
    pub nats_url: Vec<String>,
    /// NATS credentials file (user JWT + nkey seed, `.creds`).
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// NATS authentication token.
    #[arg(
        long,
        help_heading = "NATS",
        env = "KV_ROUTER_NATS_TOKEN",
        hide_env_values = true
    )]
    pub nats_token: Option<String>,
    /// NATS user name (with --nats-password).
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_USER")]
    pub nats_user: Option<String>,
    /// NATS password (with --nats-user).
    #[arg(
        long,
        help_heading = "NATS",
        env = "KV_ROUTER_NATS_PASSWORD",
        hide_env_values = true
    )]
    pub nats_password: Option<String>,
    /// Root CA (PEM) to verify the NATS servers with, in addition to the system roots.
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS with NATS (with --nats-tls-key).
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_TLS_CERT")]
    pub nats_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --nats-tls-cert.
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_TLS_KEY")]
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse to talk to NATS without TLS.
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_TLS_REQUIRED")]
    pub nats_tls_required: bool,
}

/// How to reach etcd.
#[derive(Debug, Clone, Args)]
pub struct EtcdArgs {
    /// etcd endpoint URL(s), comma-separated.
    #[arg(
        long,
        help_heading = "etcd",
        env = "KV_ROUTER_ETCD_ENDPOINTS",
        default_value = "http://127.0.0.1:2379",
        value_delimiter = ','
    )]
    pub etcd_endpoints: Vec<String>,
    /// etcd connect timeout, in milliseconds.
    #[arg(
        long,
        help_heading = "etcd",
        env = "KV_ROUTER_ETCD_CONNECT_TIMEOUT_MS",
        default_value_t = 5000
    )]
    pub etcd_connect_timeout_ms: u64,
}

fn invalid(field: &'static str, reason: &'static str) -> Error {
    Error::InvalidFlag { field, reason }
}

/// Trims each value and drops empty ones (comma-separated flag lists).
pub fn trimmed(values: &[String]) -> Vec<String> {
    values
        .iter()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect()
}

/// Parses one flag group (a command's flags, or any part of them, such as
/// [`NatsArgs`]) from `args` (the first item is the program name), with the group's
/// environment variables: for programs that embed a participant, and for tests.
///
/// # Errors
/// clap's error for an unknown flag or a value a flag refuses.
pub fn parse_flags<A, I, T>(args: I) -> Result<A, clap::Error>
where
    A: Args + clap::FromArgMatches,
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = A::augment_args(clap::Command::new("kv-router")).try_get_matches_from(args)?;
    A::from_arg_matches(&matches)
}

impl NatsArgs {
    /// NATS servers, authentication (at most one method) and TLS from the flags.
    ///
    /// # Errors
    /// [`Error::InvalidFlag`] naming the flag: no URL, more than one authentication
    /// method, a user without a password (or the reverse), a client certificate
    /// without its key (or the reverse).
    pub fn to_config(&self) -> Result<NatsConfig, Error> {
        let servers = trimmed(&self.nats_url);
        if servers.is_empty() {
            return Err(invalid("nats-url", "at least one url is required"));
        }
        let auth = match (
            &self.nats_creds,
            &self.nats_token,
            &self.nats_user,
            &self.nats_password,
        ) {
            (None, None, None, None) => NatsAuth::None,
            (Some(path), None, None, None) => NatsAuth::CredentialsFile(path.clone()),
            (None, Some(token), None, None) => NatsAuth::Token(token.clone()),
            (None, None, Some(user), Some(password)) => NatsAuth::UserPassword {
                user: user.clone(),
                password: password.clone(),
            },
            (None, None, Some(_), None) => {
                return Err(invalid("nats-password", "required with --nats-user"));
            }
            (None, None, None, Some(_)) => {
                return Err(invalid("nats-user", "required with --nats-password"));
            }
            _ => {
                return Err(invalid(
                    "nats-creds",
                    "choose one of --nats-creds, --nats-token or --nats-user/--nats-password",
                ));
            }
        };
        let client_cert = match (&self.nats_tls_cert, &self.nats_tls_key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(ClientCertificate {
                cert: cert.clone(),
                key: key.clone(),
            }),
            (Some(_), None) => {
                return Err(invalid("nats-tls-key", "required with --nats-tls-cert"));
            }
            (None, Some(_)) => {
                return Err(invalid("nats-tls-cert", "required with --nats-tls-key"));
            }
        };
        Ok(NatsConfig {
            servers,
            auth,
            tls: NatsTls {
                ca_file: self.nats_tls_ca.clone(),
                client_cert,
                required: self.nats_tls_required,
            },
        })
    }
}

impl EtcdArgs {
    /// etcd endpoints and connect timeout from the flags.
    ///
    /// # Errors
    /// [`Error::InvalidFlag`] naming `--etcd-endpoints` when no endpoint is given.
    pub fn to_config(&self) -> Result<EtcdConfig, Error> {
        let endpoints = trimmed(&self.etcd_endpoints);
        if endpoints.is_empty() {
            return Err(invalid(
                "etcd-endpoints",
                "at least one endpoint is required",
            ));
        }
        Ok(EtcdConfig {
            endpoints,
            connect_timeout: Duration::from_millis(self.etcd_connect_timeout_ms),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        etcd: EtcdArgs,
    }

    fn nats(args: &[&str]) -> Result<NatsConfig, Error> {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
            .expect("flags parse")
            .nats
            .to_config()
    }

    #[test]
    fn defaults_are_one_local_server_without_auth_or_tls() {
        let cli = Cli::try_parse_from(["t"]).expect("no flags parse");
        let n = cli.nats.to_config().unwrap();
        assert_eq!(n.servers, ["nats://127.0.0.1:4222"]);
        assert_eq!(n.auth, NatsAuth::None);
        assert_eq!(n.tls, NatsTls::default());
        let e = cli.etcd.to_config().unwrap();
        assert_eq!(e.endpoints, ["http://127.0.0.1:2379"]);
        assert_eq!(e.connect_timeout, Duration::from_secs(5));
    }

    #[test]
    fn each_auth_method_and_tls() {
        let n = nats(&["--nats-creds", "/s/r.creds"]).unwrap();
        assert_eq!(n.auth, NatsAuth::CredentialsFile("/s/r.creds".into()));
        let n = nats(&["--nats-token", "t0k"]).unwrap();
        assert_eq!(n.auth, NatsAuth::Token("t0k".into()));
        let n = nats(&["--nats-user", "u", "--nats-password", "p"]).unwrap();
        assert_eq!(
            n.auth,
            NatsAuth::UserPassword {
                user: "u".into(),
                password: "p".into()
            }
        );
        let n = nats(&[
            "--nats-tls-ca",
            "/s/ca.pem",
            "--nats-tls-cert",
            "/s/c.pem",
            "--nats-tls-key",
            "/s/k.pem",
            "--nats-tls-required",
        ])
        .unwrap();
        assert_eq!(
            n.tls,
            NatsTls {
                ca_file: Some("/s/ca.pem".into()),
                client_cert: Some(ClientCertificate {
                    cert: "/s/c.pem".into(),
                    key: "/s/k.pem".into(),
                }),
                required: true,
            }
        );
    }

    #[test]
    fn bad_combinations_name_the_flag() {
        let err = |args: &[&str]| nats(args).unwrap_err().to_string();
        assert!(err(&["--nats-tls-cert", "c"]).contains("--nats-tls-key"));
        assert!(err(&["--nats-tls-key", "k"]).contains("--nats-tls-cert"));
        assert!(err(&["--nats-user", "u"]).contains("--nats-password"));
        assert!(err(&["--nats-password", "p"]).contains("--nats-user"));
        assert!(err(&["--nats-token", "t", "--nats-creds", "c"]).contains("--nats-creds"));
        assert!(err(&["--nats-url", " , "]).contains("--nats-url"));
        let cli = Cli::try_parse_from(["t", "--etcd-endpoints", ","]).expect("flags parse");
        let err = cli.etcd.to_config().unwrap_err().to_string();
        assert!(err.contains("--etcd-endpoints"), "{err}");
    }
}
