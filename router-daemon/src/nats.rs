//! The NATS connection: cluster seed list, authentication, TLS, and connection-state
//! reporting.
//!
//! The client (async-nats) reconnects by itself, forever, with a backoff of up to 4 s
//! between attempts, and re-sends every subscription on reconnect, so intake, the
//! route queue group and lifecycle messages resume without the daemon doing anything.
//! What the daemon adds: every connection event is counted
//! (`kv_router_nats_events_total`) and drives `kv_router_nats_connected` and the
//! `nats` readiness check, and the initial connection is retried too
//! (`retry_on_initial_connect`), so a daemon started before NATS reports "not ready"
//! instead of exiting. Messages published while the daemon was disconnected are not
//! delivered to it (core NATS has no replay); the indexer notices the missing event
//! ids and recovers them (see `indexer/README.md`).

use crate::health::Health;
use futures::{Stream, StreamExt};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How the daemon authenticates to NATS. At most one method.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// A `.creds` file: user JWT and nkey seed (NATS decentralized auth).
    CredentialsFile(PathBuf),
    /// A shared token.
    Token(String),
    /// User name and password.
    UserPassword {
        /// User name.
        user: String,
        /// Password.
        password: String,
    },
}

impl std::fmt::Debug for NatsAuth {
    /// Never prints a secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NatsAuth::None => f.write_str("None"),
            NatsAuth::CredentialsFile(p) => f.debug_tuple("CredentialsFile").field(p).finish(),
            NatsAuth::Token(_) => f.write_str("Token(<redacted>)"),
            NatsAuth::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .field("password", &"<redacted>")
                .finish(),
        }
    }
}

/// A client certificate and its private key, PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCertificate {
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
}

/// TLS settings. With none set, TLS is still used when a server URL is `tls://` or the
/// server requires it, verified against the system's root certificates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// Extra root CA (PEM) to verify the servers with.
    pub ca_file: Option<PathBuf>,
    /// Client certificate for mutual TLS.
    pub client_cert: Option<ClientCertificate>,
    /// Refuse to connect without TLS.
    pub required: bool,
}

/// How to reach NATS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsConfig {
    /// Server URLs (a cluster's seed list); the client picks among them and learns the
    /// rest of the cluster from the servers.
    pub servers: Vec<String>,
    /// Authentication.
    pub auth: NatsAuth,
    /// TLS.
    pub tls: NatsTls,
}

/// Errors building the NATS connection.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// The credentials file could not be read or parsed.
    #[error("cannot load nats credentials from {path}: {source}")]
    Credentials {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The client refused the options (bad URL, bad TLS material, ...).
    #[error("cannot connect to nats at {servers:?}: {source}")]
    Connect {
        /// The seed list.
        servers: Vec<String>,
        /// The cause.
        source: async_nats::ConnectError,
    },
}

impl NatsConfig {
    /// The client options for this config, without the event callback.
    ///
    /// # Errors
    /// [`NatsError::Credentials`] when the credentials file cannot be loaded.
    pub async fn connect_options(
        &self,
        name: &str,
    ) -> Result<async_nats::ConnectOptions, NatsError> {
        let mut options = match &self.auth {
            NatsAuth::None => async_nats::ConnectOptions::new(),
            NatsAuth::CredentialsFile(path) => {
                async_nats::ConnectOptions::with_credentials_file(path)
                    .await
                    .map_err(|source| NatsError::Credentials {
                        path: path.clone(),
                        source,
                    })?
            }
            NatsAuth::Token(token) => async_nats::ConnectOptions::with_token(token.clone()),
            NatsAuth::UserPassword { user, password } => {
                async_nats::ConnectOptions::with_user_and_password(user.clone(), password.clone())
            }
        };
        if let Some(ca) = &self.tls.ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let Some(cc) = &self.tls.client_cert {
            options = options.add_client_certificate(cc.cert.clone(), cc.key.clone());
        }
        if self.tls.required {
            options = options.require_tls(true);
        }
        Ok(options.name(name))
    }

    /// Connects to this config's servers as client `name`, with its authentication
    /// and TLS ([`Self::connect_options`]) and whatever `adjust` adds (retry, event
    /// callback). The one way both `serve` and `relay` connect.
    ///
    /// # Errors
    /// [`NatsError`] when the options are unusable (unreadable credentials, bad URL)
    /// or, unless `adjust` asks to retry the initial connection, when no server
    /// answers.
    pub async fn connect_with(
        &self,
        name: &str,
        adjust: impl FnOnce(async_nats::ConnectOptions) -> async_nats::ConnectOptions,
    ) -> Result<async_nats::Client, NatsError> {
        adjust(self.connect_options(name).await?)
            .connect(self.servers.clone())
            .await
            .map_err(|source| NatsError::Connect {
                servers: self.servers.clone(),
                source,
            })
    }
}

/// Connects to NATS for the daemon: the client reports every connection event to
/// `health`, and keeps retrying the initial connection in the background (the
/// returned client queues commands until then).
///
/// # Errors
/// [`NatsError`] when the options are unusable (unreadable credentials, bad URL).
pub async fn connect(
    config: &NatsConfig,
    health: Arc<Health>,
) -> Result<async_nats::Client, NatsError> {
    config
        .connect_with("kv-router", |options| {
            options
                .retry_on_initial_connect()
                .event_callback(move |event| {
                    let health = health.clone();
                    async move { health.nats_event(&event) }
                })
        })
        .await
}

/// How long a subscription drain may take at shutdown before its remaining messages
/// are given up (the connection is down, so the server will not confirm).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// The messages of `subscriber` until `stop` is cancelled, then — instead of dropping
/// what is buffered or still on the wire — a drain: the daemon unsubscribes, the server
/// confirms with a round trip, and every message the server had sent before that is
/// still yielded; then the stream ends. This is what lets shutdown answer every route
/// query the daemon received, and apply every KV event it received. If the drain
/// cannot complete (connection down) the stream ends after [`DRAIN_TIMEOUT`].
pub fn drain_on_cancel(
    subscriber: async_nats::Subscriber,
    stop: CancellationToken,
) -> impl Stream<Item = async_nats::Message> + Send {
    futures::stream::unfold(
        (subscriber, stop, false),
        |(mut sub, stop, draining)| async move {
            if draining {
                let next = tokio::time::timeout(DRAIN_TIMEOUT, sub.next()).await;
                return next.ok().flatten().map(|m| (m, (sub, stop, true)));
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => {
                    if let Err(e) = sub.drain().await {
                        tracing::warn!(error = %e, "cannot drain a subscription; dropping its buffered messages");
                        return None;
                    }
                    let next = tokio::time::timeout(DRAIN_TIMEOUT, sub.next()).await;
                    next.ok().flatten().map(|m| (m, (sub, stop, true)))
                }
                m = sub.next() => m.map(|m| (m, (sub, stop, false))),
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_prints_secrets() {
        let token = format!("{:?}", NatsAuth::Token("s3cret".into()));
        assert!(!token.contains("s3cret"), "{token}");
        let up = format!(
            "{:?}",
            NatsAuth::UserPassword {
                user: "router".into(),
                password: "hunter2".into()
            }
        );
        assert!(up.contains("router") && !up.contains("hunter2"), "{up}");
    }

    #[tokio::test]
    async fn missing_credentials_file_is_named() {
        let config = NatsConfig {
            servers: vec!["nats://127.0.0.1:1".into()],
            auth: NatsAuth::CredentialsFile("/nonexistent/router.creds".into()),
            tls: NatsTls::default(),
        };
        let err = config.connect_options("t").await.unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/router.creds"),
            "{err}"
        );
    }
}
