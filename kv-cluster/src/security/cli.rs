//! `kv-router security nats-users`: the flags naming the users of each role, turned
//! into [`NatsUser`]s and rendered by [`super::nats_authorization`].

use super::{NatsUser, Role, SecurityError, nats_authorization};
use crate::args::NamespaceArgs;
use kv_events::{Subjects, WorkerId};

/// Which users to generate NATS permissions for. Each user's password is the
/// environment variable `KV_ROUTER_NATS_PASSWORD_<USER>` of nats-server (upper case,
/// `-` → `_`); replace it with a bcrypt hash (`nats server passwd`) if you prefer.
#[derive(Debug, Clone, clap::Args)]
pub struct NatsUsersArgs {
    /// The cluster's namespace: the same flag and variable as `serve`.
    #[command(flatten)]
    pub namespace: NamespaceArgs,
    /// A router user (`kv-router serve`); repeatable.
    #[arg(long = "router", value_name = "USER")]
    pub routers: Vec<String>,
    /// A worker user (a relay or an engine process) and the worker ids it publishes
    /// for, `USER=ID[,ID...]`; repeatable.
    #[arg(long = "worker", value_name = "USER=IDS", value_parser = parse_worker)]
    pub workers: Vec<WorkerUser>,
    /// A frontend user (gateway, client library); repeatable.
    #[arg(long = "frontend", value_name = "USER")]
    pub frontends: Vec<String>,
    /// An operator user with full access; repeatable.
    #[arg(long = "operator", value_name = "USER")]
    pub operators: Vec<String>,
}

/// A worker user and its worker ids, as given to `--worker`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerUser {
    /// User name.
    pub name: String,
    /// The worker ids it publishes for.
    pub ids: Vec<WorkerId>,
}

fn parse_worker(value: &str) -> Result<WorkerUser, String> {
    let (name, ids) = value
        .split_once('=')
        .ok_or_else(|| format!("expected USER=ID[,ID...], got {value:?}"))?;
    let ids = ids
        .split(',')
        .map(|id| {
            id.trim()
                .parse::<u64>()
                .map(WorkerId)
                .map_err(|_| format!("worker id {id:?} is not a number"))
        })
        .collect::<Result<_, _>>()?;
    Ok(WorkerUser {
        name: name.to_owned(),
        ids,
    })
}

impl NatsUsersArgs {
    /// The users, routers first, each with its password variable.
    pub fn users(&self) -> Vec<NatsUser> {
        let user = |name: &String, role: Role| NatsUser {
            name: name.clone(),
            role,
            password: None,
        };
        let routers = self.routers.iter().map(|n| user(n, Role::Router));
        let workers = self
            .workers
            .iter()
            .map(|w| user(&w.name, Role::Worker(w.ids.clone())));
        let frontends = self.frontends.iter().map(|n| user(n, Role::Frontend));
        let operators = self.operators.iter().map(|n| user(n, Role::Operator));
        routers
            .chain(workers)
            .chain(frontends)
            .chain(operators)
            .collect()
    }

    /// The `authorization` block for these users.
    ///
    /// # Errors
    /// [`SecurityError`] for an invalid namespace or an invalid or duplicate user
    /// name.
    pub fn render(&self) -> Result<String, SecurityError> {
        nats_authorization(&Subjects::new(self.namespace.get()?), &self.users())
    }
}
