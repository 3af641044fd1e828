//! Pod address (`ip:port`, as the proxy names endpoints) ↔ worker id. The router
//! answers with worker ids; the proxy knows pods. Each worker registers its engine's
//! base URL in the etcd directory (`http://10.0.3.7:8000`): its authority is the pod
//! address. Built per request from the directory's map (O(workers), one shared lock).

use kv_events::WorkerId;
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

/// The workers with an engine URL, keyed by pod address.
#[derive(Debug, Default)]
pub struct Pods {
    by_address: HashMap<String, WorkerId>,
    by_worker: HashMap<WorkerId, String>,
}

impl Pods {
    /// The pods of the registered workers now.
    pub fn of(workers: &WorkerUrls) -> Self {
        let mut pods = Self::default();
        for (worker, url) in workers.worker_urls() {
            if let Some(address) = address_of(&url) {
                pods.by_address.insert(address.clone(), worker);
                pods.by_worker.insert(worker, address);
            }
        }
        pods
    }

    /// The pod address of `worker`.
    pub fn address(&self, worker: WorkerId) -> Option<&str> {
        self.by_worker.get(&worker).map(String::as_str)
    }

    /// The workers outside `subset` (pod addresses): what a route query excludes so
    /// the router picks inside the subset. Also whether any worker is inside.
    pub fn outside(&self, subset: &[String]) -> (Vec<WorkerId>, bool) {
        let inside: Vec<WorkerId> = subset
            .iter()
            .filter_map(|a| self.by_address.get(a).copied())
            .collect();
        let outside = self
            .by_worker
            .keys()
            .filter(|w| !inside.contains(w))
            .copied()
            .collect();
        (outside, !inside.is_empty())
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
}
