//! The gateway's side of the etcd worker directory: each registration change goes to
//! the worker map ([`WorkerUrls`]) and, when a worker leaves, to the parity monitor,
//! which forgets the worker's window and series with it. Apart from both so neither
//! depends on the other.

use crate::parity::ParityMonitor;
use crate::workers::WorkerUrls;
use kv_cluster::directory::{EtcdStatus, Registered, Registrations, Rejection};
use kv_events::WorkerId;

/// What the gateway keeps of the directory: the worker map, and the parity monitor's
/// state of each worker, forgotten with it when it leaves.
pub(crate) struct Directory {
    pub urls: WorkerUrls,
    pub parity: ParityMonitor,
}

impl Registrations for Directory {
    async fn put(&mut self, worker: Registered) {
        self.urls.put(worker).await;
    }

    async fn delete(&mut self, worker_id: WorkerId) {
        self.urls.delete(worker_id).await;
        self.parity.forget(worker_id);
    }

    fn rejected(&mut self, key: &str, rejection: &Rejection) {
        self.urls.rejected(key, rejection);
    }

    fn status(&mut self, status: EtcdStatus) {
        self.urls.status(status);
    }
}
