//! Role permissions and their rendering; the shipped example stays what the generator
//! produces.

use super::cli::NatsUsersArgs;
use super::*;
use kv_events::Namespace;

fn subjects() -> Subjects {
    Subjects::new(Namespace::new("ns").expect("valid namespace"))
}

#[test]
fn a_worker_publishes_only_its_own_subjects() {
    let p = permissions(&subjects(), "relay-7", &Role::Worker(vec![WorkerId(7)]))
        .expect("workers are restricted");
    assert_eq!(p.publish, ["ns.kv.events.7", "ns.kv.metrics.7"]);
    assert_eq!(
        p.subscribe,
        ["ns.kv.recovery.7", "ns.engine.7.*", "_INBOX.relay-7.>"]
    );
    assert!(p.responses);
}

#[test]
fn only_routers_join_the_route_queue_group() {
    let s = subjects();
    let router = permissions(&s, "r", &Role::Router).expect("restricted");
    assert!(
        router
            .subscribe
            .contains(&"ns.router.route ns-router".to_owned())
    );
    assert!(
        router
            .subscribe
            .contains(&"ns.router.route_batch ns-router".to_owned())
    );
    assert!(!router.subscribe.contains(&"ns.router.route".to_owned()));
    for role in [Role::Frontend, Role::Worker(vec![WorkerId(1)])] {
        let p = permissions(&s, "x", &role).expect("restricted");
        assert!(
            p.subscribe.iter().all(|s| !s.starts_with("ns.router.")),
            "{role:?}: {p:?}"
        );
    }
}

#[test]
fn frontends_cannot_publish_events_or_bookings() {
    let p = permissions(&subjects(), "gw", &Role::Frontend).expect("restricted");
    assert_eq!(
        p.publish,
        [
            "ns.router.route",
            "ns.router.route_batch",
            "ns.router.at.*.route",
            "ns.router.at.*.route_batch",
            "ns.router.replicas",
            "ns.router.removals",
            "ns.router.overlap",
            "ns.router.lifecycle",
            "ns.engine.*.*"
        ]
    );
    assert_eq!(p.subscribe, ["_INBOX.gw.>"]);
    assert!(!p.responses);
    assert_eq!(permissions(&subjects(), "op", &Role::Operator), None);
}

#[test]
fn names_are_checked_and_passwords_are_variables() {
    let user = |name: &str, role| NatsUser {
        name: name.into(),
        role,
        password: None,
    };
    let s = subjects();
    let err = nats_authorization(&s, &[user("a.b", Role::Router)]).unwrap_err();
    assert_eq!(err, SecurityError::UserName("a.b".into()));
    let err = nats_authorization(
        &s,
        &[user("a-b", Role::Router), user("a_b", Role::Frontend)],
    )
    .unwrap_err();
    assert_eq!(err, SecurityError::Duplicate("a-b".into(), "a_b".into()));
    let err = nats_authorization(&s, &[user("w", Role::Worker(vec![]))]).unwrap_err();
    assert_eq!(err, SecurityError::NoWorkers("w".into()));
    let conf = nats_authorization(&s, &[user("router-1", Role::Router)]).unwrap();
    assert!(
        conf.contains("password: $KV_ROUTER_NATS_PASSWORD_ROUTER_1"),
        "{conf}"
    );
    let secret = NatsUser {
        password: Some("hunter2".into()),
        ..user("gw", Role::Frontend)
    };
    assert!(!format!("{secret:?}").contains("hunter2"));
}

/// The command that generated `deploy/security/users.conf` (its header says so).
const EXAMPLE: &[&str] = &[
    "kv-router",
    "--namespace",
    "kv-router",
    "--router",
    "router-1",
    "--router",
    "router-2",
    "--worker",
    "relay-1=1",
    "--worker",
    "engines-a=2,3",
    "--frontend",
    "gateway-1",
    "--operator",
    "admin",
];

#[test]
fn the_shipped_example_is_the_generators_output() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/security/users.conf");
    let shipped = std::fs::read_to_string(path).expect("deploy/security/users.conf");
    let args: NatsUsersArgs = crate::args::parse_flags(EXAMPLE).expect("example flags");
    let generated = args.render().expect("valid users");
    assert!(
        shipped.ends_with(&generated),
        "deploy/security/users.conf is out of date; regenerate it with\n\
         kv-router security nats-users {}",
        EXAMPLE[1..].join(" ")
    );
}

#[test]
fn a_bad_namespace_is_refused_naming_the_flag() {
    let args: NatsUsersArgs =
        crate::args::parse_flags(["kv-router", "--namespace", "a.b", "--router", "r"])
            .expect("flags parse");
    let err = args.render().expect_err("a.b is not a subject token");
    assert!(matches!(err, SecurityError::Namespace(_)), "{err}");
    assert!(err.to_string().contains("--namespace"), "{err}");
}
