//! What the scrape reads and how it reaches it: the metrics page and `/v1/models`
//! URLs from `--metrics-url` / `--engine-url`, and the HTTP client (with the CA of
//! `--metrics-tls-ca` for an `https://` engine).
//!
//! URLs are parsed by the `url` crate: `http://` and `https://` are accepted, with
//! a host; `--engine-url` keeps its path prefix (`http://gw/engine-3` reads
//! `http://gw/engine-3/metrics` and `…/v1/models`); a `--metrics-url` with no path
//! reads `/metrics`.

use crate::error::{RelayError, invalid};
use crate::models::ModelsEndpoint;
use std::path::Path;
use std::time::Duration;
use url::Url;

/// The optional load scrape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeConfig {
    /// The engine's metrics page.
    pub url: Url,
    /// Scrape period.
    pub interval: Duration,
    /// The engine's `/v1/models` (from `--engine-url`), read with the page until it
    /// answers once, for the engine's context length.
    pub models: Option<ModelsEndpoint>,
    /// A CA certificate (PEM) trusted besides the system's roots.
    pub tls_ca: Option<Vec<u8>>,
}

impl ScrapeConfig {
    /// The client every read of the engine uses: the process's TLS set-up plus
    /// [`Self::tls_ca`].
    ///
    /// # Errors
    /// The reason, when the TLS set-up cannot be built.
    pub fn client(&self) -> Result<reqwest::Client, String> {
        let mut builder = kv_cluster::http::client_builder();
        if let Some(pem) = &self.tls_ca {
            for cert in reqwest::Certificate::from_pem_bundle(pem).map_err(|e| e.to_string())? {
                builder = builder.add_root_certificate(cert);
            }
        }
        builder.build().map_err(|e| e.to_string())
    }
}

/// An `http://` or `https://` URL with a host.
fn web_url(text: &str, field: &'static str) -> Result<Url, RelayError> {
    let url = Url::parse(text.trim()).map_err(|e| invalid(field, format!("{text:?}: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err(invalid(
            field,
            format!("{text:?} is not an http:// or https:// url"),
        ));
    }
    Ok(url)
}

/// `base` (its path a prefix) joined with `rest`.
fn below(base: &Url, rest: &str) -> Url {
    let mut url = base.clone();
    let path = format!("{}/{rest}", base.path().trim_end_matches('/'));
    url.set_path(&path);
    url
}

/// The scrape of `--metrics-url` (or `<engine-url>/metrics`), with `/v1/models` at
/// `--engine-url`; `None` when neither is given.
///
/// # Errors
/// [`RelayError::Invalid`] naming the flag: a URL that is not `http://` or `https://`, a
/// zero period, an unreadable CA file or one with no certificate.
pub fn from_flags(
    metrics_url: Option<&str>,
    engine_url: Option<&str>,
    interval_ms: u64,
    tls_ca: Option<&Path>,
) -> Result<Option<ScrapeConfig>, RelayError> {
    let engine = engine_url.map(|u| web_url(u, "engine-url")).transpose()?;
    let url = match (metrics_url, &engine) {
        (Some(text), _) => {
            let mut url = web_url(text, "metrics-url")?;
            if url.path() == "/" {
                url.set_path("/metrics");
            }
            url
        }
        (None, Some(engine)) => below(engine, "metrics"),
        (None, None) => return Ok(None),
    };
    if interval_ms == 0 {
        return Err(invalid("metrics-interval-ms", "must be at least 1"));
    }
    let tls_ca = tls_ca
        .map(|path| {
            let pem = std::fs::read(path)
                .map_err(|e| invalid("metrics-tls-ca", format!("{}: {e}", path.display())))?;
            match reqwest::Certificate::from_pem_bundle(&pem) {
                Ok(certs) if !certs.is_empty() => Ok(pem),
                Ok(_) => Err(invalid("metrics-tls-ca", "holds no certificate")),
                Err(e) => Err(invalid("metrics-tls-ca", e.to_string())),
            }
        })
        .transpose()?;
    Ok(Some(ScrapeConfig {
        url,
        interval: Duration::from_millis(interval_ms),
        models: engine.map(|engine| ModelsEndpoint {
            url: below(&engine, "v1/models"),
        }),
        tls_ca,
    }))
}
