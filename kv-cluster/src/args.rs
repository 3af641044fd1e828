//! The cluster flags (NATS and etcd connection, namespace), declared once for every
//! participant (`kv-router serve`, `relay`, `gateway`, `security nats-users`).
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
//! configuration file. The namespace ([`NamespaceArgs`]) has no heading of its own:
//! `serve`, `relay` and `gateway` flatten it under `Cluster` (`serve`'s `[cluster]`
//! table), `security nats-users` among its few options.
//!
//! The worker's place in a disaggregated fleet ([`DisaggregationArgs`]: `--role`,
//! `--kv-transfer`, `--bootstrap-port`) is declared here too, for the two commands
//! that register workers (`relay` and `kv-mocker engines`).

use crate::Error;
use crate::etcd::{EtcdConfig, EtcdCredentials, EtcdTls, PemFile};
use crate::nats::{ClientCertificate, NatsAuth, NatsConfig, NatsTls};
use clap::Args;
use kv_events::{Namespace, NamespaceError};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::time::Duration;

mod disaggregation;

pub use disaggregation::{DisaggregationArgs, RoleFlag, TransferFlag, WorkerPlacement};

/// The default NATS server (`--nats-url`).
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
/// The default etcd endpoint (`--etcd-endpoints`).
pub const DEFAULT_ETCD_ENDPOINT: &str = "http://127.0.0.1:2379";
/// The default etcd connect timeout (`--etcd-connect-timeout-ms`), in milliseconds.
pub const DEFAULT_ETCD_CONNECT_TIMEOUT_MS: u64 = 5000;

/// How to reach and authenticate to NATS. `Default` is what no flag gives: the
/// local server, no authentication, no TLS.
#[derive(Debug, Clone, Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated (a cluster's seed list).
    #[arg(
        long,
        help_heading = "NATS",
        env = "KV_ROUTER_NATS_URL",
        default_value = DEFAULT_NATS_URL,
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
    /// Prefix of this client's reply inboxes [default: `_INBOX`]. With the shipped
    /// NATS permissions each user may only subscribe to its own `_INBOX.<user>`, so
    /// it cannot read other clients' replies (docs/security.md).
    #[arg(long, help_heading = "NATS", env = "KV_ROUTER_NATS_INBOX_PREFIX")]
    pub nats_inbox_prefix: Option<String>,
}

/// How to reach etcd. `Default` is what no flag gives: the local endpoint, no
/// authentication, no TLS.
#[derive(Debug, Clone, Args)]
pub struct EtcdArgs {
    /// etcd endpoint URL(s), comma-separated.
    #[arg(
        long,
        help_heading = "etcd",
        env = "KV_ROUTER_ETCD_ENDPOINTS",
        default_value = DEFAULT_ETCD_ENDPOINT,
        value_delimiter = ','
    )]
    pub etcd_endpoints: Vec<String>,
    /// etcd connect timeout, in milliseconds.
    #[arg(
        long,
        help_heading = "etcd",
        env = "KV_ROUTER_ETCD_CONNECT_TIMEOUT_MS",
        default_value_t = DEFAULT_ETCD_CONNECT_TIMEOUT_MS
    )]
    pub etcd_connect_timeout_ms: u64,
    /// etcd user name, when etcd has authentication enabled (with --etcd-password).
    #[arg(long, help_heading = "etcd", env = "KV_ROUTER_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// etcd password (with --etcd-user).
    #[arg(
        long,
        help_heading = "etcd",
        env = "KV_ROUTER_ETCD_PASSWORD",
        hide_env_values = true
    )]
    pub etcd_password: Option<String>,
    /// CA certificate (PEM) that signed etcd's server certificates; required with
    /// `https://` endpoints (system roots are not used).
    #[arg(long, help_heading = "etcd", env = "KV_ROUTER_ETCD_TLS_CA")]
    pub etcd_tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS with etcd (with --etcd-tls-key).
    #[arg(long, help_heading = "etcd", env = "KV_ROUTER_ETCD_TLS_CERT")]
    pub etcd_tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --etcd-tls-cert.
    #[arg(long, help_heading = "etcd", env = "KV_ROUTER_ETCD_TLS_KEY")]
    pub etcd_tls_key: Option<PathBuf>,
}

/// The namespace every participant of one cluster shares (`--namespace`,
/// `KV_ROUTER_NAMESPACE`): the prefix of every NATS subject and etcd key, so several
/// clusters can share one NATS and one etcd.
#[derive(Debug, Clone, Args)]
pub struct NamespaceArgs {
    /// Namespace of every subject and etcd key (letters, digits, '_' and '-').
    #[arg(long, env = "KV_ROUTER_NAMESPACE", default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,
}

/// The default namespace (`--namespace`).
pub const DEFAULT_NAMESPACE: &str = "kv-router";

impl NamespaceArgs {
    /// The validated namespace. Each command reports the error its own way, naming
    /// `--namespace`.
    ///
    /// # Errors
    /// [`NamespaceError`] for an empty, over-long or non-token namespace.
    pub fn get(&self) -> Result<Namespace, NamespaceError> {
        Namespace::new(self.namespace.as_str())
    }
}

impl Default for NatsArgs {
    fn default() -> Self {
        Self {
            nats_url: vec![DEFAULT_NATS_URL.to_owned()],
            nats_creds: None,
            nats_token: None,
            nats_user: None,
            nats_password: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
            nats_tls_required: false,
            nats_inbox_prefix: None,
        }
    }
}

impl Default for EtcdArgs {
    fn default() -> Self {
        Self {
            etcd_endpoints: vec![DEFAULT_ETCD_ENDPOINT.to_owned()],
            etcd_connect_timeout_ms: DEFAULT_ETCD_CONNECT_TIMEOUT_MS,
            etcd_user: None,
            etcd_password: None,
            etcd_tls_ca: None,
            etcd_tls_cert: None,
            etcd_tls_key: None,
        }
    }
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
        let inbox_prefix = match &self.nats_inbox_prefix {
            None => None,
            Some(prefix) if is_subject(prefix) => Some(prefix.clone()),
            Some(_) => {
                return Err(invalid(
                    "nats-inbox-prefix",
                    "must be dot-separated tokens without spaces or wildcards",
                ));
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
            inbox_prefix,
        })
    }
}

/// Whether `s` is a literal NATS subject: non-empty tokens separated by `.`, without
/// wildcards or whitespace.
fn is_subject(s: &str) -> bool {
    s.split('.').all(|token| {
        !token.is_empty()
            && token
                .chars()
                .all(|c| !c.is_whitespace() && c != '*' && c != '>')
    })
}

impl EtcdArgs {
    /// etcd endpoints, connect timeout, credentials and TLS from the flags; the TLS
    /// files are read and checked here, so a bad one stops the process at start.
    /// An endpoint without a scheme gets `https://` with --etcd-tls-ca, `http://`
    /// without.
    ///
    /// # Errors
    /// [`Error::InvalidFlag`] naming the flag: no endpoint, a user without a password
    /// (or the reverse), a client certificate without its key (or the reverse) or
    /// without --etcd-tls-ca. [`Error::InvalidEndpoint`] for an `https://` endpoint
    /// without --etcd-tls-ca, an `http://` one with it, or another scheme.
    /// [`Error::TlsFile`] for a file that cannot be read or holds no PEM
    /// certificate (key).
    pub fn to_config(&self) -> Result<EtcdConfig, Error> {
        let endpoints = trimmed(&self.etcd_endpoints);
        if endpoints.is_empty() {
            return Err(invalid(
                "etcd-endpoints",
                "at least one endpoint is required",
            ));
        }
        let credentials = match (&self.etcd_user, &self.etcd_password) {
            (None, None) => None,
            (Some(user), Some(password)) => Some(EtcdCredentials {
                user: user.clone(),
                password: password.clone(),
            }),
            (Some(_), None) => {
                return Err(invalid("etcd-password", "required with --etcd-user"));
            }
            (None, Some(_)) => {
                return Err(invalid("etcd-user", "required with --etcd-password"));
            }
        };
        let client = match (&self.etcd_tls_cert, &self.etcd_tls_key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((cert, key)),
            (Some(_), None) => {
                return Err(invalid("etcd-tls-key", "required with --etcd-tls-cert"));
            }
            (None, Some(_)) => {
                return Err(invalid("etcd-tls-cert", "required with --etcd-tls-key"));
            }
        };
        let tls = match (&self.etcd_tls_ca, client) {
            (None, None) => None,
            (None, Some(_)) => {
                return Err(invalid("etcd-tls-ca", "required with --etcd-tls-cert"));
            }
            (Some(ca), client) => Some(EtcdTls {
                ca: read_pem("etcd-tls-ca", ca, Pem::Certificate)?,
                client: client
                    .map(|(cert, key)| {
                        Ok::<_, Error>((
                            read_pem("etcd-tls-cert", cert, Pem::Certificate)?,
                            read_pem("etcd-tls-key", key, Pem::PrivateKey)?,
                        ))
                    })
                    .transpose()?,
            }),
        };
        let endpoints = endpoints
            .into_iter()
            .map(|e| with_scheme(e, tls.is_some()))
            .collect::<Result<_, _>>()?;
        Ok(EtcdConfig {
            endpoints,
            connect_timeout: Duration::from_millis(self.etcd_connect_timeout_ms),
            credentials,
            tls,
        })
    }
}

/// `endpoint` as `scheme://host[:port]`, the scheme matching whether TLS is
/// configured; an endpoint without one (`host:port`) gets it. Parsed with `url`: a
/// scheme other than `http`/`https`, no host, or a path is refused.
fn with_scheme(endpoint: String, tls: bool) -> Result<String, Error> {
    let refuse = |reason| {
        Err(Error::InvalidEndpoint {
            endpoint: endpoint.clone(),
            reason,
        })
    };
    // `host:port` parses as a URL of scheme `host` without a host: no scheme given.
    let url = match url::Url::parse(&endpoint).ok().filter(url::Url::has_host) {
        Some(url) => url,
        None => match url::Url::parse(&format!(
            "{}://{endpoint}",
            if tls { "https" } else { "http" }
        )) {
            Ok(url) if url.has_host() => url,
            _ => return refuse("is not host:port or an http:// or https:// URL"),
        },
    };
    match (url.scheme(), tls) {
        ("https", true) | ("http", false) => {}
        ("https", false) => {
            return refuse(
                "https:// needs --etcd-tls-ca, the CA that signed etcd's server certificate",
            );
        }
        ("http", true) => {
            return refuse("is plain http:// but etcd TLS is configured; use https://");
        }
        _ => return refuse("must start with http:// or https://"),
    }
    if url.path() != "/" || url.query().is_some() {
        return refuse("must be scheme://host:port, without a path");
    }
    Ok(url.origin().ascii_serialization())
}

/// What a PEM file must hold.
#[derive(Clone, Copy)]
enum Pem {
    /// One or more certificates.
    Certificate,
    /// One private key.
    PrivateKey,
}

/// Reads `path` (given by `--flag`) and checks that it holds what `kind` says.
fn read_pem(flag: &'static str, path: &Path, kind: Pem) -> Result<PemFile, Error> {
    let refuse = |reason: String| Error::TlsFile {
        flag,
        path: path.to_owned(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| refuse(e.to_string()))?;
    match kind {
        Pem::Certificate => {
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| refuse(format!("not a pem certificate: {e}")))?;
            if certs.is_empty() {
                return Err(refuse("holds no pem certificate".to_owned()));
            }
        }
        Pem::PrivateKey => {
            PrivateKeyDer::from_pem_slice(&pem)
                .map_err(|e| refuse(format!("not a pem private key: {e}")))?;
        }
    }
    Ok(PemFile {
        path: path.to_owned(),
        pem,
    })
}

#[cfg(test)]
mod tests;
