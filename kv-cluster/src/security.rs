//! Who may do what on the bus: the NATS permissions of each role, derived from
//! [`Subjects`] so they name exactly the subjects the code uses, and rendered as the
//! `authorization` block of a nats-server configuration (`kv-router security
//! nats-users`; `deploy/security/`; `docs/security.md`).
//!
//! NATS enforces them, not kv-router: a client that breaks them gets a permissions
//! violation from the server and its message or subscription is dropped. What the
//! roles may do:
//!
//! - a **router** consumes every worker's KV events and load metrics, the frontends'
//!   lifecycle messages, asks workers for recovery, syncs bookings with its peers, and
//!   is the only role that may join the route queue group (`"subject queue"`
//!   permissions refuse a plain subscription to the route subjects, which would read
//!   every query). It may publish to every inbox (it answers everyone) and use
//!   JetStream (`--jetstream`);
//! - a **worker** (a relay, or an engine process serving one or more worker ids)
//!   publishes only its own workers' KV events and metrics, answers recovery and
//!   engine requests for them (NATS `allow_responses`: only to the inbox a request
//!   named, for at most [`RESPONSE_WINDOW`]);
//! - a **frontend** (gateway, client library) asks for routes and publishes
//!   lifecycle messages and, for the mock engines, engine requests;
//! - an **operator** may do everything (tools, debugging).
//!
//! Workers and frontends subscribe only to their own inboxes, `_INBOX.<user>.>`
//! ([`inbox_prefix`], passed as `--nats-inbox-prefix`), so one cannot read another's
//! replies (route decisions, recovery dumps, booking snapshots).

use kv_events::{Subjects, WorkerId};
use std::fmt::Write as _;

pub mod cli;

/// How long a worker may keep answering one request (NATS `allow_responses`
/// `expires`): recovery dumps and mock-engine generations fit well within it.
pub const RESPONSE_WINDOW: &str = "5m";

/// Environment variable prefix of the passwords the generated configuration refers
/// to: user `router-1` reads `$KV_ROUTER_NATS_PASSWORD_ROUTER_1` (nats-server looks
/// variables up in its environment).
pub const PASSWORD_VARIABLE_PREFIX: &str = "KV_ROUTER_NATS_PASSWORD_";

/// A participant's role on the bus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// `kv-router serve`.
    Router,
    /// A relay or an engine process publishing for these worker ids.
    Worker(Vec<WorkerId>),
    /// A gateway or any client asking for routes.
    Frontend,
    /// Full access.
    Operator,
}

/// A NATS user: a name (`[A-Za-z0-9_-]`, 1–64 characters, so it is one subject
/// token), its role, and its password as it appears in the configuration.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsUser {
    /// User name.
    pub name: String,
    /// What it may do.
    pub role: Role,
    /// `None`: the environment variable [`password_variable`]`(name)`; `Some`: the
    /// value itself (a bcrypt hash from `nats server passwd`, or plain text).
    pub password: Option<String>,
}

impl std::fmt::Debug for NatsUser {
    /// Never prints a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsUser")
            .field("name", &self.name)
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

/// What one user may publish and subscribe to; `None` fields mean "everything".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permissions {
    /// Subjects it may publish to (wildcards allowed).
    pub publish: Vec<String>,
    /// Subjects it may subscribe to; `"subject queue"` allows only that queue group.
    pub subscribe: Vec<String>,
    /// Whether it may answer the requests it receives (NATS `allow_responses`, any
    /// number of messages within [`RESPONSE_WINDOW`]).
    pub responses: bool,
}

/// Why users could not be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecurityError {
    /// A user name is empty, too long, or not a single subject token.
    #[error("user name {0:?} must be 1 to 64 characters of [A-Za-z0-9_-]")]
    UserName(String),
    /// Two users share a name or a password variable.
    #[error("users {0:?} and {1:?} collide (same name or password variable)")]
    Duplicate(String, String),
    /// A worker user with no worker id.
    #[error("worker user {0:?} needs at least one worker id")]
    NoWorkers(String),
    /// `--namespace` is not a valid subject token.
    #[error("invalid --namespace: {0}")]
    Namespace(#[from] kv_events::NamespaceError),
}

/// The inbox prefix user `name` must connect with (`--nats-inbox-prefix`).
pub fn inbox_prefix(name: &str) -> String {
    format!("_INBOX.{name}")
}

/// The environment variable holding user `name`'s password.
pub fn password_variable(name: &str) -> String {
    let suffix: String = name
        .chars()
        .map(|c| match c {
            '-' => '_',
            c => c.to_ascii_uppercase(),
        })
        .collect();
    format!("{PASSWORD_VARIABLE_PREFIX}{suffix}")
}

/// What user `name` with `role` may do in `subjects`' namespace; `None` for the
/// operator (everything).
pub fn permissions(subjects: &Subjects, name: &str, role: &Role) -> Option<Permissions> {
    let own_inbox = format!("{}.>", inbox_prefix(name));
    let group = subjects.route_queue_group();
    match role {
        Role::Operator => None,
        Role::Router => Some(Permissions {
            publish: vec![
                subjects.kv_recovery_all(),
                subjects.sequences(),
                subjects.sequences_snapshot(),
                "_INBOX.>".to_owned(),
                "$JS.API.>".to_owned(),
                "$JS.ACK.>".to_owned(),
                "$JS.FC.>".to_owned(),
                "$O.>".to_owned(),
            ],
            subscribe: vec![
                subjects.kv_events_all(),
                subjects.load_metrics_all(),
                subjects.lifecycle(),
                subjects.sequences(),
                subjects.sequences_snapshot(),
                format!("{} {group}", subjects.route()),
                format!("{} {group}", subjects.route_batch()),
                format!("{} {group}", subjects.router_removals()),
                format!("{} {group}", subjects.router_overlap()),
                // A replica's own subjects (replica affinity) and the roll call.
                subjects.route_at_any(),
                subjects.route_batch_at_any(),
                subjects.router_roll_call(),
                "_INBOX.>".to_owned(),
            ],
            responses: false,
        }),
        Role::Worker(ids) => Some(Permissions {
            publish: ids
                .iter()
                .flat_map(|&id| [subjects.kv_events(id), subjects.load_metrics(id)])
                .collect(),
            subscribe: ids
                .iter()
                .flat_map(|&id| [subjects.kv_recovery(id), subjects.engine_ops(id)])
                .chain([own_inbox])
                .collect(),
            responses: true,
        }),
        Role::Frontend => Some(Permissions {
            publish: vec![
                subjects.route(),
                subjects.route_batch(),
                subjects.route_at_any(),
                subjects.route_batch_at_any(),
                subjects.router_roll_call(),
                subjects.router_removals(),
                subjects.router_overlap(),
                subjects.lifecycle(),
                subjects.engine_all(),
            ],
            subscribe: vec![own_inbox],
            responses: false,
        }),
    }
}

fn check_users(users: &[NatsUser]) -> Result<(), SecurityError> {
    for (i, user) in users.iter().enumerate() {
        let name = &user.name;
        let valid = (1..=64).contains(&name.len())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(SecurityError::UserName(name.clone()));
        }
        if matches!(&user.role, Role::Worker(ids) if ids.is_empty()) {
            return Err(SecurityError::NoWorkers(name.clone()));
        }
        if let Some(other) = users[..i]
            .iter()
            .find(|o| o.name == *name || password_variable(&o.name) == password_variable(name))
        {
            return Err(SecurityError::Duplicate(other.name.clone(), name.clone()));
        }
    }
    Ok(())
}

/// `subjects` as a nats-server array, one quoted subject a line, indented for a
/// permission entry.
fn quoted_list(subjects: &[String]) -> String {
    let items: Vec<String> = subjects
        .iter()
        .map(|s| format!("          {s:?}"))
        .collect();
    format!("[\n{}\n        ]", items.join(",\n"))
}

/// The nats-server `authorization { users = [...] }` block for `users` in
/// `subjects`' namespace, one commented entry per user.
///
/// # Errors
/// [`SecurityError`] for an invalid or duplicate user name, or a worker user
/// without worker ids.
pub fn nats_authorization(
    subjects: &Subjects,
    users: &[NatsUser],
) -> Result<String, SecurityError> {
    check_users(users)?;
    let mut out = String::new();
    let ns = subjects.namespace();
    // Writing to a String cannot fail; the results are ignored.
    let _ = writeln!(
        out,
        "# kv-router users of namespace \"{ns}\", generated by `kv-router security nats-users`.\n\
         # Roles and subjects: docs/security.md. Workers and frontends must connect with\n\
         # --nats-inbox-prefix _INBOX.<user>."
    );
    out.push_str("authorization {\n  users = [\n");
    for user in users {
        let role = match &user.role {
            Role::Router => "router (kv-router serve)".to_owned(),
            Role::Worker(ids) => {
                let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
                format!("worker (relay or engine) of worker ids {}", ids.join(", "))
            }
            Role::Frontend => "frontend (gateway, client)".to_owned(),
            Role::Operator => "operator: full access".to_owned(),
        };
        let password = match &user.password {
            Some(value) => format!("{value:?}"),
            None => format!("${}", password_variable(&user.name)),
        };
        let _ = writeln!(out, "    # {role}");
        let _ = writeln!(out, "    {{");
        let _ = writeln!(out, "      user: {:?}", user.name);
        let _ = writeln!(out, "      password: {password}");
        if let Some(p) = permissions(subjects, &user.name, &user.role) {
            let _ = writeln!(out, "      permissions: {{");
            let _ = writeln!(
                out,
                "        publish: {{ allow: {} }}",
                quoted_list(&p.publish)
            );
            let _ = writeln!(
                out,
                "        subscribe: {{ allow: {} }}",
                quoted_list(&p.subscribe)
            );
            if p.responses {
                let _ = writeln!(
                    out,
                    "        allow_responses: {{ max: -1, expires: {RESPONSE_WINDOW:?} }}"
                );
            }
            let _ = writeln!(out, "      }}");
        }
        let _ = writeln!(out, "    }}");
    }
    out.push_str("  ]\n}\n");
    Ok(out)
}

#[cfg(test)]
mod tests;
