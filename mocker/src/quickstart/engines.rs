//! The quickstart's engines: how the mock workers join the cluster.
//!
//! - [`Engines::Vllm`] (the default): `kv-mocker engines --kv-events vllm`, each
//!   worker a vLLM stand-in publishing vLLM 0.33's ZMQ KV events and serving OpenAI
//!   HTTP and vLLM's `/metrics`; one `kv-router relay` per worker subscribes to its
//!   sockets, republishes to NATS, scrapes its load and registers it in etcd. The
//!   path a real vLLM deployment takes, with no engine change.
//! - [`Engines::Nats`]: `kv-mocker engines` speaking the router's protocol on NATS
//!   and registering themselves in etcd; no relay.
//!
//! A disaggregated fleet (`--prefill-engines`, `--decode-engines`) is two such
//! groups, each one `kv-mocker engines` process in its role (`fleet`), whose relays
//! register the role.
//!
//! Ports (vLLM mode, per group): worker `i` of `n` listens on HTTP `base + i`, ZMQ
//! PUB `base + n + i`, ZMQ replay `base + 2n + i` (and an SGLang prefill worker's
//! bootstrap rooms on `base + 3n + i`), one block of loopback ports probed free
//! together ([`free_port_block`]). As for nats-server and etcd, another
//! process can take a port between the probe and the bind; the engines then exit with
//! "address already in use" and the quickstart retries on a fresh block
//! ([`PORT_ATTEMPTS`] times).
//!
//! Readiness: the engines log `kv-mocker engines ready` once every socket is bound;
//! the relays are ready when every worker's registration is in etcd, read from a
//! watch (no polling), while a relay that dies is reported at once.

use super::fleet::{self, Group};
use super::relay::{RelayTarget, relay_args};
use super::stack::{Binaries, StartedProcesses, child_command};
use super::{ENGINES_READY, QuickstartArgs, READY_TIMEOUT, progress};
use crate::replay::ReplayTarget;
use anyhow::{Context, anyhow, bail};
use etcd_client::{EventType, GetOptions, WatchOptions};
use std::collections::BTreeSet;
use std::net::TcpListener;
use testbed::{PORT_ATTEMPTS, ProcessError, free_port};

/// How the quickstart's mock engines publish KV events and join the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engines {
    /// As vLLM does (ZMQ), each worker behind its own `kv-router relay`.
    Vllm,
    /// The router's protocol on NATS; the engines register themselves.
    Nats,
}

/// Starts the engines (and, in vLLM mode, their relays) and returns once every worker
/// is registered in etcd.
///
/// # Errors
/// A child that fails to start, exits or is not ready within [`READY_TIMEOUT`]; no
/// free port block; etcd unreadable.
pub(super) async fn start(
    args: &QuickstartArgs,
    stack: &mut StartedProcesses,
    binaries: &Binaries,
    connection: &[&str],
    target: &ReplayTarget,
) -> anyhow::Result<()> {
    let groups = fleet::groups(args);
    for group in &groups {
        start_group(args, group, stack, binaries, connection).await?;
    }
    if args.engines == Engines::Vllm {
        let workers: u32 = groups.iter().map(|g| g.workers).sum();
        stack
            .unless_a_child_exits(tokio::time::timeout(
                READY_TIMEOUT,
                wait_for_registrations(target, usize::try_from(workers)?),
            ))
            .await?
            .map_err(|_| {
                anyhow!(
                    "the relays did not register every worker within {READY_TIMEOUT:?}; see {}/relay-*.log",
                    stack.logs.display()
                )
            })??;
        progress(&format!(
            "{workers} relays (kv-router relay) registered the engines in etcd, each with a worker id \
             it claimed and the block size and KV capacity it read from its engine"
        ));
    }
    Ok(())
}

/// Starts one group's `kv-mocker engines` process and, in vLLM mode, a relay per
/// worker registering the group's role.
async fn start_group(
    args: &QuickstartArgs,
    group: &Group,
    stack: &mut StartedProcesses,
    binaries: &Binaries,
    connection: &[&str],
) -> anyhow::Result<()> {
    let model = [
        "--workers".to_owned(),
        group.workers.to_string(),
        "--first-worker-id".to_owned(),
        group.first_worker_id.to_string(),
        "--block-size".to_owned(),
        args.block_size.to_string(),
        "--num-gpu-blocks".to_owned(),
        args.num_gpu_blocks.to_string(),
        "--time-scale".to_owned(),
        args.time_scale.to_string(),
    ];
    let shape = format!(
        "({} KV blocks of {} tokens each, time scale {}x)",
        args.num_gpu_blocks, args.block_size, args.time_scale
    );
    let what = match group.role {
        fleet::Role::Aggregated => "mock engines".to_owned(),
        _ => format!("{} mock engines", group.label),
    };
    let n = u16::try_from(group.workers).context("--workers")?;
    let label = match group.role {
        fleet::Role::Aggregated => "engines".to_owned(),
        _ => format!("engines-{}", group.label),
    };
    match args.engines {
        Engines::Nats => {
            let bootstrap = group
                .bootstrap()
                .then(|| free_port_block(usize::from(n)))
                .transpose()?;
            let mut command = child_command(&binaries.mocker);
            command
                .arg("engines")
                .args(connection)
                .args(model)
                .args(group.role_flags(bootstrap));
            let engines = stack.spawn(&label, command)?;
            engines.wait_for_line(ENGINES_READY, READY_TIMEOUT).await?;
            progress(&format!(
                "{} {what} registered in etcd {shape}",
                group.workers
            ));
        }
        Engines::Vllm => {
            let ports = start_vllm_engines(group, &label, stack, binaries, &model).await?;
            progress(&format!(
                "{} {what} in vLLM mode, ZMQ KV events {shape}",
                group.workers
            ));
            for i in 0..n {
                let engine = RelayTarget {
                    name: format!("{}-{i}", group.label),
                    http_url: format!("http://127.0.0.1:{}", ports.http + i),
                    publish: format!("tcp://127.0.0.1:{}", ports.publish + i),
                    replay: format!("tcp://127.0.0.1:{}", ports.replay + i),
                };
                let relay = match group.role {
                    fleet::Role::Aggregated => format!("relay-{i}"),
                    _ => format!("relay-{}-{i}", group.label),
                };
                let mut command = child_command(&binaries.router);
                command
                    .args(relay_args(&engine, connection))
                    .args(group.role_flags(ports.bootstrap.map(|p| p + i)));
                stack.spawn(&relay, command)?;
            }
        }
    }
    Ok(())
}

/// The first port of each kind of a group's workers (worker `i` at + `i`).
struct GroupPorts {
    http: u16,
    publish: u16,
    replay: u16,
    bootstrap: Option<u16>,
}

/// Spawns a group's `kv-mocker engines --kv-events vllm` on a free port block until
/// it is ready, retrying on a port taken meanwhile.
async fn start_vllm_engines(
    group: &Group,
    label: &str,
    stack: &mut StartedProcesses,
    binaries: &Binaries,
    model: &[String],
) -> anyhow::Result<GroupPorts> {
    let n = u16::try_from(group.workers).context("--workers")?;
    let kinds = if group.bootstrap() { 4 } else { 3 };
    let mut attempt = 1;
    loop {
        let base = free_port_block(kinds * usize::from(n))?;
        let ports = GroupPorts {
            http: base,
            publish: base + n,
            replay: base + 2 * n,
            bootstrap: group.bootstrap().then_some(base + 3 * n),
        };
        let flags = [
            "--http-port".to_owned(),
            ports.http.to_string(),
            "--zmq-port".to_owned(),
            ports.publish.to_string(),
            "--zmq-replay-port".to_owned(),
            ports.replay.to_string(),
        ];
        let mut command = child_command(&binaries.mocker);
        command
            // Development endpoints on, as vLLM with VLLM_SERVER_DEV_MODE=1: the
            // cold start between policies resets every engine's prefix cache.
            .args(["engines", "--kv-events", "vllm", "--vllm-dev-mode"])
            .args(model)
            .args(flags)
            .args(group.role_flags(ports.bootstrap));
        let engines = stack.spawn(label, command)?;
        match engines.wait_for_line(ENGINES_READY, READY_TIMEOUT).await {
            Ok(_) => return Ok(ports),
            Err(err) if err.is_port_conflict() && attempt < PORT_ATTEMPTS => {
                tracing::info!(attempt, base, "engine port taken, retrying");
                stack.stop_child(label).await?;
                attempt += 1;
            }
            Err(err) => return Err(err.into()),
        }
    }
}

/// Probes for `len` consecutive free loopback TCP ports (all bound at once, then
/// released) and returns the first. See the module docs for the race.
///
/// # Errors
/// [`ProcessError::Io`] if no port can be probed, or no block was found in
/// [`PORT_ATTEMPTS`] × 4 tries.
pub(super) fn free_port_block(len: usize) -> Result<u16, ProcessError> {
    for _ in 0..PORT_ATTEMPTS * 4 {
        let first = free_port()?;
        let Some(last) = usize::from(first)
            .checked_add(len.saturating_sub(1))
            .filter(|&p| p <= usize::from(u16::MAX))
        else {
            continue;
        };
        let bound: Result<Vec<TcpListener>, _> = (usize::from(first)..=last)
            .map(|port| TcpListener::bind(("127.0.0.1", port as u16)))
            .collect();
        if bound.is_ok() {
            return Ok(first);
        }
    }
    Err(ProcessError::Io {
        context: format!("probing for {len} consecutive free ports"),
        source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
    })
}

/// Returns once `workers` registration keys are in etcd (the relays claim their own
/// worker ids, so the keys are counted, not named): one listing, then a watch from
/// the revision after it, so no registration in between is missed.
async fn wait_for_registrations(target: &ReplayTarget, workers: usize) -> anyhow::Result<()> {
    let prefix = target.subjects.etcd_worker_prefix();
    let mut etcd = target.etcd.clone();
    let listed = etcd
        .get(
            prefix.as_str(),
            Some(GetOptions::new().with_prefix().with_keys_only()),
        )
        .await?;
    let mut present: BTreeSet<Vec<u8>> = listed.kvs().iter().map(|kv| kv.key().to_vec()).collect();
    let revision = listed.header().map_or(0, |h| h.revision());
    let mut watch = etcd
        .watch(
            prefix.as_str(),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        )
        .await?;
    while present.len() < workers {
        let Some(response) = watch.message().await? else {
            bail!("etcd closed the watch of {prefix}");
        };
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            match event.event_type() {
                EventType::Put => present.insert(kv.key().to_vec()),
                EventType::Delete => present.remove(kv.key()),
            };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_block_is_free_as_a_whole() {
        let first = free_port_block(24).expect("a free block");
        let held: Vec<TcpListener> = (first..first + 24)
            .map(|p| TcpListener::bind(("127.0.0.1", p)).expect("free"))
            .collect();
        assert_eq!(held.len(), 24);
    }
}
