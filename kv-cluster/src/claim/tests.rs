use super::*;

fn name(s: &str) -> WorkerName {
    WorkerName::new(s).expect("valid name")
}

#[test]
fn derived_ids_are_stable_53_bit_and_differ_per_attempt() {
    let a = name("vllm-0");
    // Pinned: a change here moves every deployed worker to a new id.
    assert_eq!(
        derived_worker_id(&a, 0),
        derived_worker_id(&name("vllm-0"), 0)
    );
    let ids: Vec<u64> = (0..MAX_PROBES)
        .map(|i| derived_worker_id(&a, i).0)
        .collect();
    for id in &ids {
        assert!(*id <= MAX_DERIVED_ID, "{id}");
    }
    let mut distinct = ids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), ids.len(), "{ids:?}");
    assert_ne!(
        derived_worker_id(&name("vllm-1"), 0),
        derived_worker_id(&a, 0)
    );
}

#[test]
fn names_are_bounded_and_printable() {
    assert!(WorkerName::new("pod-7.engines").is_ok());
    assert!(WorkerName::new("x".repeat(MAX_NAME_BYTES)).is_ok());
    for bad in [
        String::new(),
        "x".repeat(MAX_NAME_BYTES + 1),
        "a b".into(),
        "a\u{7}".into(),
    ] {
        let err = WorkerName::new(bad.clone()).expect_err("refused");
        assert!(
            err.to_string().contains("invalid worker name"),
            "{bad:?}: {err}"
        );
    }
}

#[test]
fn holders_print_for_humans_and_unreadable_values_are_named() {
    let seen = HolderSeen {
        holder: Some(ClaimHolder {
            name: "pod-a".into(),
            host: Some("node-1".into()),
            pid: Some(12),
        }),
        lease_id: 31,
        bytes: 40,
    };
    assert_eq!(
        seen.to_string(),
        r#""pod-a" (host node-1, pid 12, lease 0x1f)"#
    );
    assert!(seen.is(&name("pod-a")));
    assert!(!seen.is(&name("pod-b")));
    let unreadable = HolderSeen {
        holder: None,
        lease_id: 31,
        bytes: 5000,
    };
    assert_eq!(
        unreadable.to_string(),
        "an unreadable value of 5000 bytes (lease 0x1f)"
    );
    assert!(!unreadable.is(&name("pod-a")));
}
