//! Who the relay publishes as: `--worker-id` and `--worker-name`, turned into the
//! [`ClaimRequest`] that [`kv_cluster::claim`] claims in etcd at start.
//!
//! Operators allocate nothing: without `--worker-id` the id is derived from the
//! worker name, by default the pod name (`$POD_NAME`, then `$HOSTNAME`), and etcd
//! guarantees no two relays hold one id. A restarted pod keeps its id (it waits for
//! its previous incarnation's claim to end). An explicit `--worker-id` is claimed the
//! same way, so a duplicate is refused at start instead of mixing two engines' events.

use crate::error::RelayError;
use clap::Args;
use kv_cluster::claim::{ClaimRequest, WorkerName};
use kv_events::WorkerId;

/// The relay's identity flags.
#[derive(Debug, Clone, Args)]
pub struct IdentityArgs {
    /// Worker id to register and publish as. Default: derived from the worker name
    /// (a number below 2^53). Either way it is claimed in etcd at start; an id held by
    /// another worker name stops the relay.
    #[arg(long, env = "KV_RELAY_WORKER_ID")]
    pub worker_id: Option<u64>,
    /// Stable name of this worker, e.g. the pod name: the same name gets the same
    /// worker id after a restart. Default: $POD_NAME, then $HOSTNAME.
    #[arg(long, env = "KV_RELAY_WORKER_NAME")]
    pub worker_name: Option<String>,
}

impl IdentityArgs {
    /// The claim to make, its lease lasting `ttl_secs`; the name falls back to
    /// `$POD_NAME`, then `$HOSTNAME`.
    ///
    /// # Errors
    /// [`RelayError::Invalid`] naming `--worker-name` when no name is given or found, or
    /// the name is unusable.
    pub fn to_request(&self, ttl_secs: u64) -> Result<ClaimRequest, RelayError> {
        let name = resolve_name(
            self.worker_name.as_deref(),
            std::env::var("POD_NAME").ok().as_deref(),
            std::env::var("HOSTNAME").ok().as_deref(),
        )?;
        Ok(ClaimRequest {
            name,
            worker_id: self.worker_id.map(WorkerId),
            ttl_secs,
        })
    }
}

/// The first non-empty of the flag, the pod name and the host name, validated.
fn resolve_name(
    flag: Option<&str>,
    pod_name: Option<&str>,
    hostname: Option<&str>,
) -> Result<WorkerName, RelayError> {
    let name = [flag, pod_name, hostname]
        .into_iter()
        .flatten()
        .map(str::trim)
        .find(|n| !n.is_empty())
        .ok_or_else(|| RelayError::Invalid {
            field: "worker-name",
            reason: "required when neither $POD_NAME nor $HOSTNAME is set: a stable name \
                     of this worker (e.g. the pod name) to derive and claim its worker id"
                .to_owned(),
        })?;
    WorkerName::new(name).map_err(|e| RelayError::Invalid {
        field: "worker-name",
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_name_comes_from_the_flag_then_the_pod_then_the_host() {
        let name = |f, p, h| resolve_name(f, p, h).map(|n| n.as_str().to_owned());
        assert_eq!(name(Some("a"), Some("b"), Some("c")).unwrap(), "a");
        assert_eq!(name(None, Some("b"), Some("c")).unwrap(), "b");
        assert_eq!(name(Some(" "), Some(""), Some("c")).unwrap(), "c");
        let err = name(None, None, Some("")).unwrap_err().to_string();
        assert!(
            err.contains("--worker-name") && err.contains("POD_NAME"),
            "{err}"
        );
        let err = name(Some("a b"), None, None).unwrap_err().to_string();
        assert!(
            err.contains("--worker-name") && err.contains("whitespace"),
            "{err}"
        );
    }
}
