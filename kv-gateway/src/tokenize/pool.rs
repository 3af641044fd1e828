//! A bounded pool of tokenizer threads: at most `threads` encodes run at once, at most
//! `queue` more wait, and anything beyond is refused at once.
//!
//! Why: encoding a long prompt is milliseconds to seconds of CPU. Handed to tokio's
//! blocking pool without a bound, dozens of 10k–120k-token encodes ran at once on a
//! 2-core machine, and the gateway's async workers — routing, relaying every other
//! request's stream — waited for the CPU behind them (the route stage, a millisecond
//! of the router's time, took 2.9 s). With at most about a core's worth of encode
//! threads the async workers always get their share, and the tokenizer's memory,
//! 150–170 bytes per prompt byte while an encode runs, is bounded by
//! `threads × --max-prompt-bytes`, not by how many clients send long prompts at once.
//!
//! The threads are the pool's own (named `kv-tokenize-N`), not tokio's blocking pool:
//! glibc's malloc keeps freed memory in per-thread arenas, so a fixed set of threads
//! also bounds what an idle gateway keeps after a burst of long prompts.
//!
//! Cost: one boxed closure, a channel send and a oneshot per job, microseconds; a
//! request that finds the pool full gets an error instead of a wait.

use std::num::NonZeroUsize;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Semaphore, oneshot};
use tokio::time::Instant;

type Job = Box<dyn FnOnce() + Send>;

/// Why a job did not run to its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolError {
    /// `threads` jobs run and `queue` wait: refused without waiting.
    Full,
    /// The job had not finished by its deadline (it is skipped if it had not
    /// started; a running encode finishes, its result unused).
    Deadline,
    /// The job panicked (its thread goes on with the next job).
    Panicked,
}

/// A finished job's value and timings.
#[derive(Debug)]
pub struct Ran<T> {
    /// What the job returned.
    pub value: T,
    /// Time from submission to a thread starting it.
    pub waited: Duration,
    /// Time the job ran.
    pub ran: Duration,
}

/// The pool. Cheap to share behind an `Arc`; its threads end when it is dropped.
#[derive(Debug)]
pub struct TokenizerPool {
    /// One permit per job admitted (running or waiting): `threads + queue`.
    admitted: Arc<Semaphore>,
    jobs: SyncSender<Job>,
    threads: usize,
    queue: usize,
}

impl TokenizerPool {
    /// Starts `threads` threads with room for `queue` waiting jobs.
    ///
    /// # Errors
    /// When a thread cannot be spawned (the operating system's thread limit).
    pub fn start(threads: NonZeroUsize, queue: usize) -> std::io::Result<Self> {
        let admitted = threads.get().saturating_add(queue);
        let (jobs, receiver) = sync_channel::<Job>(admitted);
        let receiver = Arc::new(Mutex::new(receiver));
        for i in 0..threads.get() {
            let receiver = Arc::clone(&receiver);
            std::thread::Builder::new()
                .name(format!("kv-tokenize-{i}"))
                .spawn(move || work(&receiver))?;
        }
        Ok(Self {
            admitted: Arc::new(Semaphore::new(admitted)),
            jobs,
            threads: threads.get(),
            queue,
        })
    }

    /// Encode threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Jobs that may wait for a thread.
    pub fn queue(&self) -> usize {
        self.queue
    }

    /// Jobs admitted now (running or waiting).
    pub fn admitted(&self) -> usize {
        (self.threads + self.queue).saturating_sub(self.admitted.available_permits())
    }

    /// Runs `job` on a pool thread and waits for its value, until `deadline`.
    ///
    /// The job holds its place in the pool until it returns, even if the caller
    /// stops waiting (a client that disconnects cannot free a thread still encoding);
    /// a job whose caller stopped waiting before it started is skipped.
    ///
    /// # Errors
    /// [`PoolError::Full`] at once when the pool and its queue are full;
    /// [`PoolError::Deadline`], [`PoolError::Panicked`].
    pub async fn run<T, F>(&self, deadline: Instant, job: F) -> Result<Ran<T>, PoolError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let permit = Arc::clone(&self.admitted)
            .try_acquire_owned()
            .map_err(|_| PoolError::Full)?;
        let (tx, rx) = oneshot::channel();
        let queued = Instant::now();
        let boxed: Job = Box::new(move || {
            let _place = permit;
            if tx.is_closed() {
                return;
            }
            let started = Instant::now();
            let value = job();
            // The caller may have stopped waiting meanwhile: nothing to do then.
            let _ = tx.send(Ran {
                value,
                waited: started - queued,
                ran: started.elapsed(),
            });
        });
        match self.jobs.try_send(boxed) {
            Ok(()) => {}
            // The channel holds as many jobs as there are permits, so it is never
            // full for a job holding one; and the threads outlive the sender.
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                return Err(PoolError::Full);
            }
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(ran)) => Ok(ran),
            Ok(Err(_)) => Err(PoolError::Panicked),
            Err(_) => Err(PoolError::Deadline),
        }
    }
}

/// A pool thread: takes jobs until the pool is dropped. A panicking job ends only
/// itself (its caller sees [`PoolError::Panicked`]).
fn work(receiver: &Mutex<Receiver<Job>>) {
    loop {
        let job = {
            let Ok(receiver) = receiver.lock() else {
                return;
            };
            match receiver.recv() {
                Ok(job) => job,
                Err(_) => return,
            }
        };
        // The job's own state (a permit, a oneshot sender) is dropped while
        // unwinding, so nothing is left inconsistent.
        let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test set-up

    use super::*;
    use std::sync::mpsc;

    fn pool(threads: usize, queue: usize) -> TokenizerPool {
        TokenizerPool::start(NonZeroUsize::new(threads).unwrap(), queue).unwrap()
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    /// A job that runs until the test sends on the returned channel.
    fn blocking(started: mpsc::Sender<()>) -> (mpsc::Sender<()>, impl FnOnce() -> u32) {
        let (release, wait) = mpsc::channel::<()>();
        (release, move || {
            started.send(()).unwrap();
            wait.recv().unwrap();
            7
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_pool_refuses_at_once_and_frees_its_place_when_a_job_ends() {
        let pool = Arc::new(pool(1, 1));
        let (started_tx, started) = mpsc::channel();
        let (release, job) = blocking(started_tx.clone());
        let running = tokio::spawn({
            let pool = Arc::clone(&pool);
            async move { pool.run(far(), job).await }
        });
        started.recv().unwrap();
        let waiting = tokio::spawn({
            let pool = Arc::clone(&pool);
            async move { pool.run(far(), || 8).await }
        });
        // The queued job holds the one queue place once admitted.
        until(|| pool.admitted() == 2).await;
        assert_eq!(pool.run(far(), || 9).await.unwrap_err(), PoolError::Full);
        release.send(()).unwrap();
        assert_eq!(running.await.unwrap().unwrap().value, 7);
        let queued = waiting.await.unwrap().unwrap();
        assert_eq!(queued.value, 8);
        assert_eq!(pool.run(far(), || 10).await.unwrap().value, 10);
        // The worker thread gives the place back just after it sends the answer.
        until(|| pool.admitted() == 0).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_past_its_deadline_keeps_its_thread_until_it_ends() {
        let pool = pool(1, 0);
        let (started_tx, started) = mpsc::channel();
        let (release, job) = blocking(started_tx);
        let soon = Instant::now() + Duration::from_millis(50);
        let outcome = tokio::spawn(async move {
            let result = pool.run(soon, job).await.map(|r| r.value);
            (result, pool)
        });
        started.recv().unwrap();
        let (result, pool) = outcome.await.unwrap();
        assert_eq!(result.unwrap_err(), PoolError::Deadline);
        // Still encoding: the thread is not free for another job.
        assert_eq!(pool.admitted(), 1);
        assert_eq!(pool.run(far(), || 1).await.unwrap_err(), PoolError::Full);
        release.send(()).unwrap();
        until(|| pool.admitted() == 0).await;
        assert_eq!(pool.run(far(), || 2).await.unwrap().value, 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_queued_job_whose_caller_left_is_skipped() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let pool = Arc::new(pool(1, 1));
        let (started_tx, started) = mpsc::channel();
        let (release, job) = blocking(started_tx);
        let running = tokio::spawn({
            let pool = Arc::clone(&pool);
            async move { pool.run(far(), job).await.map(|r| r.value) }
        });
        started.recv().unwrap();
        let ran = Arc::new(AtomicBool::new(false));
        let waiting = tokio::spawn({
            let (pool, ran) = (Arc::clone(&pool), Arc::clone(&ran));
            async move {
                pool.run(far(), move || ran.store(true, Ordering::SeqCst))
                    .await
            }
        });
        until(|| pool.admitted() == 2).await;
        waiting.abort(); // the client disconnects while its prompt waits
        assert!(waiting.await.unwrap_err().is_cancelled());
        release.send(()).unwrap();
        assert_eq!(running.await.unwrap().unwrap(), 7);
        until(|| pool.admitted() == 0).await;
        assert!(!ran.load(Ordering::SeqCst), "the abandoned job did not run");
    }

    #[tokio::test]
    async fn a_panicking_job_is_reported_and_its_thread_goes_on() {
        let pool = pool(1, 0);
        let result = pool.run(far(), || -> u32 { panic!("bad input") }).await;
        assert_eq!(result.unwrap_err(), PoolError::Panicked);
        assert_eq!(pool.run(far(), || 3).await.unwrap().value, 3);
    }

    /// Waits (up to 10 s) until `done` holds; the pool's permits move on its threads.
    async fn until(done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "condition not reached in 10 s");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
