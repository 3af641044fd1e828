//! The endpoint picker (`kv-router epp`) in a test cluster, shared by its tests and
//! its bench: in this process, or as the release binary's own child process (whose
//! CPU time `/proc` reports apart from the load generator's).

use crate::TestCluster;
use crate::child_daemon::{DEFAULT_BIN, process_cpu_seconds, spawn_ready};
use kv_epp::{Epp, EppArgs};
use std::net::SocketAddr;
use std::sync::Arc;
use testbed::{ManagedProcess, free_port};
use tokio_util::sync::CancellationToken;

/// A running `kv-router epp` child process.
pub struct ChildEpp {
    _process: ManagedProcess,
    pid: u32,
    grpc_addr: SocketAddr,
}

impl ChildEpp {
    /// The ext_proc and gRPC health address.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// The picker's CPU time so far (utime + stime), in seconds.
    ///
    /// # Errors
    /// When `/proc` cannot be read or parsed.
    pub fn cpu_seconds(&self) -> anyhow::Result<f64> {
        process_cpu_seconds(self.pid)
    }
}

impl TestCluster {
    /// Starts a picker on this cluster in this process: its metrics and gRPC
    /// listeners on free loopback ports, serving `model` with the tokenizer in
    /// `model_dir`, then `extra` flags (which may override any of these).
    ///
    /// # Errors
    /// The picker's start-up errors (NATS, etcd, the tokenizer, the listeners).
    pub async fn start_epp(
        &self,
        model: &str,
        model_dir: &str,
        extra: &[&str],
    ) -> anyhow::Result<Epp> {
        let mut flags = vec![
            "--listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "127.0.0.1:0",
            "--served-model-name",
            model,
            "--model-dir",
            model_dir,
        ];
        flags.extend_from_slice(extra);
        let args: EppArgs = self.flags(&flags);
        let registry = Arc::new(prometheus::Registry::new());
        Ok(Epp::start(args.to_config()?, registry, CancellationToken::new()).await?)
    }

    /// Starts `kv-router epp` (`KV_ROUTER_BIN`, default [`DEFAULT_BIN`]) on this
    /// cluster as a child process, as [`Self::start_epp`] configures it; returns once
    /// it logs that it is ready (within 60 s).
    ///
    /// # Errors
    /// When the binary cannot start or does not become ready.
    pub async fn spawn_epp(
        &self,
        model: &str,
        model_dir: &str,
        extra: &[&str],
    ) -> anyhow::Result<ChildEpp> {
        let bin = std::env::var("KV_ROUTER_BIN").unwrap_or_else(|_| DEFAULT_BIN.into());
        let grpc_addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let listen = format!("127.0.0.1:{}", free_port()?);
        let mut command = std::process::Command::new(&bin);
        command
            .arg("epp")
            .args(&self.connection_flags()[1..])
            .args(["--listen", &listen, "--grpc-listen", &grpc_addr.to_string()])
            .args(["--served-model-name", model, "--model-dir", model_dir])
            .args(extra);
        let (process, pid) = spawn_ready("kv-router epp", &bin, command).await?;
        Ok(ChildEpp {
            _process: process,
            pid,
            grpc_addr,
        })
    }
}
