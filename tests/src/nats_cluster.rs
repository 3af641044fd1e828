//! A NATS cluster of N nats-server nodes on loopback, as an operator runs one: full
//! mesh routes, JetStream on, every client given every node's URL.
//!
//! Why a cluster and not one server: in a cluster a client's subscription reaches the
//! other nodes asynchronously, over the routes, so a message published on another node
//! right after a subscription can be dropped. Code that is correct against one server
//! (which handles a connection's commands in order) can hang or lose messages here;
//! these tests are where that shows.
//!
//! Each node gets a client port and a route port from [`free_port`] and a temporary
//! JetStream store. [`NatsCluster::start_with_route_latency`] puts a forwarder that
//! delays every byte in front of each node's route port (advertised to the other nodes
//! in its place), as between machines or zones: subscriptions then take that long to
//! cross, which makes the races above happen on nearly every try instead of rarely.
//! [`NatsCluster::start`] returns once every node delivers a message
//! published on every other node (the routes are up), retrying with fresh ports when
//! one was taken meanwhile. [`NatsCluster::kill`] and [`NatsCluster::restart`] stop and
//! start one node on the same ports and store. Every node is killed and reaped, and
//! its store removed, when the cluster drops. Cost: one process per node and, on this
//! machine, about a second to start three.

use anyhow::Context;
use futures::StreamExt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tempfile::TempDir;
use testbed::{
    Echo, ManagedProcess, PORT_ATTEMPTS, ProcessError, READY_TIMEOUT, STOP_GRACE, find_on_path,
    free_port,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

const NATS_READY: &str = "Server is ready";
/// Logged after "Server is ready", once the route port is bound too.
const ROUTES_READY: &str = "Listening for route connections";

/// How long [`NatsCluster::start`] and [`NatsCluster::restart`] wait for the routes
/// to carry messages between every pair of nodes.
pub const MESH_TIMEOUT: Duration = Duration::from_secs(30);

/// One node: its ports, its store and configuration, and its process while it runs.
#[derive(Debug)]
struct Node {
    // Declared before `dir` so the process dies before its store is removed.
    process: Option<ManagedProcess>,
    client_port: u16,
    dir: TempDir,
}

impl Node {
    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.client_port)
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("nats.conf")
    }
}

/// A running cluster of nats-server nodes; see the module docs.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<Node>,
    /// The route forwarders of [`Self::start_with_route_latency`], held to be aborted
    /// on drop.
    _proxies: JoinSet<()>,
}

impl NatsCluster {
    /// Starts `nodes` nats-server processes (at least 1) as one cluster and waits
    /// until the routes carry messages between every pair of them.
    ///
    /// # Errors
    /// When nats-server is not installed, a node does not start (its last log lines
    /// are quoted), ports stay taken after [`PORT_ATTEMPTS`] tries, or the routes do
    /// not connect within [`MESH_TIMEOUT`].
    pub async fn start(nodes: usize) -> anyhow::Result<Self> {
        Self::start_with_route_latency(nodes, Duration::ZERO).await
    }

    /// Starts a cluster as [`Self::start`] does, with every byte between two nodes
    /// delayed by `latency` in each direction (none when zero): each node's routes
    /// are dialled through a forwarder in this process, which the node advertises to
    /// the others instead of its own route port.
    ///
    /// # Errors
    /// As [`Self::start`]; also when a forwarder cannot listen.
    pub async fn start_with_route_latency(nodes: usize, latency: Duration) -> anyhow::Result<Self> {
        anyhow::ensure!(nodes >= 1, "a cluster needs at least one node");
        let binary = find_on_path("nats-server").context(
            "nats-server not found on PATH; install it with `apt-get install nats-server`",
        )?;
        let mut attempt = 1;
        loop {
            match Self::spawn_all(&binary, nodes, latency).await {
                Ok(cluster) => {
                    cluster.wait_for_mesh().await?;
                    return Ok(cluster);
                }
                Err(e) if e.is_port_conflict() && attempt < PORT_ATTEMPTS => attempt += 1,
                Err(e) => return Err(e.into()),
            }
        }
    }

    async fn spawn_all(
        binary: &Path,
        count: usize,
        latency: Duration,
    ) -> Result<Self, ProcessError> {
        // The forwarders listen first and keep their ports, so no node is given one.
        let mut forwarders = Vec::new();
        if !latency.is_zero() {
            for _ in 0..count {
                let listener = TcpListener::bind("127.0.0.1:0")
                    .await
                    .map_err(|source| io_error("binding a route forwarder", source))?;
                forwarders.push(listener);
            }
        }
        let probed = distinct_free_ports(2 * count)?;
        let ports: Vec<(u16, u16)> = probed.chunks(2).map(|p| (p[0], p[1])).collect();
        // Where the nodes dial each other: the route ports, or the forwarders.
        let mut proxies = JoinSet::new();
        let mut dialled: Vec<u16> = ports.iter().map(|&(_, route)| route).collect();
        for (listener, (dial, &(_, route_port))) in
            forwarders.into_iter().zip(dialled.iter_mut().zip(&ports))
        {
            *dial = listener
                .local_addr()
                .map_err(|source| io_error("binding a route forwarder", source))?
                .port();
            let upstream = SocketAddr::from(([127, 0, 0, 1], route_port));
            proxies.spawn(forward_delayed(listener, upstream, latency));
        }
        let routes = dialled
            .iter()
            .map(|port| format!("\"nats-route://127.0.0.1:{port}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let mut nodes = Vec::with_capacity(count);
        for (i, &(client_port, route_port)) in ports.iter().enumerate() {
            let dir = tempfile::Builder::new()
                .prefix("kv-router-nats-cluster-")
                .tempdir()
                .map_err(|source| io_error("creating a node's directory", source))?;
            let node = Node {
                process: None,
                client_port,
                dir,
            };
            let store = node.dir.path().join("store");
            let advertise = dialled[i];
            let config = format!(
                "server_name: n{i}\nlisten: \"127.0.0.1:{client_port}\"\n\
                 jetstream {{ store_dir: {store:?} }}\n\
                 cluster {{\n  name: kv-test\n  listen: \"127.0.0.1:{route_port}\"\n  \
                 advertise: \"127.0.0.1:{advertise}\"\n  routes: [{routes}]\n}}\n"
            );
            std::fs::write(node.config(), config)
                .map_err(|source| io_error("writing a node's configuration", source))?;
            nodes.push(node);
        }
        // Spawn every node before waiting for any: each logs ready on its own, and the
        // routes connect as the others come up.
        for (i, node) in nodes.iter_mut().enumerate() {
            node.process = Some(spawn(binary, i, &node.config())?);
        }
        for node in &mut nodes {
            if let Some(process) = node.process.as_mut() {
                wait_until_listening(process).await?;
            }
        }
        Ok(Self {
            nodes,
            _proxies: proxies,
        })
    }

    /// How many nodes the cluster has (running or killed).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the cluster has no nodes (never: [`Self::start`] needs one).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node `i`'s client URL, `nats://127.0.0.1:PORT` (also while it is killed).
    ///
    /// # Panics
    /// When `i` is not a node of the cluster: a mistake in the test.
    pub fn url(&self, i: usize) -> String {
        self.nodes[i].url()
    }

    /// Every node's client URL, in node order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Node::url).collect()
    }

    /// Every node's client URL joined by commas, as `--nats-url` takes them.
    pub fn url_list(&self) -> String {
        self.urls().join(",")
    }

    /// Kills node `i` (`SIGKILL`, as a crashed node or machine); its clients see the
    /// connection drop and reconnect to another node. Does nothing if it is not
    /// running.
    ///
    /// # Panics
    /// When `i` is not a node of the cluster: a mistake in the test.
    pub fn kill(&mut self, i: usize) {
        // Dropping a ManagedProcess sends SIGKILL and reaps it.
        drop(self.nodes[i].process.take());
    }

    /// Starts node `i` again on its ports, with its store, and waits until the routes
    /// carry messages between every pair of running nodes. A running node is first
    /// stopped gracefully.
    ///
    /// # Errors
    /// As [`Self::start`]; a port taken while the node was down makes it fail.
    ///
    /// # Panics
    /// When `i` is not a node of the cluster: a mistake in the test.
    pub async fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(process) = self.nodes[i].process.take() {
            process.stop(STOP_GRACE).await?;
        }
        let binary = find_on_path("nats-server").context("nats-server not found on PATH")?;
        let mut process = spawn(&binary, i, &self.nodes[i].config())?;
        wait_until_listening(&mut process).await?;
        self.nodes[i].process = Some(process);
        self.wait_for_mesh().await
    }

    /// Waits until a message published on each running node reaches a subscriber on
    /// each other running node, re-publishing until it does (interest crosses the
    /// routes asynchronously), for at most [`MESH_TIMEOUT`] in all.
    async fn wait_for_mesh(&self) -> anyhow::Result<()> {
        let running: Vec<&Node> = self.nodes.iter().filter(|n| n.process.is_some()).collect();
        let mut clients = Vec::with_capacity(running.len());
        for node in &running {
            let client = async_nats::ConnectOptions::new()
                .retain_servers_order()
                .connect(node.url())
                .await
                .with_context(|| format!("connecting to {}", node.url()))?;
            clients.push((node.url(), client));
        }
        let deadline = tokio::time::Instant::now() + MESH_TIMEOUT;
        for (to_url, to) in &clients {
            for (from_url, from) in &clients {
                // A subscription per pair, so a late copy of an earlier pair's message
                // cannot stand in for this one.
                let inbox = to.new_inbox();
                let mut sub = to.subscribe(inbox.clone()).await?;
                loop {
                    from.publish(inbox.clone(), bytes::Bytes::new()).await?;
                    from.flush().await?;
                    let wait = tokio::time::Instant::now() + Duration::from_millis(50);
                    match tokio::time::timeout_at(wait.min(deadline), sub.next()).await {
                        Ok(Some(_)) => break,
                        Ok(None) => anyhow::bail!("the connection to {to_url} closed"),
                        Err(_) if tokio::time::Instant::now() >= deadline => anyhow::bail!(
                            "the NATS cluster's routes did not carry {from_url} → {to_url} within {MESH_TIMEOUT:?}"
                        ),
                        Err(_) => {}
                    }
                }
            }
        }
        Ok(())
    }
}

/// Waits until `process` serves clients and listens for routes. A port taken meanwhile
/// makes it exit first, an error [`ProcessError::is_port_conflict`] recognises.
async fn wait_until_listening(process: &mut ManagedProcess) -> Result<(), ProcessError> {
    process.wait_for_line(NATS_READY, READY_TIMEOUT).await?;
    process.wait_for_line(ROUTES_READY, READY_TIMEOUT).await?;
    Ok(())
}

/// `count` different ports, each free when probed ([`free_port`]).
fn distinct_free_ports(count: usize) -> Result<Vec<u16>, ProcessError> {
    let mut ports = Vec::with_capacity(count);
    for _ in 0..count * 100 {
        if ports.len() == count {
            return Ok(ports);
        }
        let port = free_port()?;
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    Err(io_error(
        "probing for free ports",
        std::io::Error::other(format!("only {} distinct ones found", ports.len())),
    ))
}

fn spawn(binary: &Path, i: usize, config: &Path) -> Result<ManagedProcess, ProcessError> {
    let mut command = Command::new(binary);
    command.arg("-c").arg(config);
    ManagedProcess::spawn(format!("nats-{i}"), command, Echo::Quiet)
}

fn io_error(context: &str, source: std::io::Error) -> ProcessError {
    ProcessError::Io {
        context: context.to_owned(),
        source,
    }
}

/// Accepts connections on `listener` and forwards each to `upstream`, every byte
/// `latency` late in each direction, until aborted.
async fn forward_delayed(listener: TcpListener, upstream: SocketAddr, latency: Duration) {
    let mut connections = JoinSet::new();
    while let Ok((inbound, _)) = listener.accept().await {
        connections.spawn(async move {
            let Ok(outbound) = TcpStream::connect(upstream).await else {
                return;
            };
            let (in_read, in_write) = inbound.into_split();
            let (out_read, out_write) = outbound.into_split();
            tokio::join!(
                copy_delayed(in_read, out_write, latency),
                copy_delayed(out_read, in_write, latency),
            );
        });
    }
}

/// Copies `from` to `to`, each chunk written `latency` after it was read, in order;
/// closes `to` after `from` ends. At most 256 chunks wait (backpressure beyond).
async fn copy_delayed(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    latency: Duration,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(256);
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buf).await {
            let due = tokio::time::Instant::now() + latency;
            if n == 0 || tx.send((due, buf[..n].to_vec())).await.is_err() {
                break;
            }
        }
    };
    let write = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}
