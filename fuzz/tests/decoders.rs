//! The short fuzz run of `cargo test --workspace`: every decoder of network input
//! gets a few hundred generated inputs (plus its seeds) and must not panic, must
//! refuse with a message, and must stay within the allocation bound. The long run is
//! `examples/fuzz_decoders.rs`.

use kv_fuzz::runner::{self, Bound, Plan, Problem};
use kv_fuzz::targets::{ALL, Verdict, by_name};

#[global_allocator]
static ALLOC: peak_alloc::PeakAlloc = peak_alloc::PeakAlloc;

/// Inputs per target: a few seconds for all targets in a debug build.
const INPUTS: u64 = 400;

#[test]
fn every_decoder_survives_a_short_run() {
    let _serial = kv_fuzz::meter::one_test_at_a_time();
    let plan = Plan {
        seed: 20_251_123,
        start: 0,
        inputs: INPUTS,
        targets: ALL.iter().collect(),
        bound: Bound::DEFAULT,
    };
    let reports = runner::run(plan, 0, |_, _| {}).expect("the counting allocator is installed");
    let mut failures = String::new();
    for report in &reports {
        assert_eq!(report.inputs, INPUTS, "{}", report.name);
        for failure in &report.failures {
            failures.push_str(&format!(
                "{}: {}\n{}\n",
                failure.target,
                failure.problem,
                failure.test_snippet()
            ));
        }
        // The generator must reach past the decoder and also break messages.
        assert!(
            report.accepted > 0,
            "{}: no input was accepted",
            report.name
        );
        assert!(report.refused > 0, "{}: no input was refused", report.name);
    }
    assert!(failures.is_empty(), "failing inputs:\n{failures}");
}

#[test]
fn the_meter_sees_allocations_and_the_bound_is_enforced() {
    let _serial = kv_fuzz::meter::one_test_at_a_time();
    let meter = kv_fuzz::meter::Meter::new().expect("the counting allocator is installed");
    let (v, peak) = meter.peak_of(|| Vec::<u8>::with_capacity(1 << 20));
    drop(v);
    // The counters are process-wide: the test harness's own threads may free a few
    // bytes meanwhile (seen in CI: 34 bytes short of 1 MiB), so allow 64 KiB of noise.
    assert!(peak >= (1 << 20) - (64 << 10), "peak {peak}");
    let target = by_name("events").expect("the events target exists");
    let seed = target.corpus().seeds()[0].clone();
    let handled = runner::check(target, &meter, Bound::DEFAULT, &seed).expect("a seed passes");
    assert_eq!(handled.verdict, Verdict::Accepted);
    assert!(handled.peak > 0);
    let nothing = Bound {
        per_byte: 0,
        constant: 0,
    };
    assert!(matches!(
        runner::check(target, &meter, nothing, &seed),
        Err(Problem::OverAllocated { .. })
    ));
}
