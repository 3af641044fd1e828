//! Router replicas as the lab runs them: `N` schedulers in one route queue group,
//! each learning its peers' bookings and lifecycle steps a sync lag after they
//! happen, as `kv-router serve` replicas do over `{ns}.router.sequences`.
//!
//! Why: replicas index the same KV events (one tree serves them all here, since every
//! replica applies every event) but book apart. A query decided within the sync lag
//! of a peer's decision does not see that peer's booking; when a same-instant burst is
//! spread over several replicas (several gateways, or a gateway without replica
//! affinity), each replica places its share blind to the others' and they may all
//! pick the same best rank. The live study (`kv-mocker quickstart --router-replicas`)
//! measures this on a 2-core host whose wall time blurs the result; here it is
//! deterministic, on the whole trace.
//!
//! Model:
//! - each request's query goes to a replica drawn uniformly at random (seeded): the
//!   queue group with no affinity, or as many gateways as replicas behind a load
//!   balancer. One gateway with replica affinity sends a burst to one replica, which
//!   is the one-replica row;
//! - the deciding replica books at once; every peer applies the booking
//!   ([`scheduler::Scheduler::apply`], as the daemon applies a peer's `booked`) after
//!   `sync_lag`, and each lifecycle step of the request after the same lag, in order
//!   (the daemon's peers also receive the frontend's lifecycle messages directly, but
//!   cannot apply them before the booking has reached them);
//! - replica `r` seeds its tie-breaks with `seed + r`, so one replica is exactly the
//!   lab's single router.
//!
//! Cost: per route one booking copied per peer; per lifecycle event one step per peer.

use crate::error::LabError;
use kv_events::RequestId;
use kv_events::replicas::{RouterId, SequenceUpdate};
use kv_events::routing::LifecycleEvent;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use scheduler::{
    AddRequest, Origin, Overlaps, ScheduleRequest, Scheduler, SchedulerError, Selection,
    SequenceEvent,
};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// A step on its way to one peer.
#[derive(Debug)]
struct InFlight {
    /// When the peer applies it, in simulated ns.
    at_ns: u64,
    peer: usize,
    event: SequenceEvent,
}

/// `N` schedulers and the sync messages between them (see the module docs).
#[derive(Debug)]
pub(crate) struct ReplicaSet {
    schedulers: Vec<Scheduler>,
    /// Simulated time 0 as an `Instant` (only differences matter).
    epoch: Instant,
    sync_lag_ns: u64,
    /// Steps not yet applied by their peer, in due order (one lag for all: FIFO).
    in_flight: VecDeque<InFlight>,
    /// The replica that booked each active request.
    owner: HashMap<RequestId, usize>,
    /// Draws the replica of each query.
    pick: StdRng,
}

impl ReplicaSet {
    /// `count` replicas made by `make(r)` (replica `r`), syncing after `sync_lag_ns`;
    /// queries are spread with a generator seeded by `seed`.
    ///
    /// # Errors
    /// [`LabError::Replicas`] for 0 replicas; `make`'s error.
    pub fn new(
        count: usize,
        sync_lag_ns: u64,
        seed: u64,
        mut make: impl FnMut(usize) -> Result<Scheduler, LabError>,
    ) -> Result<Self, LabError> {
        if count == 0 {
            return Err(LabError::Replicas(0));
        }
        Ok(Self {
            schedulers: (0..count).map(&mut make).collect::<Result<_, _>>()?,
            epoch: Instant::now(),
            sync_lag_ns,
            in_flight: VecDeque::new(),
            owner: HashMap::new(),
            pick: StdRng::seed_from_u64(seed ^ 0x5eed_4e91),
        })
    }

    /// The first replica (every replica's calibration learns from every booking).
    pub fn first(&self) -> &Scheduler {
        &self.schedulers[0]
    }

    /// Routes and books `request` at `now_ns` on a replica drawn at random, after every
    /// sync step due by then; queues the booking for the peers.
    ///
    /// # Errors
    /// The deciding scheduler's refusal.
    pub fn schedule<O: Overlaps + ?Sized>(
        &mut self,
        request: &ScheduleRequest,
        scores: &O,
        now_ns: u64,
    ) -> Result<Selection, SchedulerError> {
        self.deliver(now_ns);
        let count = self.schedulers.len();
        let replica = if count == 1 {
            0
        } else {
            self.pick.random_range(0..count)
        };
        let now = self.at(now_ns);
        let selection = self.schedulers[replica].schedule(request, scores, now)?;
        if count > 1 {
            self.owner.insert(request.request_id.clone(), replica);
            let booked = AddRequest {
                request_id: request.request_id.clone(),
                rank: selection.rank,
                block_hashes: request.block_hashes.clone(),
                request_blocks: request.request_blocks,
                prefill: selection.prefill,
                origin: Origin::Peer(router_id(replica)),
                session_id: request.session_id.clone(),
            };
            self.send(replica, now_ns, &SequenceEvent::AddRequest(booked));
        }
        Ok(selection)
    }

    /// Applies a frontend's lifecycle `event` for `id` at `now_ns` on the replica that
    /// booked it and queues the steps it applied for the peers. An unknown id is
    /// ignored (never booked, or already released), as the daemon counts and skips it.
    pub fn lifecycle(&mut self, id: &RequestId, event: LifecycleEvent, now_ns: u64) {
        self.deliver(now_ns);
        let owner = self.owner.get(id).copied().unwrap_or(0);
        let now = self.at(now_ns);
        let Ok(steps) = self.schedulers[owner].lifecycle(id, event, now) else {
            return;
        };
        if self.schedulers.len() == 1 {
            return;
        }
        for step in steps {
            let event = match step.update {
                SequenceUpdate::PrefillDone => SequenceEvent::MarkPrefillCompleted(step.request_id),
                SequenceUpdate::KeepAlive => SequenceEvent::KeepAlive(step.request_id),
                SequenceUpdate::Freed => {
                    self.owner.remove(&step.request_id);
                    SequenceEvent::Free(step.request_id)
                }
                SequenceUpdate::Booked(_) => continue,
            };
            self.send(owner, now_ns, &event);
        }
    }

    /// Bookings still active on any replica, after every sync step; expires them all,
    /// so call it at the end of a run.
    pub fn open_bookings(&mut self) -> usize {
        self.deliver(u64::MAX);
        self.schedulers.iter_mut().map(expire_all).sum()
    }

    /// Queues `event` from replica `from` for every peer, due a sync lag after `now_ns`.
    fn send(&mut self, from: usize, now_ns: u64, event: &SequenceEvent) {
        let at_ns = now_ns.saturating_add(self.sync_lag_ns);
        for peer in (0..self.schedulers.len()).filter(|&p| p != from) {
            self.in_flight.push_back(InFlight {
                at_ns,
                peer,
                event: event.clone(),
            });
        }
    }

    /// Applies every step due by `now_ns`, each at its own due time.
    fn deliver(&mut self, now_ns: u64) {
        while self.in_flight.front().is_some_and(|s| s.at_ns <= now_ns) {
            let Some(step) = self.in_flight.pop_front() else {
                break;
            };
            let at = self.at(step.at_ns);
            // A step for a request the peer no longer holds (expired) is skipped, as
            // the daemon skips it.
            let _ = self.schedulers[step.peer].apply(step.event, at);
        }
    }

    /// Simulated `ns` as an `Instant`; the end of time (`u64::MAX`) is capped.
    fn at(&self, ns: u64) -> Instant {
        self.epoch + Duration::from_nanos(ns.min(u64::MAX / 2))
    }
}

/// Replica `r`'s id in its peers' books.
fn router_id(r: usize) -> RouterId {
    RouterId(r as u64 + 1)
}

/// Expires every booking of `scheduler`; returns how many there were. Each round
/// expires at least the earliest one.
fn expire_all(scheduler: &mut Scheduler) -> usize {
    let mut expired = 0;
    while let Some(deadline) = scheduler.next_expiry() {
        expired += scheduler.expire(deadline).len();
    }
    expired
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::disaggregation::WorkerRole;
    use kv_events::discovery::WorkerRegistration;
    use kv_events::{LocalBlockHash, WorkerId};
    use scheduler::{NoOverlap, SchedulerConfig};

    const LAG_NS: u64 = 1_000_000;

    fn scheduler(replica: usize) -> Result<Scheduler, LabError> {
        let mut s = Scheduler::new(SchedulerConfig::default(), Some(7 + replica as u64))?;
        for w in 1..=2 {
            s.add_worker(WorkerRegistration {
                worker_id: WorkerId(w),
                dp_size: 1,
                block_size: 16,
                total_kv_blocks: 1_000,
                url: None,
                epoch: 0,
                max_model_len: None,
                role: WorkerRole::Both,
                kv_transfer: None,
            })?;
        }
        Ok(s)
    }

    fn request(id: &str) -> ScheduleRequest {
        let hashes = (0..4).map(LocalBlockHash).collect();
        ScheduleRequest::new(RequestId::from(id), hashes, 64, 16)
    }

    /// Which replicas hold a booking of `id`, and where it came from.
    fn holders(set: &ReplicaSet, id: &str) -> Vec<Option<Origin>> {
        let id: RequestId = id.into();
        set.schedulers
            .iter()
            .map(|s| s.sequences().get(&id).map(|r| r.origin))
            .collect()
    }

    #[test]
    fn a_peer_learns_a_booking_and_its_release_one_lag_late() {
        let mut set = ReplicaSet::new(2, LAG_NS, 1, scheduler).unwrap();
        set.schedule(&request("a"), &NoOverlap, 0).unwrap();
        let owner = set.owner[&RequestId::from("a")];
        let peer = 1 - owner;
        let held = holders(&set, "a");
        assert_eq!(held[owner], Some(Origin::Local));
        assert_eq!(held[peer], None, "the peer cannot know before the lag");

        // Any later call at or past the lag delivers the booking first.
        set.schedule(&request("b"), &NoOverlap, LAG_NS).unwrap();
        assert_eq!(
            holders(&set, "a")[peer],
            Some(Origin::Peer(router_id(owner)))
        );

        set.lifecycle(&"a".into(), LifecycleEvent::Freed, 2 * LAG_NS);
        let held = holders(&set, "a");
        assert_eq!(held[owner], None, "the owner frees at once");
        assert!(held[peer].is_some(), "the peer frees one lag later");
        set.lifecycle(&"b".into(), LifecycleEvent::Freed, 3 * LAG_NS);
        assert_eq!(holders(&set, "a"), vec![None, None]);
        // `b` was freed at 3 lags: its peer still holds it until 4.
        assert_eq!(set.open_bookings(), 0, "every step reaches every peer");
    }

    #[test]
    fn one_replica_draws_nothing_and_sends_nothing() {
        let mut set = ReplicaSet::new(1, LAG_NS, 1, scheduler).unwrap();
        let mut alone = scheduler(0).unwrap();
        for (i, id) in ["a", "b", "c", "d"].into_iter().enumerate() {
            let now = i as u64 * 10;
            let chosen = set.schedule(&request(id), &NoOverlap, now).unwrap().rank;
            let expected = alone
                .schedule(&request(id), &NoOverlap, set.at(now))
                .unwrap()
                .rank;
            assert_eq!(chosen, expected);
        }
        assert!(set.in_flight.is_empty() && set.owner.is_empty());
        assert!(matches!(
            ReplicaSet::new(0, LAG_NS, 1, scheduler),
            Err(LabError::Replicas(0))
        ));
    }
}
