//! `kv-router relay` reads an engine served over `https://` (issue 26): its vLLM-like
//! metrics page and its `/v1/models`, from a local TLS server whose certificate is
//! signed by a private CA given with `--metrics-tls-ca`, against real nats-server
//! and etcd and the router daemon in-process. The relay used to refuse `https://`
//! metrics URLs (its HTTP client spoke plain HTTP/1.1 only).

// Test helpers unwrap: a broken fixture or socket must fail the test loudly.
#![allow(clippy::unwrap_used)]

#[path = "relay/engine.rs"]
#[allow(dead_code)]
mod engine;
#[path = "relay/helpers.rs"]
#[allow(dead_code)]
mod helpers;

use axum::Router;
use axum::routing::get;
use engine::{FakeEngine, ReplayFraming, VLLM_METRICS};
use helpers::*;
use integration_tests::TestCluster;
use integration_tests::security::Pki;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// TCP connections that completed a TLS handshake; failed handshakes are dropped.
struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // A failed accept or handshake concerns that one client only.
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            if let Ok(tls) = self.acceptor.accept(tcp).await {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// Serves [`VLLM_METRICS`] on `/metrics` and a model list (context length 4096) on
/// `/v1/models` over TLS with `pki`'s server certificate (for `localhost`); returns
/// the base URL and the server task.
async fn serve_https(pki: &Pki) -> (String, tokio::task::JoinHandle<()>) {
    let certs = CertificateDer::pem_file_iter(pki.path("server.pem"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(pki.path("server-key.pem")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("https://localhost:{}", tcp.local_addr().unwrap().port());
    let listener = TlsListener {
        tcp,
        acceptor: TlsAcceptor::from(Arc::new(config)),
    };
    let app = Router::new()
        .route("/metrics", get(|| async { VLLM_METRICS }))
        .route(
            "/v1/models",
            get(|| async { r#"{"object":"list","data":[{"id":"m","max_model_len":4096}]}"# }),
        );
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (base, task)
}

/// The worker registers the block size, KV capacity and context length that the
/// engine states over https, trusted through `--metrics-tls-ca`; without that CA
/// the certificate is refused.
#[tokio::test]
async fn the_relay_scrapes_an_https_engine_signed_by_a_private_ca() {
    let pki = Pki::generate().unwrap();
    let (base, server) = serve_https(&pki).await;
    let untrusting = kv_cluster::http::client().unwrap();
    let refused = kv_cluster::http::get_text(&untrusting, format!("{base}/metrics"), WAIT, 1 << 20)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("certificate"), "{refused}");
    let cluster = TestCluster::start(BLOCK).await.unwrap();
    let daemon = cluster.start_daemon(|_| {}).await.unwrap();
    let mut engine = FakeEngine::start("kv-events", ReplayFraming::WithTopic).await;
    let ca = pki.arg("ca.pem");
    let extra = [
        "--engine-url",
        base.as_str(),
        "--metrics-tls-ca",
        ca.as_str(),
        "--metrics-interval-ms",
        "100",
    ];
    let flags = engine.relay_flags_without_page();
    let (relay, reg) = registered_with(&cluster, &daemon, &mut engine, flags, &extra).await;
    assert_eq!(
        (reg.block_size, reg.total_kv_blocks, reg.max_model_len),
        (BLOCK, 1000, Some(4096)),
        "the page and /v1/models were read over https"
    );
    assert_eq!(reg.url.as_deref(), Some(base.as_str()));
    assert!(relay.counters().scrapes("ok") >= 1);
    assert_eq!(relay.counters().scrapes("failed"), 0);
    relay.shutdown().await.unwrap();
    engine.stop();
    server.abort();
    daemon.shutdown().await.unwrap();
}
