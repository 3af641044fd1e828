//! Telling a router replica that stalls from one that is busy, so that a query held
//! by a stalled replica can be asked again of a live one.
//!
//! Why: a replica that stalls (a process stopped or starved of CPU, a partition that
//! resets no connection) keeps its NATS subscriptions, so NATS goes on delivering
//! queries to it, and they wait for it to resume or for the route timeout (10 s).
//! Replica affinity stops sending it more once the patience runs out (module
//! `router::asker`), but not the queries it already holds. A slow answer alone does
//! not tell a stall: a query may wait in a live replica's queue while every worker is
//! busy, and asking it again elsewhere would then only add a second waiter. So when a
//! query has waited out the patience, the gateway pings every replica it has heard
//! from (the readiness probe, an empty prompt every router refuses without booking
//! anything, on each replica's own subject). A replica still silent once its peers
//! have answered (the verdict's margin: `verdict_after`), or that NATS says is gone,
//! may hold the query; a replica that answered is alive and is asked again. When
//! every replica answers, the query is waiting in a live one's queue and is left
//! alone; when none answers, the trouble is not one replica's and there is nobody to
//! ask.
//!
//! The replicas heard from are also where a pin goes under [`super::PinTarget::Lowest`]
//! ([`Stalls::lowest`]): the lowest id among them, leaving out those gone, silent, or
//! overloaded or slow within the last window ([`Stalls::avoid`]). Besides the answers
//! to its queries, the gateway hears of replicas from roll calls
//! ([`Stalls::discover`], module `router::roll_call`).
//!
//! Cost: nothing while queries are answered within the patience, apart from one
//! mutex lock per answer to note which replica answered. During a stall, one round
//! of pings (one small request per replica heard from) per patience, shared by every
//! query waiting then.

use kv_events::{RouterId, Subjects};
use prometheus::IntCounter;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{debug, warn};

/// Most replicas remembered; beyond it the one heard from longest ago is forgotten.
const MAX_KNOWN: usize = 64;

/// A replica not heard from for this long is forgotten (it left, or restarted under
/// a new id).
const FORGET_AFTER: Duration = Duration::from_secs(600);

/// What is known of one replica.
#[derive(Clone, Copy)]
struct Heard {
    /// When it last answered a query.
    at: Instant,
    /// Whether it missed its latest ping (logged once, when it starts).
    silent: bool,
    /// Until when it is not pinned to under [`super::PinTarget::Lowest`]: it answered
    /// `overloaded`, or a pin to it was let go (no answer in time, an error).
    avoid_until: Option<Instant>,
}

/// Roll calls of one gateway ([`Stalls::discover`]).
#[derive(Default)]
struct Calls {
    /// One is out.
    out: bool,
    /// Another was asked for while it was out: its reason (a replica heard of for the
    /// first time) may be newer than the replies of the one out.
    again: bool,
}

/// The replicas heard from, and the latest round of pings (module docs).
pub(super) struct Stalls {
    nats: async_nats::Client,
    subjects: Arc<Subjects>,
    /// How long a ping may go unanswered while no replica answers, and how long a
    /// round's finding holds.
    patience: Duration,
    /// The replicas heard from.
    known: Mutex<HashMap<RouterId, Heard>>,
    /// Replicas heard of for the first time, counted: a pin taken before the count
    /// changed may have a lower replica to move to ([`Stalls::generation`]).
    generation: AtomicU64,
    /// Whether a roll call is out, and whether another was asked for meanwhile
    /// ([`Stalls::discover`]).
    calls: Mutex<Calls>,
    /// The latest round: when it ended and what it found. Held while a round runs,
    /// so queries that wait meanwhile share its finding.
    latest: tokio::sync::Mutex<Option<(Instant, Option<RouterId>)>>,
    /// Replicas found stalled or gone (`kv_gateway_route_stalls_total`).
    found: IntCounter,
}

impl Stalls {
    /// Pings on `subjects`' per-replica route subjects, waiting `patience` for each.
    pub(super) fn new(
        nats: async_nats::Client,
        subjects: Arc<Subjects>,
        patience: Duration,
        found: IntCounter,
    ) -> Self {
        Self {
            nats,
            subjects,
            patience,
            known: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
            calls: Mutex::new(Calls::default()),
            latest: tokio::sync::Mutex::new(None),
            found,
        }
    }

    /// How long a query may wait before a replica is suspected, and a ping may go
    /// unanswered.
    pub(super) fn patience(&self) -> Duration {
        self.patience
    }

    /// Notes that `router` answered a query now; true when it was not known.
    pub(super) fn heard(&self, router: RouterId) -> bool {
        self.note(router, false)
    }

    /// How many times a replica was heard of for the first time (or again after it
    /// was forgotten); a pin compares it with the count when it was taken.
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Notes that `router` answered a readiness probe now: it is live, but says
    /// nothing of its load, so a replica avoided stays avoided.
    fn answered_probe(&self, router: RouterId) {
        self.note(router, true);
    }

    /// Notes that `router` answered now, keeping when it is avoided until if
    /// `keep_avoided`; forgets the replica heard from longest ago past [`MAX_KNOWN`].
    /// True when `router` was not known.
    fn note(&self, router: RouterId, keep_avoided: bool) -> bool {
        let now = Instant::now();
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let avoid_until = keep_avoided
            .then(|| known.get(&router).and_then(|h| h.avoid_until))
            .flatten();
        let heard = Heard {
            at: now,
            silent: false,
            avoid_until,
        };
        let new = known.insert(router, heard).is_none();
        if new {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
        if new && known.len() > MAX_KNOWN {
            let oldest = known.iter().min_by_key(|(_, h)| h.at).map(|(id, _)| *id);
            if let Some(oldest) = oldest {
                known.remove(&oldest);
            }
        }
        new
    }

    /// Leaves `router` out of [`Stalls::lowest`] until `until` (it answered
    /// `overloaded`, or a pin to it was let go); an answer to a query from it before
    /// then that is neither ends that early ([`Stalls::heard`]).
    pub(super) fn avoid(&self, router: RouterId, until: Instant) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(heard) = known.get_mut(&router) {
            heard.avoid_until = Some(until);
        }
    }

    /// Forgets `router`: NATS says nothing subscribes its subject (it left, or
    /// restarted under a new id).
    pub(super) fn forget(&self, router: RouterId) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known.remove(&router);
    }

    /// The lowest id among `answered` (a replica that just answered) and the
    /// replicas heard from that are neither silent nor avoided now.
    pub(super) fn lowest(&self, answered: RouterId) -> RouterId {
        self.lowest_known()
            .map_or(answered, |known| known.min(answered))
    }

    /// The lowest id among the replicas heard from that are neither silent nor
    /// avoided now. O(replicas known), at most [`MAX_KNOWN`].
    pub(super) fn lowest_known(&self) -> Option<RouterId> {
        let now = Instant::now();
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known
            .iter()
            .filter(|(_, h)| !h.silent && h.avoid_until.is_none_or(|until| until <= now))
            .map(|(id, _)| *id)
            .min()
    }

    /// Calls the roll in the background and notes every replica that answers: how
    /// the gateway hears of replicas without placing a query on them. When none
    /// answers (no replica is up, or only replicas from before the roll call), sends
    /// `probes` readiness probes through the route queue group instead, each noting
    /// the replica that answers it within the patience. One roll call at a time: a
    /// call asked for while one is out is made once that one is done. Needs a tokio
    /// runtime.
    pub(super) fn discover(self: &Arc<Self>, probes: usize) {
        {
            let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
            if calls.out {
                calls.again = true;
                return;
            }
            calls.out = true;
        }
        let stalls = Arc::clone(self);
        tokio::spawn(async move {
            let wait = super::roll_call::ROLL_CALL_WAIT.min(stalls.patience);
            loop {
                let subject = stalls.subjects.router_roll_call();
                // Noted as each reply comes: a pin moves to a lower replica at once.
                let note = |router| stalls.answered_probe(router);
                let heard =
                    super::roll_call::roll_call(&stalls.nats, subject, wait, MAX_KNOWN, note).await;
                if heard == 0 {
                    stalls.probe(probes);
                }
                let mut calls = stalls.calls.lock().unwrap_or_else(|p| p.into_inner());
                if !std::mem::take(&mut calls.again) {
                    calls.out = false;
                    break;
                }
            }
        });
    }

    /// Sends `probes` readiness probes through the route queue group at once, in the
    /// background, noting the replica that answers each.
    fn probe(self: &Arc<Self>, probes: usize) {
        for _ in 0..probes {
            let stalls = Arc::clone(self);
            tokio::spawn(async move {
                let subject: async_nats::Subject = stalls.subjects.route().into();
                if let Some(router) =
                    super::probe_replica(&stalls.nats, subject, stalls.patience).await
                {
                    stalls.answered_probe(router);
                }
            });
        }
    }

    /// A live replica to ask a slow query again, if another replica heard from seems
    /// to have stalled or is gone; `None` when every replica answers its ping (the
    /// query waits in a live one's queue) or none does. Pings at most once per
    /// patience; concurrent callers share the round.
    pub(super) async fn live_instead(&self) -> Option<RouterId> {
        let mut latest = self.latest.lock().await;
        if let Some((at, finding)) = *latest
            && at.elapsed() < self.patience
        {
            return finding;
        }
        let finding = self.ping_all().await;
        *latest = Some((Instant::now(), finding));
        finding
    }

    /// One round of pings (module docs); forgets the replicas NATS says are gone.
    async fn ping_all(&self) -> Option<RouterId> {
        let routers: Vec<RouterId> = {
            let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
            known.retain(|_, h| h.at.elapsed() < FORGET_AFTER);
            known.keys().copied().collect()
        };
        let mut pings = JoinSet::new();
        let mut pending: HashSet<RouterId> = routers.iter().copied().collect();
        for router in routers {
            let (nats, subject) = (self.nats.clone(), self.subjects.route_at(router).into());
            let patience = self.patience;
            pings.spawn(async move { (router, super::ping(&nats, subject, patience).await) });
        }
        let started = Instant::now();
        let mut deadline = started + self.patience;
        let mut live = None;
        let mut silent = 0_usize;
        loop {
            let pinged = tokio::select! {
                pinged = pings.join_next() => pinged,
                () = tokio::time::sleep_until(deadline) => {
                    // Every ping still out is late: its replica is silent.
                    pings.abort_all();
                    for router in pending.drain() {
                        silent += 1;
                        self.silent(router, false);
                    }
                    break;
                }
            };
            let Some(pinged) = pinged else { break };
            // A ping task panics only if the runtime is going down.
            let Ok((router, answered)) = pinged else {
                continue;
            };
            pending.remove(&router);
            match answered {
                Ok(()) => {
                    if live.is_none() {
                        deadline = deadline
                            .min(started + super::verdict_after(started.elapsed(), self.patience));
                    }
                    live.get_or_insert(router);
                }
                Err(gone) => {
                    silent += 1;
                    self.silent(router, gone);
                }
            }
        }
        debug!(silent, ?live, "pinged the router replicas");
        live.filter(|_| silent > 0)
    }

    /// Counts `router` as silent (or `gone`, which forgets it), logging the first time.
    fn silent(&self, router: RouterId, gone: bool) {
        self.found.inc();
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let first = if gone {
            known.remove(&router).is_some_and(|h| !h.silent)
        } else {
            known
                .get_mut(&router)
                .is_some_and(|h| !std::mem::replace(&mut h.silent, true))
        };
        if first {
            warn!(%router, gone, patience = ?self.patience, "a router replica did not answer its ping in time; the slow queries it holds are asked again of a live replica, if one answers");
        }
    }
}
