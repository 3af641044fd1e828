//! Tests of the policy enum: defaults per kind, overrides, serde, dispatch.

use super::test_support::*;
use super::*;
use proptest::prelude::*;

#[test]
fn default_for_covers_every_kind_and_round_trips_kind() {
    for kind in PolicyKind::ALL {
        let policy = PolicyConfig::default_for(kind);
        assert_eq!(policy.kind(), kind);
        assert!(policy.validate().is_ok(), "{kind}");
        let json = serde_json::to_value(policy).unwrap();
        assert_eq!(json["kind"], kind.as_str());
        assert_eq!(
            serde_json::from_value::<PolicyConfig>(json).unwrap(),
            policy
        );
    }
    assert_eq!(
        PolicyConfig::default(),
        PolicyConfig::default_for(PolicyKind::PredictedTtft)
    );
}

#[test]
fn overrides_replace_only_the_named_knobs() {
    let kv = PolicyConfig::default_for(PolicyKind::Kv);
    let o = CostOverrides {
        overlap_credit: Some(0.5),
        temperature: Some(2.0),
        ..CostOverrides::default()
    };
    assert_eq!(
        kv.with_overrides(&o).unwrap(),
        PolicyConfig::Kv(KvPolicyConfig {
            prefill_load_scale: 1.0,
            overlap_credit: 0.5,
            temperature: 2.0,
            ..KvPolicyConfig::default()
        })
    );
    let norm = PolicyConfig::default_for(PolicyKind::KvNormalized);
    let o = CostOverrides {
        load_balance_weight: Some(3.0),
        ..CostOverrides::default()
    };
    match norm.with_overrides(&o).unwrap() {
        PolicyConfig::KvNormalized(c) => {
            assert_eq!(c.load_balance_weight, 3.0);
            assert_eq!(c.match_rate_threshold, 0.1);
        }
        other => panic!("{other:?}"),
    }
    // No overrides: unchanged, for every policy.
    for kind in PolicyKind::ALL {
        let p = PolicyConfig::default_for(kind);
        assert_eq!(p.with_overrides(&CostOverrides::default()).unwrap(), p);
    }
}

#[test]
fn overrides_a_policy_lacks_or_out_of_range_are_typed_errors() {
    let field = |p: PolicyConfig, o: CostOverrides| match p.with_overrides(&o) {
        Err(SchedulerError::InvalidOverride { field, reason }) => (field, reason),
        other => panic!("expected an invalid override, got {other:?}"),
    };
    let temp = CostOverrides {
        temperature: Some(1.0),
        ..CostOverrides::default()
    };
    let (f, reason) = field(PolicyConfig::RoundRobin, temp);
    assert_eq!(f, "temperature");
    assert_eq!(reason, "policy round-robin has no such knob");
    let beta = CostOverrides {
        load_balance_weight: Some(1.0),
        ..CostOverrides::default()
    };
    assert_eq!(
        field(PolicyConfig::default_for(PolicyKind::Kv), beta).0,
        "load_balance_weight"
    );
    let credit = CostOverrides {
        overlap_credit: Some(1.0),
        ..CostOverrides::default()
    };
    assert_eq!(
        field(PolicyConfig::default_for(PolicyKind::KvNormalized), credit).0,
        "overlap_credit"
    );
    let negative = CostOverrides {
        prefill_load_scale: Some(-1.0),
        ..CostOverrides::default()
    };
    let (f, reason) = field(PolicyConfig::default_for(PolicyKind::Kv), negative);
    assert_eq!(f, "prefill_load_scale");
    assert!(reason.contains("-1"), "{reason}");
    let nan = CostOverrides {
        temperature: Some(f64::NAN),
        ..CostOverrides::default()
    };
    assert_eq!(
        field(PolicyConfig::default_for(PolicyKind::Kv), nan).0,
        "temperature"
    );
}

#[test]
fn empty_candidate_set_is_no_workers_for_every_policy() {
    for kind in PolicyKind::ALL {
        assert_eq!(
            selector(1).select(
                &PolicyConfig::default_for(kind),
                &ctx(shape(3, 48, 16), &[])
            ),
            Err(SchedulerError::NoWorkers),
            "{kind}"
        );
    }
}

proptest! {
    /// Every policy returns an index into the candidates, and cost-based policies
    /// report the chosen candidate's own cost; at temperature 0, `kv` picks a minimum.
    #[test]
    fn every_policy_picks_a_candidate(
        loads in proptest::collection::vec((0u32..20, 0u64..50, 0usize..8, 0u32..20), 1..12),
        request_blocks in 1u32..20,
        seed in any::<u64>(),
    ) {
        let cands: Vec<Candidate> = loads
            .iter()
            .enumerate()
            .map(|(i, &(o, d, r, n))| cand(i as u64, o.min(request_blocks), d, r, n.min(request_blocks)))
            .collect();
        let req = shape(request_blocks, u64::from(request_blocks) * 16, 16);
        let c = ctx(req, &cands);
        for kind in PolicyKind::ALL {
            let choice = selector(seed).select(&PolicyConfig::default_for(kind), &c).unwrap();
            prop_assert!(choice.index < cands.len());
        }
        let kv_config = KvPolicyConfig::default();
        let choice = selector(seed).select(&PolicyConfig::Kv(kv_config), &c).unwrap();
        let min = cands.iter().map(|x| kv::kv_cost(&kv_config, &req, x)).fold(f64::INFINITY, f64::min);
        prop_assert_eq!(choice.cost, Some(min));
    }
}
