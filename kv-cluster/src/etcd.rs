//! How a participant reaches etcd, and how it waits between attempts when etcd is
//! down.
//!
//! The client connects lazily (the first call finds out whether an endpoint answers)
//! with the configured connect timeout and a TCP keep-alive, so a dead endpoint is
//! noticed instead of waited on forever. Retries wait by one schedule, [`retry_delays`]
//! (100 ms doubling to 5 s), everywhere, so every participant treats an etcd outage the same way.
//!
//! # Security
//! etcd's own TLS and role-based access control do the enforcing (see
//! `docs/security.md`); this module only presents the credentials. [`EtcdTls`] holds
//! PEM material read and checked once when the flags are validated
//! ([`crate::args::EtcdArgs::to_config`]), so a missing or malformed file stops the
//! process at start instead of failing every reconnect; rotating a certificate takes
//! a restart. With [`EtcdCredentials`] the client authenticates on every connect
//! (one extra round trip) and renews its token when etcd expires it. Secrets never
//! appear in `Debug` output or logs.

use crate::Error;
use backon::BackoffBuilder as _;
/// The etcd client type [`connect`] returns, for crates that hold one without depending
/// on `etcd-client` themselves.
pub use etcd_client::Client as EtcdClient;
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How to reach etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Endpoint URLs (all `https://` when [`Self::tls`] is set, none otherwise).
    pub endpoints: Vec<String>,
    /// Timeout of the initial connection, and the bound on each call of the worker
    /// directory.
    pub connect_timeout: Duration,
    /// User name and password for etcd's authentication, if it is enabled.
    pub credentials: Option<EtcdCredentials>,
    /// TLS material; `None` for plain `http://` endpoints.
    pub tls: Option<EtcdTls>,
}

/// An etcd user and its password. `Debug` prints the user only.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdCredentials {
    /// User name.
    pub user: String,
    /// Password.
    pub password: String,
}

impl std::fmt::Debug for EtcdCredentials {
    /// Never prints the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// A PEM file's path and contents, read when the flags were validated. `Debug`
/// prints the path only (the contents may be a private key).
#[derive(Clone, PartialEq, Eq)]
pub struct PemFile {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its contents (one or more PEM blocks).
    pub pem: Vec<u8>,
}

impl std::fmt::Debug for PemFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PemFile").field(&self.path).finish()
    }
}

/// TLS towards etcd: the CA that signed the servers' certificates (system roots are
/// not consulted: etcd clusters use their own CA) and, for mutual TLS, a client
/// certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// Root CA certificate(s).
    pub ca: PemFile,
    /// Client certificate chain and its private key.
    pub client: Option<(PemFile, PemFile)>,
}

impl EtcdConfig {
    /// The etcd client options: timeouts, keep-alive, credentials and TLS.
    pub fn connect_options(&self) -> ConnectOptions {
        crate::http::install_crypto_provider();
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if let Some(credentials) = &self.credentials {
            options = options
                .with_user(credentials.user.clone(), credentials.password.clone())
                .with_auto_token_refresh(true);
        }
        if let Some(tls) = &self.tls {
            let mut config = TlsOptions::new().ca_certificate(Certificate::from_pem(&tls.ca.pem));
            if let Some((cert, key)) = &tls.client {
                config = config.identity(Identity::from_pem(&cert.pem, &key.pem));
            }
            options = options.with_tls(config);
        }
        options
    }
}

/// Connects to etcd: lazily without credentials (the first call finds out whether an
/// endpoint answers); with credentials the connect authenticates at once.
///
/// # Errors
/// [`Error::EtcdConnect`] when the endpoints or options are invalid, or the
/// authentication fails (wrong password, etcd unreachable).
pub async fn connect(config: &EtcdConfig) -> Result<Client, Error> {
    Client::connect(&config.endpoints, Some(config.connect_options()))
        .await
        .map_err(|source| Error::EtcdConnect {
            endpoints: config.endpoints.clone(),
            source,
        })
}

/// First wait between etcd attempts.
pub const RETRY_INITIAL: Duration = Duration::from_millis(100);
/// Longest wait between etcd attempts.
pub const RETRY_MAX: Duration = Duration::from_secs(5);

/// The waits between etcd attempts, without end: [`RETRY_INITIAL`], doubling, at
/// most [`RETRY_MAX`], no jitter (`backon`).
pub fn retry_delays() -> impl Iterator<Item = Duration> + Send {
    backon::ExponentialBuilder::new()
        .with_min_delay(RETRY_INITIAL)
        .with_max_delay(RETRY_MAX)
        .with_factor(2.0)
        .without_max_times()
        .build()
}

/// Waits `delay` unless `shutdown` fires first; returns whether it was cancelled.
pub(crate) async fn wait_or_cancelled(delay: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(delay) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_up_to_their_cap_without_end() {
        // backon multiplies in f32: compare whole milliseconds.
        let delays: Vec<u128> = retry_delays().take(100).map(|d| d.as_millis()).collect();
        assert_eq!(delays.len(), 100);
        assert_eq!(delays[..7], [100, 200, 400, 800, 1600, 3200, 5000]);
        assert_eq!(delays[99], RETRY_MAX.as_millis());
    }

    #[test]
    fn debug_never_prints_secrets() {
        let config = EtcdConfig {
            endpoints: vec!["https://etcd:2379".into()],
            connect_timeout: Duration::from_secs(1),
            credentials: Some(EtcdCredentials {
                user: "router".into(),
                password: "hunter2".into(),
            }),
            tls: Some(EtcdTls {
                ca: PemFile {
                    path: "/s/ca.pem".into(),
                    pem: b"CA-BYTES".to_vec(),
                },
                client: Some((
                    PemFile {
                        path: "/s/c.pem".into(),
                        pem: b"CERT-BYTES".to_vec(),
                    },
                    PemFile {
                        path: "/s/k.pem".into(),
                        pem: b"KEY-BYTES".to_vec(),
                    },
                )),
            }),
        };
        let shown = format!("{config:?}");
        assert!(
            shown.contains("router") && shown.contains("/s/k.pem"),
            "{shown}"
        );
        for secret in ["hunter2", "KEY-BYTES", "CA-BYTES"] {
            assert!(!shown.contains(secret), "{shown}");
        }
    }
}
