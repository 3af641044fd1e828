//! The peer side of replica sync: the tasks that publish this replica's booking
//! steps and apply its peers' ([`sync`]), and the start-up snapshot in which a
//! starting replica learns its peers' bookings ([`snapshot`]).
//!
//! Apart from `crate::replicas` (this replica's outbox and own bookings, which
//! admission holds) because these sit above admission: they lock the scheduler and
//! release waiters through it.

pub(crate) mod snapshot;
pub(crate) mod sync;
