//! nats-server (with JetStream) and a single-member etcd on free loopback ports.
//!
//! Ports come from binding `127.0.0.1:0` and releasing the socket. Another process can
//! take the port between our release and the server's bind; the server then exits with
//! "address already in use" and we retry with fresh ports ([`PORT_ATTEMPTS`] times).
//! Data lives in a temporary directory removed when the handle drops (after the
//! process has been killed and reaped).

use crate::error::ProcessError;
use crate::process::{Echo, ManagedProcess, find_on_path};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tempfile::TempDir;

/// Start attempts with fresh ports before a port conflict is reported.
pub const PORT_ATTEMPTS: usize = 5;

/// How long a server may take to log its readiness line. Generous because CI machines
/// can be slow while compiling in parallel.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a server may take to exit after `SIGTERM` before it is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

const NATS_BINARY: &str = "nats-server";
const NATS_READY: &str = "Server is ready";
const ETCD_BINARY: &str = "etcd";
const ETCD_READY: &str = "ready to serve client requests";

/// A free TCP port on 127.0.0.1 (free when probed; see the module docs for the race).
///
/// # Errors
/// [`ProcessError::Io`] if no socket can be bound.
pub fn free_port() -> Result<u16, ProcessError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|source| ProcessError::Io {
        context: "probing for a free port".to_owned(),
        source,
    })?;
    listener
        .local_addr()
        .map(|addr| addr.port())
        .map_err(|source| ProcessError::Io {
            context: "probing for a free port".to_owned(),
            source,
        })
}

fn require_binary(binary: &str, package: &str) -> Result<PathBuf, ProcessError> {
    find_on_path(binary).ok_or_else(|| ProcessError::BinaryNotFound {
        binary: binary.to_owned(),
        hint: format!("install it with `apt-get install {package}`"),
    })
}

fn temp_dir(prefix: &str) -> Result<TempDir, ProcessError> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map_err(|source| ProcessError::Io {
            context: "creating a temporary data directory".to_owned(),
            source,
        })
}

/// Spawns a server via `spawn` (given fresh ports by `ports`) until it logs `marker`,
/// retrying on port conflicts.
async fn start_with_retries<P: Copy>(
    ports: impl Fn() -> Result<P, ProcessError>,
    spawn: impl Fn(P) -> Result<ManagedProcess, ProcessError>,
    marker: &str,
) -> Result<(ManagedProcess, P), ProcessError> {
    let mut attempt = 1;
    loop {
        let chosen = ports()?;
        let mut process = spawn(chosen)?;
        match process.wait_for_line(marker, READY_TIMEOUT).await {
            Ok(_) => return Ok((process, chosen)),
            Err(err) if err.is_port_conflict() && attempt < PORT_ATTEMPTS => {
                tracing::debug!(process = process.label(), attempt, "port taken, retrying");
                attempt += 1;
            }
            Err(err) => return Err(err),
        }
    }
}

/// A nats-server with JetStream enabled, listening on a free loopback port.
/// Killed, reaped and its store directory removed on drop.
#[derive(Debug)]
pub struct NatsServer {
    // Declared before `store` so the process dies before its directory is removed.
    process: Option<ManagedProcess>,
    port: u16,
    store: TempDir,
    config: Option<PathBuf>,
}

impl NatsServer {
    /// Starts `nats-server -a 127.0.0.1 -p PORT -js -sd DIR` and waits for it to log
    /// "Server is ready".
    ///
    /// # Errors
    /// [`ProcessError::BinaryNotFound`] if nats-server is not installed; spawn, exit or
    /// timeout errors otherwise (quoting the server's last log lines).
    pub async fn start() -> Result<Self, ProcessError> {
        Self::launch(None).await
    }

    /// Starts nats-server as [`Self::start`] does, with the configuration file
    /// `config` (`-c`; e.g. users and permissions). The address, port and JetStream
    /// flags override the file's.
    ///
    /// # Errors
    /// As [`Self::start`]; a file nats-server refuses makes it exit, quoting why.
    pub async fn start_with_config(config: &Path) -> Result<Self, ProcessError> {
        Self::launch(Some(config.to_owned())).await
    }

    async fn launch(config: Option<PathBuf>) -> Result<Self, ProcessError> {
        let binary = require_binary(NATS_BINARY, "nats-server")?;
        let store = temp_dir("kv-router-nats-")?;
        let (process, port) = start_with_retries(
            free_port,
            |port| spawn_nats(&binary, port, store.path(), config.as_deref()),
            NATS_READY,
        )
        .await?;
        Ok(Self {
            process: Some(process),
            port,
            store,
            config,
        })
    }

    /// The client URL, `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Writes the server's log to `path` from now on (see [`ManagedProcess::log_to`]).
    ///
    /// # Errors
    /// [`ProcessError::Io`] if the file cannot be written.
    pub fn log_to(&self, path: &Path) -> Result<(), ProcessError> {
        self.process.as_ref().map_or(Ok(()), |p| p.log_to(path))
    }

    /// Stops the server gracefully and starts it again on the same port with the same
    /// JetStream store, for resilience tests (clients see a disconnect and reconnect).
    ///
    /// # Errors
    /// As [`Self::start`]; the port may have been taken while the server was down.
    pub async fn restart(&mut self) -> Result<(), ProcessError> {
        if let Some(process) = self.process.take() {
            process.stop(STOP_GRACE).await?;
        }
        let binary = require_binary(NATS_BINARY, "nats-server")?;
        let mut process = spawn_nats(
            &binary,
            self.port,
            self.store.path(),
            self.config.as_deref(),
        )?;
        process.wait_for_line(NATS_READY, READY_TIMEOUT).await?;
        self.process = Some(process);
        Ok(())
    }

    /// Stops the server gracefully (`SIGTERM`, then `SIGKILL` after [`STOP_GRACE`]).
    ///
    /// # Errors
    /// [`ProcessError::Signal`] or [`ProcessError::Io`] if it cannot be stopped.
    pub async fn stop(mut self) -> Result<(), ProcessError> {
        if let Some(process) = self.process.take() {
            process.stop(STOP_GRACE).await?;
        }
        Ok(())
    }
}

fn spawn_nats(
    binary: &Path,
    port: u16,
    store: &Path,
    config: Option<&Path>,
) -> Result<ManagedProcess, ProcessError> {
    let mut command = Command::new(binary);
    if let Some(config) = config {
        command.arg("-c").arg(config);
    }
    command
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(store);
    ManagedProcess::spawn("nats", command, Echo::Quiet)
}

/// A single-member etcd (v3 API) on free loopback client and peer ports.
/// Killed, reaped and its data directory removed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    // Declared before `data` so the process dies before its directory is removed.
    process: Option<ManagedProcess>,
    client_port: u16,
    data: TempDir,
    tls: bool,
}

/// The PEM files of an etcd that serves its clients over mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdServerTls {
    /// The server certificate (valid for `127.0.0.1`).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA client certificates must be signed by.
    pub client_ca: PathBuf,
}

impl EtcdServer {
    /// Starts `etcd` with client and peer URLs on free loopback ports and waits for it
    /// to log "ready to serve client requests".
    ///
    /// # Errors
    /// [`ProcessError::BinaryNotFound`] if etcd is not installed; spawn, exit or timeout
    /// errors otherwise (quoting etcd's last log lines).
    pub async fn start() -> Result<Self, ProcessError> {
        Self::launch(None).await
    }

    /// Starts etcd as [`Self::start`] does, serving clients over `https://` and
    /// requiring a client certificate signed by `tls.client_ca`.
    ///
    /// # Errors
    /// As [`Self::start`].
    pub async fn start_with_tls(tls: &EtcdServerTls) -> Result<Self, ProcessError> {
        Self::launch(Some(tls)).await
    }

    async fn launch(tls: Option<&EtcdServerTls>) -> Result<Self, ProcessError> {
        let binary = require_binary(ETCD_BINARY, "etcd-server")?;
        let data = temp_dir("kv-router-etcd-")?;
        let (process, (client_port, _)) = start_with_retries(
            || Ok((free_port()?, free_port()?)),
            |(client, peer)| spawn_etcd(&binary, client, peer, &data.path().join("member"), tls),
            ETCD_READY,
        )
        .await?;
        Ok(Self {
            process: Some(process),
            client_port,
            data,
            tls: tls.is_some(),
        })
    }

    /// The client endpoint, `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// Writes etcd's log to `path` from now on (see [`ManagedProcess::log_to`]).
    ///
    /// # Errors
    /// [`ProcessError::Io`] if the file cannot be written.
    pub fn log_to(&self, path: &Path) -> Result<(), ProcessError> {
        self.process.as_ref().map_or(Ok(()), |p| p.log_to(path))
    }

    /// The temporary directory holding etcd's data (removed on drop).
    pub fn data_dir(&self) -> &Path {
        self.data.path()
    }

    /// Stops etcd gracefully (`SIGTERM`, then `SIGKILL` after [`STOP_GRACE`]).
    ///
    /// # Errors
    /// [`ProcessError::Signal`] or [`ProcessError::Io`] if it cannot be stopped.
    pub async fn stop(mut self) -> Result<(), ProcessError> {
        if let Some(process) = self.process.take() {
            process.stop(STOP_GRACE).await?;
        }
        Ok(())
    }
}

fn spawn_etcd(
    binary: &Path,
    client_port: u16,
    peer_port: u16,
    data_dir: &Path,
    tls: Option<&EtcdServerTls>,
) -> Result<ManagedProcess, ProcessError> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let client = format!("{scheme}://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let cluster = format!("default={peer}");
    let mut command = Command::new(binary);
    command
        .args(["--name", "default", "--data-dir"])
        .arg(data_dir)
        .args(["--listen-client-urls", &client])
        .args(["--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer])
        .args(["--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &cluster]);
    if let Some(tls) = tls {
        command
            .arg("--cert-file")
            .arg(&tls.cert)
            .arg("--key-file")
            .arg(&tls.key)
            .arg("--trusted-ca-file")
            .arg(&tls.client_ca)
            .arg("--client-cert-auth");
    }
    ManagedProcess::spawn("etcd", command, Echo::Quiet)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn port_is_free(port: u16) -> bool {
        TcpListener::bind(("127.0.0.1", port)).is_ok()
    }

    #[tokio::test]
    async fn nats_and_etcd_serve_and_release_their_ports() {
        let nats = NatsServer::start().await.unwrap();
        let etcd = EtcdServer::start().await.unwrap();
        assert!(nats.url().starts_with("nats://127.0.0.1:"));
        assert!(etcd.endpoint().starts_with("http://127.0.0.1:"));

        let client = async_nats::connect(nats.url()).await.unwrap();
        let mut sub = client.subscribe("cluster.test").await.unwrap();
        client
            .publish("cluster.test", "hello".into())
            .await
            .unwrap();
        client.flush().await.unwrap();
        let msg = sub.next().await.unwrap();
        assert_eq!(&msg.payload[..], b"hello");

        let mut kv = etcd_client::Client::connect([etcd.endpoint()], None)
            .await
            .unwrap();
        kv.put("k", "v", None).await.unwrap();
        let got = kv.get("k", None).await.unwrap();
        assert_eq!(got.kvs()[0].value(), b"v");

        let (nats_port, etcd_port) = (nats.port(), etcd.client_port());
        drop(client);
        nats.stop().await.unwrap();
        drop(etcd); // kill + reap on drop
        assert!(port_is_free(nats_port));
        assert!(port_is_free(etcd_port));
    }

    #[tokio::test]
    async fn nats_restart_keeps_the_port() {
        let mut nats = NatsServer::start().await.unwrap();
        let port = nats.port();
        nats.restart().await.unwrap();
        assert_eq!(nats.port(), port);
        let client = async_nats::connect(nats.url()).await.unwrap();
        client.flush().await.unwrap();
    }

    #[test]
    fn missing_binary_error_says_how_to_install() {
        let err = require_binary("definitely-not-nats-7f3a", "nats-server").unwrap_err();
        assert_eq!(
            err.to_string(),
            "definitely-not-nats-7f3a not found on PATH; install it with `apt-get install nats-server`"
        );
    }
}
