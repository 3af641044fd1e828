//! The endpoint picker (`kv-router epp`) in a test cluster, shared by its tests and
//! its bench.

use crate::TestCluster;
use kv_epp::{Epp, EppArgs};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

impl TestCluster {
    /// Starts a picker on this cluster in this process: its metrics and gRPC
    /// listeners on free loopback ports, serving `model` with the tokenizer in
    /// `model_dir`, then `extra` flags (which may override any of these).
    ///
    /// # Errors
    /// The picker's start-up errors (NATS, etcd, the tokenizer, the listeners).
    pub async fn start_epp(
        &self,
        model: &str,
        model_dir: &str,
        extra: &[&str],
    ) -> anyhow::Result<Epp> {
        let mut flags = vec![
            "--listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "127.0.0.1:0",
            "--served-model-name",
            model,
            "--model-dir",
            model_dir,
        ];
        flags.extend_from_slice(extra);
        let args: EppArgs = self.flags(&flags);
        let registry = Arc::new(prometheus::Registry::new());
        Ok(Epp::start(args.to_config()?, registry, CancellationToken::new()).await?)
    }
}
