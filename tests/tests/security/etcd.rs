//! etcd roles, TLS and authentication, and the start-up checks of the etcd flags
//! (finding 10 of issue 14).

use integration_tests::security::{ENGINES, RELAY_7, ROOT, ROUTER, SecureCluster, password};
use kv_events::WorkerId;
use mocker::engine::ConnectionArgs;
use router_daemon::{DaemonConfig, ServeArgs};

/// etcd enforces the shipped roles: a worker writes only its own key, a reader only
/// reads, and a client without the CA's certificate or without a password gets
/// nothing.
#[tokio::test]
async fn etcd_refuses_what_the_roles_do_not_allow() {
    let cluster = SecureCluster::start().await.expect("secured servers start");
    let s = &cluster.subjects;
    let denied = |e: etcd_client::Error| {
        let e = e.to_string();
        assert!(e.contains("permission denied"), "{e}");
    };
    let mut relay = cluster
        .etcd_as(Some("client"), Some(RELAY_7))
        .await
        .expect("worker 7 connects");
    relay
        .put(s.etcd_worker_key(WorkerId(7)), "{}", None)
        .await
        .expect("own key");
    denied(
        relay
            .put(s.etcd_worker_key(WorkerId(8)), "{}", None)
            .await
            .unwrap_err(),
    );
    denied(
        relay
            .put("kv-router/other/workers/7", "{}", None)
            .await
            .unwrap_err(),
    );
    let mut engines = cluster
        .etcd_as(Some("client"), Some(ENGINES))
        .await
        .unwrap();
    engines
        .put(s.etcd_worker_key(WorkerId(2)), "{}", None)
        .await
        .expect("own key");
    denied(
        engines
            .delete(s.etcd_worker_key(WorkerId(7)), None)
            .await
            .unwrap_err(),
    );

    let mut router = cluster.etcd_as(Some("client"), Some(ROUTER)).await.unwrap();
    let listed = router
        .get(
            s.etcd_worker_prefix(),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("readers list the prefix");
    assert_eq!(listed.kvs().len(), 2);
    denied(
        router
            .put(s.etcd_worker_key(WorkerId(9)), "{}", None)
            .await
            .unwrap_err(),
    );

    // A certificate but no password: the certificate's name is no etcd user.
    let mut anonymous = cluster.etcd_as(Some("client"), None).await.unwrap();
    let err = anonymous
        .get(s.etcd_worker_prefix(), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("user name is empty") || err.contains("permission denied"),
        "{err}"
    );
    // A wrong password, no client certificate, or one from another CA: no session.
    let flags = std::iter::once("t".to_owned()).chain(cluster.etcd_flags(ROUTER));
    let mut config = kv_cluster::args::parse_flags::<kv_cluster::args::EtcdArgs, _, _>(flags)
        .unwrap()
        .to_config()
        .unwrap();
    config.credentials.as_mut().unwrap().password = password(ROOT);
    let Err(err) = kv_cluster::etcd::connect(&config).await else {
        panic!("a wrong password connected")
    };
    assert!(err.to_string().contains("authentication failed"), "{err}");
    for cert in [None, Some("rogue")] {
        let Err(err) = cluster.etcd_as(cert, Some(ROUTER)).await else {
            panic!("client certificate {cert:?} connected")
        };
        println!("client certificate {cert:?}: {err}");
    }
    // The script refuses to run without root once auth is on.
    let err = cluster
        .rbac(&["reader", "intruder"], Some("pw"), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("etcd-rbac.sh"), "{err}");
}

/// Finding 10: an `https://` etcd endpoint without TLS settings (or TLS settings with
/// an `http://` endpoint) is refused when the flags are validated, by every
/// participant, instead of retrying forever without becoming ready.
#[test]
fn an_https_etcd_endpoint_without_tls_is_refused_at_start() {
    let https = ["kv-router", "--etcd-endpoints", "https://127.0.0.1:2379"];
    let check = |err: String| {
        assert!(
            err.contains("https://127.0.0.1:2379") && err.contains("--etcd-tls-ca"),
            "{err}"
        );
    };
    let serve: ServeArgs =
        kv_cluster::args::parse_flags(https.iter().chain(&["--block-size", "16"])).unwrap();
    check(format!(
        "{:#}",
        DaemonConfig::from_args(&serve).unwrap_err()
    ));
    let relay: kv_relay::RelayArgs = kv_cluster::args::parse_flags(https.iter().chain(&[
        "--engine-endpoint",
        "tcp://127.0.0.1:5557",
        "--worker-id",
        "1",
    ]))
    .unwrap();
    check(format!(
        "{:#}",
        kv_relay::RelayConfig::from_args(&relay).unwrap_err()
    ));
    let gateway: kv_gateway::GatewayArgs = kv_cluster::args::parse_flags(https.iter().chain(&[
        "--served-model-name",
        "m",
        "--tokenize-via",
        "engine",
    ]))
    .unwrap();
    check(format!("{:#}", gateway.to_config().unwrap_err()));
    let engines: ConnectionArgs = kv_cluster::args::parse_flags(https).unwrap();
    check(engines.etcd.to_config().unwrap_err().to_string());

    let pki = integration_tests::security::Pki::generate().unwrap();
    let ca = pki.arg("ca.pem");
    let plain: ServeArgs = kv_cluster::args::parse_flags([
        "kv-router",
        "--etcd-endpoints",
        "http://127.0.0.1:2379",
        "--etcd-tls-ca",
        &ca,
        "--block-size",
        "16",
    ])
    .unwrap();
    let err = format!("{:#}", DaemonConfig::from_args(&plain).unwrap_err());
    assert!(
        err.contains("http://127.0.0.1:2379") && err.contains("https://"),
        "{err}"
    );
}
