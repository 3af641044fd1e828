//! A local test bed: real nats-server and etcd processes on free loopback ports, and a
//! managed child process type for the router daemon and the mock engines.
//!
//! The quickstart, the integration tests and the benchmarks need the real
//! infrastructure: an in-memory fake would not catch subject, codec, lease or ordering
//! mistakes. Each server gets fresh loopback ports and a temporary data directory,
//! readiness is detected by reading the server's own log line (no sleeps, no connection
//! polling), and every process is killed and reaped when its handle is dropped, so a
//! failing test does not leak servers. Starting a server costs one process spawn and,
//! typically, 10–300 ms until it reports ready.
//!
//! Every child is put in its own process group, so a Ctrl-C in the terminal reaches
//! only the quickstart, which then stops the children in order.
//!
//! This is its own crate, apart from the mock engine, because it is a process
//! supervisor for tests and demos, not a cluster participant: the integration tests
//! and benchmarks use it without the engines, and the engines run without it.
//!
//! # Layout
//! - `process`: [`ManagedProcess`]: spawn, log capture and forwarding, wait for a log
//!   line, graceful stop.
//! - `servers`: [`NatsServer`] and [`EtcdServer`], and [`free_port`].
//! - `error`: [`ProcessError`].

mod error;
mod process;
mod servers;

pub use error::ProcessError;
pub use process::{Echo, ManagedProcess, find_on_path};
pub use servers::{
    EtcdServer, EtcdServerTls, NatsServer, PORT_ATTEMPTS, READY_TIMEOUT, STOP_GRACE, free_port,
};
