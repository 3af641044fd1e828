//! Flag parsing and validation of the NATS and etcd groups.

use super::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    etcd: EtcdArgs,
}

fn nats(args: &[&str]) -> Result<NatsConfig, Error> {
    Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
        .expect("flags parse")
        .nats
        .to_config()
}

#[test]
fn defaults_are_one_local_server_without_auth_or_tls() {
    let cli = Cli::try_parse_from(["t"]).expect("no flags parse");
    let n = cli.nats.to_config().unwrap();
    assert_eq!(n.servers, ["nats://127.0.0.1:4222"]);
    assert_eq!(n.auth, NatsAuth::None);
    assert_eq!(n.tls, NatsTls::default());
    let e = cli.etcd.to_config().unwrap();
    assert_eq!(e.endpoints, ["http://127.0.0.1:2379"]);
    assert_eq!(e.connect_timeout, Duration::from_secs(5));
    assert_eq!((e.credentials, e.tls), (None, None));
    assert_eq!(n.inbox_prefix, None);
    let (n, e) = (NatsArgs::default(), EtcdArgs::default());
    assert_eq!(n.to_config().unwrap(), cli.nats.to_config().unwrap());
    assert_eq!(e.to_config().unwrap(), cli.etcd.to_config().unwrap());
}

#[test]
fn each_auth_method_and_tls() {
    let n = nats(&["--nats-creds", "/s/r.creds"]).unwrap();
    assert_eq!(n.auth, NatsAuth::CredentialsFile("/s/r.creds".into()));
    let n = nats(&["--nats-token", "t0k"]).unwrap();
    assert_eq!(n.auth, NatsAuth::Token("t0k".into()));
    let n = nats(&["--nats-user", "u", "--nats-password", "p"]).unwrap();
    assert_eq!(
        n.auth,
        NatsAuth::UserPassword {
            user: "u".into(),
            password: "p".into()
        }
    );
    let n = nats(&[
        "--nats-tls-ca",
        "/s/ca.pem",
        "--nats-tls-cert",
        "/s/c.pem",
        "--nats-tls-key",
        "/s/k.pem",
        "--nats-tls-required",
    ])
    .unwrap();
    assert_eq!(
        n.tls,
        NatsTls {
            ca_file: Some("/s/ca.pem".into()),
            client_cert: Some(ClientCertificate {
                cert: "/s/c.pem".into(),
                key: "/s/k.pem".into(),
            }),
            required: true,
        }
    );
}

#[test]
fn bad_combinations_name_the_flag() {
    let err = |args: &[&str]| nats(args).unwrap_err().to_string();
    assert!(err(&["--nats-tls-cert", "c"]).contains("--nats-tls-key"));
    assert!(err(&["--nats-tls-key", "k"]).contains("--nats-tls-cert"));
    assert!(err(&["--nats-user", "u"]).contains("--nats-password"));
    assert!(err(&["--nats-password", "p"]).contains("--nats-user"));
    assert!(err(&["--nats-token", "t", "--nats-creds", "c"]).contains("--nats-creds"));
    assert!(err(&["--nats-url", " , "]).contains("--nats-url"));
    let cli = Cli::try_parse_from(["t", "--etcd-endpoints", ","]).expect("flags parse");
    let err = cli.etcd.to_config().unwrap_err().to_string();
    assert!(err.contains("--etcd-endpoints"), "{err}");
}

#[test]
fn inbox_prefix_must_be_a_literal_subject() {
    let n = nats(&["--nats-inbox-prefix", "_INBOX.router-1"]).unwrap();
    assert_eq!(n.inbox_prefix.as_deref(), Some("_INBOX.router-1"));
    for bad in ["_INBOX.>", "_INBOX..a", "a b", ""] {
        let err = nats(&["--nats-inbox-prefix", bad]).unwrap_err().to_string();
        assert!(err.contains("--nats-inbox-prefix"), "{bad:?}: {err}");
    }
}

fn etcd(args: &[&str]) -> Result<EtcdConfig, Error> {
    Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied()))
        .expect("flags parse")
        .etcd
        .to_config()
}

/// A CA certificate, a client certificate and its key, as PEM files in a fresh
/// directory.
struct Pems {
    dir: tempfile::TempDir,
}

impl Pems {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let key = rcgen::KeyPair::generate().expect("key generation");
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .expect("valid name")
            .self_signed(&key)
            .expect("self-signed certificate");
        for (name, pem) in [
            ("ca.pem", cert.pem()),
            ("cert.pem", cert.pem()),
            ("key.pem", key.serialize_pem()),
            ("garbage.pem", "not pem".to_owned()),
        ] {
            std::fs::write(dir.path().join(name), pem).expect("write pem");
        }
        Self { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
}

#[test]
fn etcd_credentials_and_tls_are_read_and_checked() {
    let pems = Pems::new();
    let (ca, cert, key) = (
        pems.path("ca.pem"),
        pems.path("cert.pem"),
        pems.path("key.pem"),
    );
    let e = etcd(&[
        "--etcd-endpoints",
        "https://a:2379,b:2379",
        "--etcd-user",
        "router",
        "--etcd-password",
        "pw",
        "--etcd-tls-ca",
        &ca,
        "--etcd-tls-cert",
        &cert,
        "--etcd-tls-key",
        &key,
    ])
    .unwrap();
    assert_eq!(e.endpoints, ["https://a:2379", "https://b:2379"]);
    let credentials = e.credentials.expect("credentials");
    assert_eq!(
        (credentials.user.as_str(), credentials.password.as_str()),
        ("router", "pw")
    );
    let tls = e.tls.expect("tls");
    assert_eq!(tls.ca.pem, std::fs::read(&ca).unwrap());
    let (c, k) = tls.client.expect("client certificate");
    assert_eq!((c.path, k.path), (cert.into(), key.into()));
    let plain = etcd(&["--etcd-endpoints", "a:2379"]).unwrap();
    assert_eq!(plain.endpoints, ["http://a:2379"]);
}

#[test]
fn etcd_scheme_must_match_the_tls_flags() {
    let pems = Pems::new();
    let ca = pems.path("ca.pem");
    let err = |args: &[&str]| etcd(args).unwrap_err().to_string();
    let e = err(&["--etcd-endpoints", "https://etcd:2379"]);
    assert!(
        e.contains("https://etcd:2379") && e.contains("--etcd-tls-ca"),
        "{e}"
    );
    let e = err(&["--etcd-endpoints", "http://etcd:2379", "--etcd-tls-ca", &ca]);
    assert!(
        e.contains("http://etcd:2379") && e.contains("use https://"),
        "{e}"
    );
    let e = err(&[
        "--etcd-endpoints",
        "https://a:1,http://b:2",
        "--etcd-tls-ca",
        &ca,
    ]);
    assert!(e.contains("http://b:2"), "{e}");
    let e = err(&["--etcd-endpoints", "unix://etcd.sock"]);
    assert!(e.contains("http:// or https://"), "{e}");
    for bad in ["http://", "etcd:2379/v3", "http://etcd:2379/v3", ":2379"] {
        let e = err(&["--etcd-endpoints", bad]);
        assert!(e.contains(bad), "{bad}: {e}");
    }
    let named = etcd(&["--etcd-endpoints", "localhost:2379,[::1]:2379,http:/c:1"]).unwrap();
    assert_eq!(
        named.endpoints,
        ["http://localhost:2379", "http://[::1]:2379", "http://c:1"]
    );
}

#[test]
fn etcd_bad_combinations_and_files_name_the_flag() {
    let pems = Pems::new();
    let err = |args: &[&str]| etcd(args).unwrap_err().to_string();
    assert!(err(&["--etcd-user", "u"]).contains("--etcd-password"));
    assert!(err(&["--etcd-password", "p"]).contains("--etcd-user"));
    let (cert, key) = (pems.path("cert.pem"), pems.path("key.pem"));
    assert!(err(&["--etcd-tls-cert", &cert]).contains("--etcd-tls-key"));
    assert!(err(&["--etcd-tls-key", &key]).contains("--etcd-tls-cert"));
    let e = err(&["--etcd-tls-cert", &cert, "--etcd-tls-key", &key]);
    assert!(e.contains("--etcd-tls-ca"), "{e}");
    let e = err(&["--etcd-tls-ca", "/nonexistent/ca.pem"]);
    assert!(e.contains("--etcd-tls-ca /nonexistent/ca.pem"), "{e}");
    let garbage = pems.path("garbage.pem");
    let e = err(&["--etcd-tls-ca", &garbage]);
    assert!(e.contains("no pem certificate"), "{e}");
    let ca = pems.path("ca.pem");
    let e = err(&[
        "--etcd-tls-ca",
        &ca,
        "--etcd-tls-cert",
        &cert,
        "--etcd-tls-key",
        &ca,
    ]);
    assert!(
        e.contains("--etcd-tls-key") && e.contains("private key"),
        "{e}"
    );
}
