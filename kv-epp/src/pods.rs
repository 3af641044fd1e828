//! Pod address (`ip:port`, as the proxy names endpoints) ↔ worker id. The router
//! answers with worker ids; the proxy knows pods. Each worker registers its engine's
//! base URL in the etcd directory (`http://10.0.3.7:8000`): its authority is the pod
//! address. Naming a worker's pod is one directory lookup ([`pod_of`]); the reverse
//! map ([`Pods`]) is built from the directory only when a request needs it (a subset
//! hint, or a served endpoint other than the pick): O(workers), one shared lock.

use kv_events::WorkerId;
use kv_events::routing::MAX_ELIGIBLE_WORKERS;
use kv_gateway::error::ApiError;
use kv_gateway::workers::WorkerUrls;
use std::collections::HashMap;

/// The `host:port` of an engine base URL (the scheme's default port when it names
/// none); `None` for a URL without a host.
pub fn address_of(url: &str) -> Option<String> {
    let url = url::Url::parse(url).ok()?;
    let host = url.host_str()?;
    let port = url.port_or_known_default()?;
    Some(format!("{host}:{port}"))
}

/// The pod address of `worker`: `None` when it is not registered or registered no
/// engine URL (the proxy cannot be told where it is).
pub fn pod_of(workers: &WorkerUrls, worker: WorkerId) -> Option<String> {
    address_of(&workers.url(worker)?)
}

/// The workers with an engine URL, keyed by pod address.
#[derive(Debug, Default)]
pub struct Pods {
    by_address: HashMap<String, WorkerId>,
}

impl Pods {
    /// The pods of the registered workers now.
    pub fn of(workers: &WorkerUrls) -> Self {
        let by_address = (workers.worker_urls().into_iter())
            .filter_map(|(worker, url)| Some((address_of(&url)?, worker)))
            .collect();
        Self { by_address }
    }

    /// The worker whose pod is `address`, if one is registered.
    pub fn worker(&self, address: &str) -> Option<WorkerId> {
        self.by_address.get(address.trim()).copied()
    }

    /// The workers inside `subset` (pod addresses, the proxy's subset hint): the
    /// route query's eligible set, so the router picks inside it.
    ///
    /// # Errors
    /// 503 when no registered worker is in the subset, or when more are than one
    /// route query may name ([`MAX_ELIGIBLE_WORKERS`]; the router would refuse the
    /// query as malformed).
    pub fn eligible_in(&self, subset: &[String]) -> Result<Vec<WorkerId>, ApiError> {
        let mut inside: Vec<WorkerId> = subset.iter().filter_map(|a| self.worker(a)).collect();
        inside.sort_unstable();
        inside.dedup();
        if inside.is_empty() {
            return Err(ApiError::unavailable(
                "no registered worker is in the endpoint subset",
            ));
        }
        if inside.len() > MAX_ELIGIBLE_WORKERS {
            return Err(ApiError::unavailable(format!(
                "the endpoint subset holds {} registered workers; a route query names at most {MAX_ELIGIBLE_WORKERS}",
                inside.len()
            )));
        }
        Ok(inside)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn addresses_come_from_the_url_authority() {
        assert_eq!(
            address_of("http://10.0.3.7:8000").as_deref(),
            Some("10.0.3.7:8000")
        );
        assert_eq!(
            address_of("http://pod.local").as_deref(),
            Some("pod.local:80")
        );
        assert_eq!(address_of("not a url"), None);
    }

    fn fleet(workers: u64) -> Pods {
        let urls = WorkerUrls::default();
        for n in 1..=workers {
            urls.insert(&kv_events::discovery::WorkerRegistration {
                worker_id: WorkerId(n),
                dp_size: 1,
                block_size: 16,
                total_kv_blocks: 16,
                url: Some(format!("http://10.0.{}.{}:8000", n / 256, n % 256)),
                epoch: 0,
                max_model_len: None,
                role: Default::default(),
                kv_transfer: None,
            });
        }
        Pods::of(&urls)
    }

    #[test]
    fn the_subset_is_the_eligible_set_within_the_query_bound() {
        let pods = fleet(120);
        // 100 of 120 pods, one named twice and one unknown: 100 eligible workers,
        // beyond what an exclusion list could say.
        let mut subset: Vec<String> = (1..=100)
            .map(|n| format!("10.0.{}.{}:8000", n / 256, n % 256))
            .collect();
        subset.push("10.0.0.7:8000".into());
        subset.push("10.9.9.9:8000".into());
        let eligible = pods.eligible_in(&subset).unwrap();
        assert_eq!(eligible, (1..=100).map(WorkerId).collect::<Vec<_>>());
        let none = pods.eligible_in(&["10.9.9.9:8000".into()]).unwrap_err();
        assert_eq!(none.status.as_u16(), 503);
        let many = fleet(MAX_ELIGIBLE_WORKERS as u64 + 1);
        let all: Vec<String> = many.by_address.keys().cloned().collect();
        let over = many.eligible_in(&all).unwrap_err();
        assert_eq!(over.status.as_u16(), 503, "{over:?}");
        assert!(over.message.contains("at most"), "{over:?}");
    }
}
