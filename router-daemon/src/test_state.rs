//! A daemon state built without network, for unit tests that drive handlers
//! directly and deterministically.

use crate::config::{DaemonConfig, ServeArgs};
use crate::daemon::Starting;
use kv_events::WorkerId;
use kv_events::discovery::WorkerRegistration;

/// A daemon state (router id 1, sync on) with workers 1 and 2 registered.
pub(crate) fn starting() -> Starting {
    let args = kv_cluster::args::parse_flags::<ServeArgs, _, _>([
        "kv-router",
        "--block-size",
        "4",
        "--shards",
        "1",
        "--router-id",
        "1",
    ])
    .expect("test flags parse");
    let config = DaemonConfig::from_args(&args).expect("test flags are valid");
    let starting =
        Starting::new(config, &prometheus::Registry::new()).expect("state builds offline");
    for id in 1..=2 {
        starting
            .state()
            .scheduler()
            .add_worker(WorkerRegistration {
                worker_id: WorkerId(id),
                dp_size: 1,
                block_size: 4,
                total_kv_blocks: 1024,
                url: None,
                epoch: 0,
                max_model_len: None,
                role: Default::default(),
                kv_transfer: None,
            })
            .expect("valid registration");
    }
    starting
}
