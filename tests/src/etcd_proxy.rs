//! [`EtcdProxy`]: a TCP path to etcd that a test can cut and restore, as a network
//! partition would — for daemons that must lose etcd, or engines whose lease must
//! outlive them (a cut path means their revoke never arrives).

use anyhow::Context;
use std::net::SocketAddr;
use testbed::free_port;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// A TCP forwarder from `listen` to `upstream`. [`EtcdProxy::cut`] closes the listener
/// and every forwarded connection, as a network partition would; [`EtcdProxy::restore`]
/// listens again on the same port.
pub struct EtcdProxy {
    listen: SocketAddr,
    upstream: SocketAddr,
    tasks: JoinSet<()>,
}

impl EtcdProxy {
    /// A proxy on a free loopback port, not listening yet: connections are refused.
    ///
    /// # Errors
    /// When no port can be probed.
    pub fn new(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listen = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        Ok(Self {
            listen,
            upstream,
            tasks: JoinSet::new(),
        })
    }

    /// The endpoint to give the daemon.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.listen)
    }

    /// Starts forwarding.
    ///
    /// # Errors
    /// When the port cannot be bound.
    pub async fn restore(&mut self) -> anyhow::Result<()> {
        let listener = TcpListener::bind(self.listen)
            .await
            .with_context(|| format!("binding the proxy on {}", self.listen))?;
        let upstream = self.upstream;
        self.tasks.spawn(async move {
            let mut connections = JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                connections.spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Ok(())
    }

    /// Stops listening and drops every forwarded connection.
    pub async fn cut(&mut self) {
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Parses an etcd endpoint `http://host:port` into a socket address.
pub fn etcd_addr(endpoint: &str) -> SocketAddr {
    endpoint
        .trim_start_matches("http://")
        .parse()
        .expect("etcd endpoints of the test cluster are host:port")
}
