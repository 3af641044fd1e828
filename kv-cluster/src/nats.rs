//! How a participant reaches NATS: the cluster seed list, authentication (at most one
//! method) and TLS, turned into async-nats connect options.
//!
//! Every kv-router process (daemon, relay, mock engines, gateway) connects the same
//! way, so a credentials file or a TLS setting behaves identically everywhere; each
//! adds its own retry policy and event callback through [`NatsConfig::connect_with`].
//! The client (async-nats) reconnects by itself, forever, with a backoff of up to 4 s
//! between attempts, and re-sends every subscription on reconnect.

use crate::Error;
use std::path::PathBuf;

/// How a participant authenticates to NATS. At most one method.
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
    /// Prefix of this client's reply inboxes; `None`: async-nats' `_INBOX`.
    pub inbox_prefix: Option<String>,
}

impl NatsConfig {
    /// The client options for this config, without the event callback.
    ///
    /// # Errors
    /// [`Error::NatsCredentials`] when the credentials file cannot be loaded.
    pub async fn connect_options(&self, name: &str) -> Result<async_nats::ConnectOptions, Error> {
        crate::http::install_crypto_provider();
        let mut options = match &self.auth {
            NatsAuth::None => async_nats::ConnectOptions::new(),
            NatsAuth::CredentialsFile(path) => {
                async_nats::ConnectOptions::with_credentials_file(path)
                    .await
                    .map_err(|source| Error::NatsCredentials {
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
        if let Some(prefix) = &self.inbox_prefix {
            options = options.custom_inbox_prefix(prefix.clone());
        }
        Ok(options.name(name))
    }

    /// Connects to this config's servers as client `name`, with its authentication
    /// and TLS ([`Self::connect_options`]) and whatever `adjust` adds (retry, event
    /// callback). The one way every participant connects.
    ///
    /// # Errors
    /// [`Error`] when the options are unusable (unreadable credentials, bad URL)
    /// or, unless `adjust` asks to retry the initial connection, when no server
    /// answers.
    pub async fn connect_with(
        &self,
        name: &str,
        adjust: impl FnOnce(async_nats::ConnectOptions) -> async_nats::ConnectOptions,
    ) -> Result<async_nats::Client, Error> {
        adjust(self.connect_options(name).await?)
            .connect(self.servers.clone())
            .await
            .map_err(|source| Error::NatsConnect {
                servers: self.servers.clone(),
                source,
            })
    }
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
            inbox_prefix: None,
        };
        let err = config.connect_options("t").await.unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/router.creds"),
            "{err}"
        );
    }
}
