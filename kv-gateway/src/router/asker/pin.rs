//! Replica affinity's pin: where the gateway's queries go for a window, which replica
//! it pins to ([`super::PinTarget`]), and when it lets the pin go (module docs of
//! `router::asker`).

use super::events::{Events, Release};
use super::{Answer, Asker, Services};
use crate::router::{PinTarget, ReplicaAffinity};
use kv_events::RouterId;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// Probes through the queue group each time a pin is renewed under
/// [`PinTarget::Lowest`], or a replica is first heard from, when no replica answers
/// the roll call (replicas from before it): how a gateway hears of replicas that
/// joined since.
const RENEWAL_PROBES: usize = 2;

/// The replica this gateway's queries go to, and for how long (module docs).
pub(super) struct Affinity {
    pub(super) settings: ReplicaAffinity,
    pub(super) pin: Mutex<Option<Pin>>,
    pub(super) counted: Events,
}

/// A pin to one replica: its own subjects, until when.
#[derive(Clone)]
pub(super) struct Pin {
    pub(super) router: RouterId,
    pub(super) services: Services,
    pub(super) until: Instant,
    /// The replicas the gateway had heard of when the pin was last checked against
    /// them ([`super::Stalls::generation`]).
    heard: u64,
}

impl Asker {
    /// After a decoded answer: an `overloaded` one lets a pin to its replica go and
    /// avoids that replica for a window; any other from the queue group pins, to the
    /// replica [`PinTarget`] names (an `overloaded` one pins nothing).
    pub(super) fn settle(&self, answer: &Answer, overloaded: bool) {
        // Read once: noted for the stall check, and the replica to pin to.
        let sender = crate::router::named_replica(&answer.message);
        if let (Some(stalls), Some(sender)) = (&self.stalls, sender) {
            // A replica not known before: others may have joined too, and one of them
            // may be lower (a roll call finds them; `Asker::pinned` moves the pin).
            if stalls.heard(sender) && self.target_is(PinTarget::Lowest) {
                stalls.discover(RENEWAL_PROBES);
            }
        }
        match (answer.pinned, overloaded, sender) {
            (Some(router), true, _) => self.unpin(router, Release::Overloaded),
            (None, true, Some(sender)) => self.avoid(sender),
            (None, false, Some(sender)) => self.pin_to(self.target(sender)),
            (Some(_), false, _) | (None, _, None) => {}
        }
    }

    fn target_is(&self, target: PinTarget) -> bool {
        (self.affinity.as_ref()).is_some_and(|a| a.settings.target == target)
    }

    /// The replica to pin to once `answered` has answered through the queue group.
    pub(super) fn target(&self, answered: RouterId) -> RouterId {
        match (&self.affinity, &self.stalls) {
            (Some(a), Some(stalls)) if a.settings.target == PinTarget::Lowest => {
                stalls.lowest(answered)
            }
            _ => answered,
        }
    }

    /// Leaves `router` out of the pin target for a window (it is overloaded or slow).
    pub(super) fn avoid(&self, router: RouterId) {
        if let (Some(a), Some(stalls)) = (&self.affinity, &self.stalls) {
            stalls.avoid(router, Instant::now() + a.settings.window);
        }
    }

    /// The pin, if one holds now, and the affinity's patience.
    ///
    /// Under [`PinTarget::Lowest`], when no pin holds the gateway pins anew to the
    /// lowest usable replica it knows, without a query through the queue group, and
    /// calls the roll for replicas it has not heard from
    /// ([`super::Stalls::discover`]); a pin that holds moves at once to a lower
    /// replica heard of since it was taken (one atomic load per query tells).
    pub(super) fn pinned(&self) -> Option<(Pin, Duration)> {
        let affinity = self.affinity.as_ref()?;
        let patience = affinity.settings.patience;
        let now = Instant::now();
        let lowest =
            (self.stalls.as_ref()).filter(|_| affinity.settings.target == PinTarget::Lowest);
        let mut pin = affinity.pin.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(held) = pin.as_mut().filter(|p| now < p.until) {
            if let Some(stalls) = lowest.filter(|s| s.generation() != held.heard) {
                // Read before the replicas: one heard of meanwhile is checked next time.
                held.heard = stalls.generation();
                if let Some(lower) = stalls.lowest_known().filter(|l| *l < held.router) {
                    *held = self.pin(affinity, lower, now);
                }
            }
            return Some((held.clone(), patience));
        }
        let stalls = lowest?;
        // A pin whose window has passed: taken out, so that its replica is probed
        // for once per window, not on every query while no replica is usable.
        if pin.take().is_some() {
            stalls.discover(RENEWAL_PROBES);
        }
        let router = stalls.lowest_known()?;
        let renewed = self.pin(affinity, router, now);
        *pin = Some(renewed.clone());
        Some((renewed, patience))
    }

    /// A pin to `router` from `now`, counted.
    fn pin(&self, affinity: &Affinity, router: RouterId, now: Instant) -> Pin {
        affinity.counted.pinned.inc();
        Pin {
            heard: self.stalls.as_ref().map_or(0, |s| s.generation()),
            router,
            services: Services {
                route: self.subjects.route_at(router).into(),
                route_batch: self.subjects.route_batch_at(router).into(),
            },
            until: now + affinity.settings.window,
        }
    }

    /// Pins to `router` (see [`Asker::target`]), unless a pin holds already.
    pub(super) fn pin_to(&self, router: RouterId) {
        let Some(affinity) = &self.affinity else {
            return;
        };
        let now = Instant::now();
        let mut pin = affinity.pin.lock().unwrap_or_else(|p| p.into_inner());
        if pin.as_ref().is_some_and(|p| now < p.until) {
            return;
        }
        *pin = Some(self.pin(affinity, router, now));
    }

    /// Lets the pin go if one to `router` holds, counting `why`. A pin to another
    /// replica (taken meanwhile by another query) stays. Either way a replica that is
    /// gone is forgotten, and one let go for any other reason is left out of the pin
    /// target for a window ([`Asker::avoid`]).
    pub(super) fn unpin(&self, router: RouterId, why: Release) {
        let Some(affinity) = &self.affinity else {
            return;
        };
        match (why, &self.stalls) {
            (Release::Gone, Some(stalls)) => stalls.forget(router),
            _ => self.avoid(router),
        }
        let mut pin = affinity.pin.lock().unwrap_or_else(|p| p.into_inner());
        if pin.as_ref().is_some_and(|p| p.router == router) {
            let released = pin.take().is_some_and(|p| Instant::now() < p.until);
            if released {
                affinity.counted.released(why).inc();
            }
        }
    }
}
