//! The route path's own thread: a current-thread tokio runtime with its own NATS
//! connection, running the route and batch route services, the lifecycle intake and
//! replica sync (its connection, its publisher and its peers' intake).
//!
//! Why: per route the daemon reads a query, decides, writes the reply, queues a
//! booking step for the peers, reads the frontend's `freed` and queues its step. On
//! the main multi-thread runtime those are separate tasks — async-nats's connection
//! tasks (socket reads and writes), the route service, the lifecycle intake, the sync
//! publisher — and a task woken from the other worker thread costs a futex wake-up
//! and a task switch, or wakes a parked worker. Here they share one thread: a query,
//! its decision, its reply and its steps never cross threads, and the replies of every
//! route decided in one pass of the thread leave in one socket write (the connection
//! task writes everything queued by the time it runs). The KV event intake, load
//! metrics, discovery, recovery and HTTP stay on the main runtime, so an event flood
//! still has the other core.
//!
//! Measured (`docs/benchmarks.md`, "Routing service"): daemon CPU per route at 64
//! ranks and 32 in flight −30% (15 → 10.5 µs), routes/s +25%, round trip p50 −20%.
//! Moving the route path alone, with the sync publisher left on the main runtime,
//! cost +40% instead: each route's steps woke a parked main-runtime worker.
//!
//! Cost: one more NATS connection and one more OS thread; every route is decided on
//! that one thread, so one replica's routing uses one core at most (a second replica,
//! or `route_batch`, is how to use more).
//!
//! Shutdown: the services are spawned on the daemon's intake tracker, so
//! `Daemon::shutdown` waits for them like for any other intake task (queries already
//! received are answered); [`RouteThread::close`] then drains the connection and ends
//! the thread. Dropping the handle ends the thread too, cancelling whatever still runs
//! on it (a failed or abandoned start).

use crate::health::{Health, Link};
use anyhow::Context;
use kv_cluster::nats::NatsConfig;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The thread and its runtime; ends the thread when dropped.
struct Thread {
    handle: tokio::runtime::Handle,
    stop: CancellationToken,
    ended: Option<oneshot::Receiver<()>>,
}

impl Drop for Thread {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The route path's thread and NATS connection (see the module docs).
pub(crate) struct RouteThread {
    thread: Thread,
    client: async_nats::Client,
}

impl RouteThread {
    /// Starts the thread and opens its NATS connection, whose events `health` tracks
    /// like the main connection's (retried in the background until a server answers).
    ///
    /// # Errors
    /// When the thread cannot be started or the NATS options are unusable.
    pub(crate) async fn start(config: &NatsConfig, health: Arc<Health>) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("building the route runtime")?;
        let stop = CancellationToken::new();
        let (ended_tx, ended) = oneshot::channel();
        let thread = Thread {
            handle: runtime.handle().clone(),
            stop: stop.clone(),
            ended: Some(ended),
        };
        std::thread::Builder::new()
            .name("kv-router-routes".into())
            .spawn(move || {
                runtime.block_on(stop.cancelled());
                // Cancels what still runs on it (nothing after an orderly shutdown).
                drop(runtime);
                let _ = ended_tx.send(());
            })
            .context("starting the route thread")?;
        // Connected from the thread, so async-nats spawns its connection task there.
        let config = config.clone();
        let client = thread
            .handle
            .spawn(async move { crate::nats::connect(&config, health, Link::Routes).await })
            .await
            .context("the route thread stopped")?
            .context("configuring the route NATS connection")?;
        Ok(Self { thread, client })
    }

    /// The thread's NATS connection: subscribe the route path's subjects on it and
    /// reply with it.
    pub(crate) fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Runs `task` on the thread, tracked by `tasks`.
    pub(crate) fn spawn<F>(&self, tasks: &TaskTracker, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        tasks.spawn_on(task, &self.thread.handle);
    }

    /// A server round trip on `main` and on this thread's connection at once
    /// ([`kv_cluster::barrier::server_barrier`]): every subscription or unsubscribe made
    /// on either before is registered.
    ///
    /// # Errors
    /// The first connection's barrier error.
    pub(crate) async fn barrier_with(
        &self,
        main: &async_nats::Client,
    ) -> Result<(), kv_cluster::barrier::BarrierError> {
        let (main, routes) = tokio::join!(
            kv_cluster::barrier::server_barrier(main),
            kv_cluster::barrier::server_barrier(&self.client),
        );
        main.and(routes)
    }

    /// Runs `task` on the thread and waits for its output (what it spawns runs there).
    ///
    /// # Errors
    /// When the thread has stopped.
    pub(crate) async fn run<F>(&self, task: F) -> anyhow::Result<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.thread
            .handle
            .spawn(task)
            .await
            .context("the route thread stopped")
    }

    /// Drains the connection (once the services have stopped), then ends the thread.
    ///
    /// # Errors
    /// The NATS client's error when the drain cannot be requested.
    pub(crate) async fn close(mut self) -> Result<(), async_nats::client::DrainError> {
        let drained = self.client.drain().await;
        self.thread.stop.cancel();
        if let Some(ended) = self.thread.ended.take() {
            let _ = ended.await;
        }
        drained
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::metrics::{ConnectionMetrics, Registrar};
    use std::time::Duration;

    /// A route thread whose connection is never up (nothing listens on port 1; the
    /// client retries in the background).
    async fn route_thread() -> RouteThread {
        let config = NatsConfig {
            servers: vec!["nats://127.0.0.1:1".into()],
            auth: Default::default(),
            tls: Default::default(),
            inbox_prefix: None,
        };
        let metrics = ConnectionMetrics::new(&Registrar::unregistered()).unwrap();
        RouteThread::start(&config, Arc::new(Health::new(metrics)))
            .await
            .unwrap()
    }

    fn thread_name() -> Option<String> {
        std::thread::current().name().map(str::to_owned)
    }

    #[tokio::test]
    async fn tasks_run_on_the_route_thread_and_close_waits_for_them() {
        let thread = route_thread().await;
        let name = thread.run(async { thread_name() }).await.unwrap();
        assert_eq!(name.as_deref(), Some("kv-router-routes"));
        assert_ne!(thread_name(), name, "the caller's thread is another one");

        let tasks = TaskTracker::new();
        let (tx, rx) = oneshot::channel();
        thread.spawn(&tasks, async move {
            tx.send(thread_name()).unwrap();
        });
        tasks.close();
        tasks.wait().await;
        assert_eq!(rx.await.unwrap().as_deref(), Some("kv-router-routes"));
        thread.close().await.unwrap();
    }

    /// Sends on drop: tells whether a task was dropped.
    struct Dropped(Option<oneshot::Sender<()>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            let _ = self.0.take().unwrap().send(());
        }
    }

    #[tokio::test]
    async fn dropping_it_ends_the_thread_and_cancels_its_tasks() {
        let thread = route_thread().await;
        let tasks = TaskTracker::new();
        let (tx, dropped) = oneshot::channel();
        let guard = Dropped(Some(tx));
        thread.spawn(&tasks, async move {
            let _guard = guard;
            std::future::pending::<()>().await;
        });
        drop(thread);
        // A bound for a hang only (a failing test must end), not a timing assertion.
        tokio::time::timeout(Duration::from_secs(30), dropped)
            .await
            .expect("the task still runs: the thread did not end")
            .unwrap();
        tasks.close();
        tasks.wait().await;
    }
}
