//! Process plumbing shared by every participant's binary (`kv-router`, `kv-mocker`):
//! logging set-up and the shutdown signal, so all behave the same under an init
//! system or a container runtime (SIGTERM, logs to a file or journal: no colour
//! codes) and on a terminal (Ctrl-C, coloured logs).

/// Installs the `tracing` subscriber: human-readable lines on stderr, filtered by
/// `RUST_LOG` (default `info`), with ANSI colour only when stderr is a terminal and
/// `NO_COLOR` is unset (or empty, as <https://no-color.org> says). Call once, at the
/// start of `main`.
pub fn init_tracing() {
    use std::io::IsTerminal;
    let colour = std::io::stderr().is_terminal() && wants_colour(std::env::var_os("NO_COLOR"));
    tracing_subscriber::fmt()
        .with_ansi(colour)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Whether colour is allowed given the value of `NO_COLOR`: only when it is unset or
/// empty.
fn wants_colour(no_color: Option<std::ffi::OsString>) -> bool {
    no_color.is_none_or(|v| v.is_empty())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_color_with_a_value_turns_colour_off() {
        assert!(wants_colour(None));
        assert!(wants_colour(Some("".into())));
        assert!(!wants_colour(Some("1".into())));
    }
}
