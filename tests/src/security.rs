//! A secured cluster for the trust-model tests (`tests/tests/security.rs`).
//!
//! nats-server runs the shipped `deploy/security/nats-server.conf`, with the users
//! [`nats_authorization`] generates next to it (literal passwords
//! instead of environment variables). etcd serves mutual TLS with certificates made
//! at test time ([`Pki`], rcgen), and has authentication enabled with the roles and
//! users the shipped `deploy/security/etcd-rbac.sh` creates ([`ETCD_USERS`]). Every
//! user's password is [`password`]`(user)`.

use anyhow::Context as _;
use kv_cluster::security::{NatsUser, Role, nats_authorization};
use kv_events::{Namespace, Subjects, WorkerId};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use std::path::PathBuf;
use tempfile::TempDir;
use testbed::{EtcdServer, EtcdServerTls, NatsServer};
use tokio::io::AsyncWriteExt as _;
use tokio::sync::mpsc;

/// The router user (NATS role router, etcd reader).
pub const ROUTER: &str = "router-1";
/// The frontend user (NATS role frontend, etcd reader).
pub const FRONTEND: &str = "gateway-1";
/// The relay user of worker 7.
pub const RELAY_7: &str = "relay-7";
/// The mock engine user of workers 1 and 2.
pub const ENGINES: &str = "engines";
/// The operator user (full NATS access; no etcd user).
pub const OPERATOR: &str = "admin";
/// The etcd superuser.
pub const ROOT: &str = "root";

/// The NATS users and their roles.
pub fn nats_users() -> Vec<(&'static str, Role)> {
    vec![
        (ROUTER, Role::Router),
        (RELAY_7, Role::Worker(vec![WorkerId(7)])),
        (ENGINES, Role::Worker(vec![WorkerId(1), WorkerId(2)])),
        (FRONTEND, Role::Frontend),
        (OPERATOR, Role::Operator),
    ]
}

/// The etcd users: `etcd-rbac.sh` arguments after the command.
pub const ETCD_USERS: &[&[&str]] = &[
    &["reader", ROUTER],
    &["reader", FRONTEND],
    &["worker", RELAY_7, "7"],
    &["worker", ENGINES, "1", "2"],
];

/// Every test user's password.
pub fn password(user: &str) -> String {
    format!("{user}-secret")
}

/// A CA, an etcd server certificate for 127.0.0.1 and a client certificate signed by
/// it, and a client certificate from another CA; PEM files in a temporary directory.
pub struct Pki {
    dir: TempDir,
}

fn ca(name: &str) -> anyhow::Result<CertifiedIssuer<'static, KeyPair>> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(CertifiedIssuer::self_signed(params, KeyPair::generate()?)?)
}

impl Pki {
    /// Generates the certificates.
    ///
    /// # Errors
    /// Key generation, signing or file errors.
    pub fn generate() -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("kv-router-pki-")
            .tempdir()?;
        let write = |name: &str, pem: String| std::fs::write(dir.path().join(name), pem);
        let issue = |ca: &CertifiedIssuer<'static, KeyPair>,
                     names: Vec<String>,
                     cn: &str,
                     file: &str|
         -> anyhow::Result<()> {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::new(names)?;
            params.distinguished_name.push(DnType::CommonName, cn);
            let cert = params.signed_by(&key, ca)?;
            write(&format!("{file}.pem"), cert.pem())?;
            write(&format!("{file}-key.pem"), key.serialize_pem())?;
            Ok(())
        };
        let trusted = ca("kv-router test CA")?;
        write("ca.pem", trusted.pem())?;
        let server_names = vec!["127.0.0.1".to_owned(), "localhost".to_owned()];
        issue(&trusted, server_names, "etcd", "server")?;
        // Not an etcd user name: the password, not the certificate, picks the user.
        issue(&trusted, vec![], "kv-router-client", "client")?;
        let rogue = ca("someone else's CA")?;
        issue(&rogue, vec![], "kv-router-client", "rogue")?;
        Ok(Self { dir })
    }

    /// The path of `name` (`ca.pem`, `server.pem`, `client.pem`, `client-key.pem`,
    /// `rogue.pem`, `rogue-key.pem`, ...).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// [`Self::path`] as a flag value.
    pub fn arg(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
}

/// nats-server with the shipped permissions and etcd with TLS, auth and the shipped
/// roles; see the module docs.
pub struct SecureCluster {
    /// nats-server (dropped last).
    pub nats_server: NatsServer,
    /// etcd over mutual TLS.
    pub etcd_server: EtcdServer,
    /// The certificates.
    pub pki: Pki,
    /// Subjects of the test namespace.
    pub subjects: Subjects,
    _conf: TempDir,
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

impl SecureCluster {
    /// Starts both servers and applies the shipped configuration.
    ///
    /// # Errors
    /// When a server does not start or the RBAC script fails.
    pub async fn start() -> anyhow::Result<Self> {
        let subjects = Subjects::new(Namespace::new("sec")?);
        let conf = tempfile::Builder::new()
            .prefix("kv-router-nats-conf-")
            .tempdir()?;
        let shipped = repo_root().join("deploy/security/nats-server.conf");
        std::fs::copy(&shipped, conf.path().join("nats-server.conf"))
            .with_context(|| format!("copying {}", shipped.display()))?;
        let users: Vec<NatsUser> = nats_users()
            .into_iter()
            .map(|(name, role)| NatsUser {
                name: name.to_owned(),
                role,
                password: Some(password(name)),
            })
            .collect();
        std::fs::write(
            conf.path().join("users.conf"),
            nats_authorization(&subjects, &users)?,
        )?;
        let nats_server = NatsServer::start_with_config(&conf.path().join("nats-server.conf"))
            .await
            .context("starting nats-server with deploy/security/nats-server.conf")?;
        let pki = Pki::generate()?;
        let etcd_server = EtcdServer::start_with_tls(&EtcdServerTls {
            cert: pki.path("server.pem"),
            key: pki.path("server-key.pem"),
            client_ca: pki.path("ca.pem"),
        })
        .await
        .context("starting etcd with tls")?;
        let cluster = Self {
            nats_server,
            etcd_server,
            pki,
            subjects,
            _conf: conf,
        };
        for args in ETCD_USERS {
            cluster.rbac(args, Some(&password(args[1])), None).await?;
        }
        cluster
            .rbac(&["enable"], Some(&password(ROOT)), None)
            .await?;
        Ok(cluster)
    }

    /// Runs `deploy/security/etcd-rbac.sh args` against this etcd, with `stdin` as
    /// its standard input and, when given, `as_user` (`user:password`) for etcdctl.
    ///
    /// # Errors
    /// When the script cannot run or exits non-zero (its stderr quoted).
    pub async fn rbac(
        &self,
        args: &[&str],
        stdin: Option<&str>,
        as_user: Option<&str>,
    ) -> anyhow::Result<()> {
        let script = repo_root().join("deploy/security/etcd-rbac.sh");
        let mut command = tokio::process::Command::new("bash");
        command
            .arg(&script)
            .args(args)
            .env("KV_ROUTER_NAMESPACE", self.subjects.namespace().as_str())
            .env("ETCDCTL_ENDPOINTS", self.etcd_server.endpoint())
            .env("ETCDCTL_CACERT", self.pki.path("ca.pem"))
            .env("ETCDCTL_CERT", self.pki.path("client.pem"))
            .env("ETCDCTL_KEY", self.pki.path("client-key.pem"))
            .env_remove("ETCDCTL_USER")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if let Some(user) = as_user {
            command.env("ETCDCTL_USER", user);
        }
        let mut child = command
            .spawn()
            .context("running etcd-rbac.sh (needs bash and etcdctl)")?;
        // Dropping the pipe closes the script's standard input.
        if let (Some(mut input), Some(text)) = (child.stdin.take(), stdin) {
            input.write_all(format!("{text}\n").as_bytes()).await?;
        }
        let out = child.wait_with_output().await?;
        anyhow::ensure!(
            out.status.success(),
            "etcd-rbac.sh {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// The NATS flags of `user` (URL, user, password and, except for routers, the
    /// user's own inbox prefix).
    pub fn nats_flags(&self, user: &str) -> Vec<String> {
        let mut flags = vec![
            "--nats-url".to_owned(),
            self.nats_server.url(),
            "--nats-user".to_owned(),
            user.to_owned(),
            "--nats-password".to_owned(),
            password(user),
        ];
        if user != ROUTER {
            flags.extend([
                "--nats-inbox-prefix".to_owned(),
                kv_cluster::security::inbox_prefix(user),
            ]);
        }
        flags
    }

    /// The etcd flags of `user`: the https endpoint, the CA, the client certificate,
    /// the user and its password.
    pub fn etcd_flags(&self, user: &str) -> Vec<String> {
        [
            "--etcd-endpoints",
            &self.etcd_server.endpoint(),
            "--etcd-tls-ca",
            &self.pki.arg("ca.pem"),
            "--etcd-tls-cert",
            &self.pki.arg("client.pem"),
            "--etcd-tls-key",
            &self.pki.arg("client-key.pem"),
            "--etcd-user",
            user,
            "--etcd-password",
            &password(user),
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// The flag group `A` (`ServeArgs`, `RelayArgs`, `GatewayArgs`, the mock engines'
    /// `ConnectionArgs`) connecting as `user` to both servers, followed by `extra`.
    ///
    /// # Panics
    /// When the flags do not parse: a mistake in the test.
    pub fn flags<A: clap::Args + clap::FromArgMatches>(&self, user: &str, extra: &[&str]) -> A {
        let mut args = vec!["kv-router".to_owned()];
        args.extend(self.nats_flags(user));
        args.extend(self.etcd_flags(user));
        args.extend([
            "--namespace".to_owned(),
            self.subjects.namespace().to_string(),
        ]);
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        kv_cluster::args::parse_flags(args).expect("test flags parse")
    }

    /// A NATS client connected as `user` (with its inbox prefix), and the errors the
    /// server sends it (permission violations), as text.
    ///
    /// # Errors
    /// When the connection fails.
    pub async fn nats_as(
        &self,
        user: &str,
    ) -> anyhow::Result<(async_nats::Client, mpsc::UnboundedReceiver<String>)> {
        let (tx, rx) = mpsc::unbounded_channel();
        let args: kv_cluster::args::NatsArgs = {
            let mut flags = vec!["t".to_owned()];
            flags.extend(self.nats_flags(user));
            kv_cluster::args::parse_flags(flags)?
        };
        let client = args
            .to_config()?
            .connect_with(user, move |options| {
                options.event_callback(move |event| {
                    let tx = tx.clone();
                    async move {
                        if let async_nats::Event::ServerError(e) = event {
                            // The receiver may be gone: the test no longer listens.
                            let _ = tx.send(e.to_string().to_lowercase());
                        }
                    }
                })
            })
            .await?;
        Ok((client, rx))
    }

    /// An etcd client with the CA and client certificate `cert` (`"client"`,
    /// `"rogue"`, or `None` for no client certificate) and, if given, `user`'s
    /// password.
    ///
    /// # Errors
    /// When the client refuses the options or, with a user, authentication fails.
    pub async fn etcd_as(
        &self,
        cert: Option<&str>,
        user: Option<&str>,
    ) -> Result<etcd_client::Client, kv_cluster::Error> {
        let mut flags = vec![
            "t".to_owned(),
            "--etcd-endpoints".to_owned(),
            self.etcd_server.endpoint(),
            "--etcd-tls-ca".to_owned(),
            self.pki.arg("ca.pem"),
            "--etcd-connect-timeout-ms".to_owned(),
            "3000".to_owned(),
        ];
        if let Some(cert) = cert {
            flags.extend([
                "--etcd-tls-cert".to_owned(),
                self.pki.arg(&format!("{cert}.pem")),
                "--etcd-tls-key".to_owned(),
                self.pki.arg(&format!("{cert}-key.pem")),
            ]);
        }
        if let Some(user) = user {
            flags.extend([
                "--etcd-user".to_owned(),
                user.to_owned(),
                "--etcd-password".to_owned(),
                password(user),
            ]);
        }
        let args: kv_cluster::args::EtcdArgs =
            kv_cluster::args::parse_flags(flags).expect("test flags parse");
        kv_cluster::etcd::connect(&args.to_config()?).await
    }
}

/// Waits (up to 10 s) for a server error naming `subject` among `errors`.
///
/// # Errors
/// When none comes.
pub async fn violation(
    errors: &mut mpsc::UnboundedReceiver<String>,
    subject: &str,
) -> anyhow::Result<String> {
    let wanted = subject.to_lowercase();
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while let Some(error) = errors.recv().await {
            if error.contains("permissions violation") && error.contains(&wanted) {
                return Ok(error);
            }
        }
        anyhow::bail!("the connection closed before a violation for {subject}")
    })
    .await
    .with_context(|| format!("no permissions violation for {subject}"))?
}
