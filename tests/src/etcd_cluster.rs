//! [`EtcdCluster`]: an etcd cluster of several members on loopback ports, for tests
//! that lose a member (the one a client talks to, or the leader) while quorum holds.
//!
//! Each member gets a free client port and a free peer port, its own data directory
//! and the whole `--initial-cluster`; the members start together (none is ready before
//! a quorum has elected a leader) and the cluster is ready when every member logs
//! "ready to serve client requests". A port taken between our probe and etcd's bind
//! makes a member exit with "address already in use": the whole cluster is then
//! started again on fresh ports, up to [`PORT_ATTEMPTS`] times. [`EtcdCluster::kill`]
//! kills a member with `SIGKILL` (a crash, as an operator's node loss would be);
//! [`EtcdCluster::restart`] starts it again on its ports with its data, and it rejoins.
//! Every member is killed and reaped, and the data removed, when the cluster drops.
//! Cost: one etcd process per member (about 30 MB each) and its election; on a
//! loaded 2-core machine a start takes about a second.

use anyhow::Context;
use etcd_client::Client;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tempfile::TempDir;
use testbed::{
    Echo, ManagedProcess, PORT_ATTEMPTS, ProcessError, READY_TIMEOUT, find_on_path, free_port,
};

const ETCD_READY: &str = "ready to serve client requests";

/// Bound on one status or metrics request to a member.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// One member's fixed identity: its name and ports, the same across restarts.
#[derive(Debug, Clone)]
struct MemberSpec {
    name: String,
    client_port: u16,
    peer_port: u16,
}

impl MemberSpec {
    fn client_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }
}

/// An etcd cluster of [`EtcdCluster::len`] members on loopback ports. See the module
/// docs.
#[derive(Debug)]
pub struct EtcdCluster {
    // Declared before `data` so the processes die before their directories go.
    processes: Vec<Option<ManagedProcess>>,
    members: Vec<MemberSpec>,
    initial_cluster: String,
    token: String,
    binary: PathBuf,
    data: TempDir,
}

impl EtcdCluster {
    /// Starts a cluster of `members` members and waits until each serves clients.
    ///
    /// # Errors
    /// etcd is not installed, a member exits or is not ready within
    /// [`READY_TIMEOUT`] (quoting its last log lines), or ports stay taken.
    pub async fn start(members: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(members > 0, "an etcd cluster needs at least one member");
        let binary = find_on_path("etcd").ok_or_else(|| ProcessError::BinaryNotFound {
            binary: "etcd".to_owned(),
            hint: "install it with `apt-get install etcd-server`".to_owned(),
        })?;
        let mut attempt = 1;
        loop {
            match Self::launch(&binary, members).await {
                Ok(cluster) => return Ok(cluster),
                Err(e) if e.is_port_conflict() && attempt < PORT_ATTEMPTS => {
                    tracing::debug!(attempt, "an etcd port was taken, retrying");
                    attempt += 1;
                }
                Err(e) => return Err(e).context("starting the etcd cluster"),
            }
        }
    }

    async fn launch(binary: &Path, members: usize) -> Result<Self, ProcessError> {
        let data = tempfile::Builder::new()
            .prefix("kv-router-etcd-cluster-")
            .tempdir()
            .map_err(|source| ProcessError::Io {
                context: "creating a temporary data directory".to_owned(),
                source,
            })?;
        let members = (0..members)
            .map(|i| {
                Ok(MemberSpec {
                    name: format!("m{i}"),
                    client_port: free_port()?,
                    peer_port: free_port()?,
                })
            })
            .collect::<Result<Vec<_>, ProcessError>>()?;
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        let token = data
            .path()
            .file_name()
            .map_or_else(|| "kv-router".to_owned(), |n| n.to_string_lossy().into());
        let mut cluster = Self {
            processes: Vec::new(),
            members,
            initial_cluster,
            token,
            binary: binary.to_owned(),
            data,
        };
        for i in 0..cluster.members.len() {
            let process = cluster.spawn(i)?;
            cluster.processes.push(Some(process));
        }
        let waits = cluster
            .processes
            .iter_mut()
            .flatten()
            .map(|p| p.wait_for_line(ETCD_READY, READY_TIMEOUT));
        for ready in futures::future::join_all(waits).await {
            ready?;
        }
        Ok(cluster)
    }

    fn spawn(&self, i: usize) -> Result<ManagedProcess, ProcessError> {
        let member = &self.members[i];
        let (client, peer) = (member.client_url(), member.peer_url());
        let mut command = Command::new(&self.binary);
        command
            .args(["--name", &member.name, "--data-dir"])
            .arg(self.data.path().join(&member.name))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &self.token]);
        ManagedProcess::spawn(format!("etcd-{}", member.name), command, Echo::Quiet)
    }

    /// The number of members (running or not).
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the cluster has no member (never: [`Self::start`] refuses 0).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Every member's client endpoint, `http://127.0.0.1:PORT`, in member order.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(MemberSpec::client_url).collect()
    }

    /// Member `i`'s client endpoint.
    ///
    /// # Panics
    /// When `i` is not a member index: a mistake in the test.
    pub fn endpoint(&self, i: usize) -> String {
        self.members[i].client_url()
    }

    /// The client endpoints joined by commas, as `--etcd-endpoints` takes them.
    pub fn endpoints_flag(&self) -> String {
        self.endpoints().join(",")
    }

    /// Whether member `i` runs.
    pub fn is_running(&self, i: usize) -> bool {
        self.processes.get(i).is_some_and(Option::is_some)
    }

    /// Kills member `i` with `SIGKILL` and reaps it; its data stays for
    /// [`Self::restart`]. A no-op for a member that is not running.
    pub fn kill(&mut self, i: usize) {
        // Dropping a managed process kills and reaps it.
        drop(self.processes.get_mut(i).and_then(Option::take));
    }

    /// Starts member `i` again on its ports with its data and waits until it serves
    /// clients (it rejoins the cluster). A no-op for a running member.
    ///
    /// # Errors
    /// As [`Self::start`]; its ports may have been taken while it was down.
    pub async fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        anyhow::ensure!(i < self.members.len(), "no etcd member {i}");
        if self.is_running(i) {
            return Ok(());
        }
        let mut process = self.spawn(i)?;
        process
            .wait_for_line(ETCD_READY, READY_TIMEOUT)
            .await
            .with_context(|| format!("restarting etcd member {i}"))?;
        self.processes[i] = Some(process);
        Ok(())
    }

    /// A client of member `i` alone (no failover), for asking that member.
    ///
    /// # Errors
    /// When the endpoint is invalid.
    pub async fn member_client(&self, i: usize) -> anyhow::Result<Client> {
        Ok(Client::connect([self.endpoint(i)], None).await?)
    }

    /// The index of the current leader, as a running member's maintenance status
    /// reports it (the first running member that answers within 5 s is asked).
    ///
    /// # Errors
    /// When no running member answers, or none knows a leader (an election is under
    /// way).
    pub async fn leader(&self) -> anyhow::Result<usize> {
        let mut last = anyhow::anyhow!("no etcd member runs");
        for i in (0..self.len()).filter(|&i| self.is_running(i)) {
            let asked = async {
                let mut client = self.member_client(i).await?;
                let status = tokio::time::timeout(CALL_TIMEOUT, client.status()).await??;
                anyhow::ensure!(status.leader() != 0, "etcd member {i} knows no leader");
                self.index_of(&mut client, status.leader()).await
            };
            match asked.await {
                Ok(leader) => return Ok(leader),
                Err(e) => last = e.context(format!("asking etcd member {i} for the leader")),
            }
        }
        Err(last)
    }

    /// Makes member `to` the leader (etcd's leader transfer, asked of the current
    /// leader) and waits until the members report it. A no-op if it leads already.
    ///
    /// # Errors
    /// When `to` does not run, or the transfer fails or does not show within 10 s.
    pub async fn move_leader(&self, to: usize) -> anyhow::Result<()> {
        anyhow::ensure!(self.is_running(to), "etcd member {to} does not run");
        let leader = self.leader().await?;
        if leader == to {
            return Ok(());
        }
        let mut client = self.member_client(leader).await?;
        let members = tokio::time::timeout(CALL_TIMEOUT, client.member_list()).await??;
        let target = members
            .members()
            .iter()
            .find(|m| m.name() == self.members[to].name)
            .with_context(|| format!("etcd member {to} is not listed"))?
            .id();
        tokio::time::timeout(CALL_TIMEOUT, client.move_leader(target)).await??;
        crate::eventually(
            &format!("etcd member {to} to lead"),
            Duration::from_secs(10),
            || async { (self.leader().await.ok() == Some(to)).then_some(()) },
        )
        .await
    }

    /// The member index of etcd member id `id`, from `client`'s member list.
    async fn index_of(&self, client: &mut Client, id: u64) -> anyhow::Result<usize> {
        let members = tokio::time::timeout(CALL_TIMEOUT, client.member_list()).await??;
        let name = members
            .members()
            .iter()
            .find(|m| m.id() == id)
            .map(|m| m.name().to_owned())
            .with_context(|| format!("etcd member id {id:#x} is not listed"))?;
        self.members
            .iter()
            .position(|m| m.name == name)
            .with_context(|| format!("etcd member {name} is not ours"))
    }

    /// The lease keep-alive streams open on member `i` now: its gRPC server's
    /// `LeaseKeepAlive` streams started minus those handled (ended), from its
    /// `/metrics`. Tells which member a client's keep-alive runs through.
    ///
    /// # Errors
    /// When the member does not answer within 5 s or its page lacks the counters.
    pub async fn keep_alive_streams(&self, i: usize) -> anyhow::Result<u64> {
        let url = format!("{}/metrics", self.endpoint(i));
        let (status, page) = kv_cluster::http::get_text(
            &kv_cluster::http::client()?,
            &url,
            CALL_TIMEOUT,
            kv_cluster::http::MAX_RESPONSE_BYTES,
        )
        .await?;
        anyhow::ensure!(status.is_success(), "{url} answered {status}");
        let started = metric_sum(&page, "grpc_server_started_total", "LeaseKeepAlive")
            .with_context(|| format!("{url} has no LeaseKeepAlive stream counter"))?;
        let ended = metric_sum(&page, "grpc_server_handled_total", "LeaseKeepAlive").unwrap_or(0);
        Ok(started.saturating_sub(ended))
    }

    /// The running members holding at least one lease keep-alive stream, with how
    /// many each holds.
    ///
    /// # Errors
    /// As [`Self::keep_alive_streams`].
    pub async fn members_with_keep_alives(&self) -> anyhow::Result<Vec<(usize, u64)>> {
        let mut found = Vec::new();
        for i in (0..self.len()).filter(|&i| self.is_running(i)) {
            let streams = self.keep_alive_streams(i).await?;
            if streams > 0 {
                found.push((i, streams));
            }
        }
        Ok(found)
    }
}

/// The sum of the samples of counter `name` whose labels mention `method`, from a
/// Prometheus text page; `None` if there is none.
fn metric_sum(page: &str, name: &str, method: &str) -> Option<u64> {
    let quoted = format!("\"{method}\"");
    kv_cluster::http::exposition::samples(page)
        .filter(|s| s.name == name && s.labels.contains(&quoted))
        .map(|s| s.value as u64)
        .reduce(|a, b| a + b)
}

#[cfg(test)]
mod tests {
    use super::metric_sum;

    #[test]
    fn metric_sum_adds_the_samples_of_one_method() {
        let page = "# TYPE grpc_server_started_total counter\n\
            grpc_server_started_total{grpc_method=\"LeaseKeepAlive\",grpc_type=\"bidi_stream\"} 3\n\
            grpc_server_started_total{grpc_method=\"LeaseGrant\",grpc_type=\"unary\"} 9\n\
            grpc_server_started_total_other{grpc_method=\"LeaseKeepAlive\"} 100\n\
            grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"LeaseKeepAlive\"} 1\n\
            grpc_server_handled_total{grpc_code=\"Unavailable\",grpc_method=\"LeaseKeepAlive\"} 1\n";
        assert_eq!(
            metric_sum(page, "grpc_server_started_total", "LeaseKeepAlive"),
            Some(3)
        );
        assert_eq!(
            metric_sum(page, "grpc_server_handled_total", "LeaseKeepAlive"),
            Some(2)
        );
        assert_eq!(metric_sum(page, "grpc_server_started_total", "Watch"), None);
    }
}
