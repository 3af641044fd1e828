//! The trust model end to end (docs/security.md): nats-server started with the shipped
//! `deploy/security/nats-server.conf` and generated users, etcd over mutual TLS with
//! authentication and the roles of the shipped `deploy/security/etcd-rbac.sh`.
//!
//! Each forbidden action is attempted with real clients and must be refused by the
//! server (a NATS permissions violation, an etcd permission or TLS error); each
//! allowed path (router, relay, mock engines, gateway) must work with only its role's
//! rights. Two tests reproduce the findings of issue 14: a fake member of the route
//! queue group steals routes on an open bus but not under the shipped configuration,
//! and an `https://` etcd endpoint without TLS settings is refused at start.

// The relay tests' fake engine unwraps, as do these tests: a broken fixture, socket or
// refusal must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[path = "relay/engine.rs"]
#[allow(dead_code)]
mod engine;
#[path = "security/etcd.rs"]
mod etcd;
#[path = "security/fixture.rs"]
mod fixture;
#[path = "security/nats.rs"]
mod nats;
