//! Process plumbing shared by the `kv-router` and `kv-mocker` binaries: logging set-up
//! and the shutdown signal, so both behave the same under an init system or a
//! container runtime (SIGTERM) and on a terminal (Ctrl-C).

/// Installs the `tracing` subscriber: human-readable lines on stderr, filtered by
/// `RUST_LOG` (default `info`). Call once, at the start of `main`.
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM; on SIGINT alone if the SIGTERM handler
/// cannot be installed.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
