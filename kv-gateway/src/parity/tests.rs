//! Unit tests of the parity monitor: the judgement, the window and the likely causes.

use super::*;
use kv_cluster::metrics::Registrar;
use kv_events::discovery::WorkerRegistration;
use prometheus::{Encoder as _, Registry, TextEncoder};

const BLOCK: u32 = 16;

/// A monitor whose worker 1 registered `block_size`, its registry and the worker map.
pub(crate) fn monitor(block_size: u32) -> (ParityMonitor, Registry, WorkerUrls) {
    let registry = Registry::new();
    let metrics = GatewayMetrics::new(&Registrar::new(&registry)).expect("metrics");
    let workers = WorkerUrls::default();
    workers.insert(&registration(1, block_size));
    (
        ParityMonitor::new(metrics, workers.clone()),
        registry,
        workers,
    )
}

fn registration(id: u64, block_size: u32) -> WorkerRegistration {
    WorkerRegistration {
        worker_id: WorkerId(id),
        dp_size: 1,
        block_size,
        total_kv_blocks: 100,
        url: Some("http://e:1".into()),
        epoch: 0,
        max_model_len: None,
        role: Default::default(),
        kv_transfer: None,
    }
}

fn page(registry: &Registry) -> String {
    let mut out = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut out)
        .expect("encodes");
    String::from_utf8(out).expect("utf-8")
}

/// The value of the series `line` (name and labels as exported), if present.
fn value(registry: &Registry, line: &str) -> Option<f64> {
    page(registry)
        .lines()
        .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
}

pub(crate) fn cached(cached: u64, prompt: u64) -> Reported {
    Reported {
        cached_tokens: Some(cached),
        prompt_tokens: Some(prompt),
    }
}

/// Judges one answer on worker 1: `overlap` predicted blocks of a `prompt`-token
/// prompt, the engine reporting `reported`.
fn judge(m: &ParityMonitor, overlap: u32, prompt: usize, reported: Reported) {
    m.pending(WorkerId(1), overlap, 0, prompt)
        .expect("worker 1 is registered")
        .judge(reported);
}

/// Answers of worker 1 counted with `outcome`.
pub(crate) fn outcome(registry: &Registry, outcome: &str) -> f64 {
    let line = format!(r#"kv_gateway_cache_parity_total{{outcome="{outcome}",worker="1"}}"#);
    value(registry, &line).unwrap_or(0.0)
}

#[test]
fn a_block_aligned_prompt_agrees_whether_the_engine_counts_its_last_block_or_not() {
    let (m, registry, _) = monitor(BLOCK);
    // 4 full blocks: the router predicts at most 3 (the blocks before the last token),
    // vLLM reports at most 3, an engine that counts the block it recomputes 4.
    judge(&m, 3, 64, cached(48, 64));
    judge(&m, 3, 64, cached(64, 64));
    // 4 full blocks and a partial one: all 4 can be reported.
    judge(&m, 4, 70, cached(64, 70));
    assert_eq!(outcome(&registry, "agree"), 3.0);
    judge(&m, 4, 70, cached(48, 70));
    judge(&m, 2, 70, cached(48, 70));
    assert_eq!(outcome(&registry, "over_claim"), 1.0);
    assert_eq!(outcome(&registry, "under_claim"), 1.0);
    // A router that claims the last block of an aligned prompt over-claims.
    judge(&m, 4, 64, cached(48, 64));
    assert_eq!(outcome(&registry, "over_claim"), 2.0);
    let diff = |suffix: &str| {
        value(
            &registry,
            &format!(r#"kv_gateway_cache_parity_diff_tokens_{suffix}{{worker="1"}}"#),
        )
    };
    assert_eq!(diff("count"), Some(6.0));
    assert_eq!(diff("sum"), Some(16.0), "+16, -16 and +16");
}

#[test]
fn an_answer_without_a_cached_count_is_unreported_and_never_judged() {
    let (m, registry, _) = monitor(BLOCK);
    for _ in 0..WINDOW {
        judge(&m, 3, 64, Reported::default());
        judge(
            &m,
            3,
            64,
            Reported {
                cached_tokens: None,
                prompt_tokens: Some(64),
            },
        );
    }
    assert_eq!(outcome(&registry, "unreported"), 20.0);
    assert_eq!(outcome(&registry, "agree"), 0.0);
    assert_eq!(m.flagged(WorkerId(1)), None);
    let count = r#"kv_gateway_cache_parity_diff_tokens_count{worker="1"}"#;
    assert_eq!(value(&registry, count), Some(0.0));
}

#[test]
fn a_worker_is_flagged_at_the_fifth_disagreement_of_ten_and_cleared_when_they_agree_again() {
    let (m, registry, _) = monitor(BLOCK);
    let gauge = r#"kv_gateway_cache_parity_mismatch{cause="no_matching_events",worker="1"}"#;
    // Cold prompts on both sides say nothing: they never fill the window.
    for _ in 0..20 {
        judge(&m, 0, 100, cached(0, 100));
    }
    for _ in 0..4 {
        judge(&m, 0, 100, cached(64, 100));
        judge(&m, 6, 100, cached(96, 100));
    }
    assert_eq!(m.flagged(WorkerId(1)), None, "4 of 8");
    assert_eq!(value(&registry, gauge), None);
    judge(&m, 0, 100, cached(64, 100));
    assert_eq!(m.flagged(WorkerId(1)), Some(Cause::NoMatchingEvents));
    assert_eq!(value(&registry, gauge), Some(1.0));
    // Still flagged while more than one of the last ten disagree.
    for _ in 0..7 {
        judge(&m, 6, 100, cached(96, 100));
    }
    assert_eq!(
        m.flagged(WorkerId(1)),
        Some(Cause::NoMatchingEvents),
        "2 of 10"
    );
    judge(&m, 6, 100, cached(96, 100));
    assert_eq!(m.flagged(WorkerId(1)), None, "1 of 10");
    assert_eq!(value(&registry, gauge), None, "the series is removed");
}

#[test]
fn hits_within_the_blocks_shared_in_flight_are_counted_apart_and_never_flag() {
    let (m, registry, _) = monitor(BLOCK);
    let with_in_flight = |overlap, in_flight, reported| {
        (m.pending(WorkerId(1), overlap, in_flight, 100))
            .expect("worker 1 is registered")
            .judge(reported)
    };
    // 1 block indexed, 2 more shared by requests booked on the rank: the engine may
    // have served 1, 2 or 3 blocks (16, 32 or 48 tokens) without the picture being wrong.
    for cached_tokens in [32, 48, 32, 48, 32, 48, 32, 48, 32, 48] {
        with_in_flight(1, 2, cached(cached_tokens, 100));
    }
    assert_eq!(outcome(&registry, "in_flight"), 10.0);
    assert_eq!(outcome(&registry, "under_claim"), 0.0);
    assert_eq!(
        m.flagged(WorkerId(1)),
        None,
        "in-flight hits are not disagreements"
    );
    // Equal is still `agree`; one block past what is shared is an under-claim.
    with_in_flight(1, 2, cached(16, 100));
    assert_eq!(outcome(&registry, "agree"), 1.0);
    for _ in 0..FLAG_AT {
        with_in_flight(1, 2, cached(64, 100));
    }
    assert_eq!(outcome(&registry, "under_claim"), FLAG_AT as f64);
    assert_eq!(m.flagged(WorkerId(1)), Some(Cause::UnderClaim));
}

/// The cause flagged after five disagreeing answers made by `answer(i)`.
fn cause_of(block_size: u32, answer: impl Fn(usize) -> (u32, usize, Reported)) -> Cause {
    let (m, _, _) = monitor(block_size);
    for i in 0..FLAG_AT {
        let (overlap, prompt, reported) = answer(i);
        judge(&m, overlap, prompt, reported);
    }
    m.flagged(WorkerId(1)).expect("flagged")
}

#[test]
fn each_likely_cause_is_named_from_the_evidence_of_the_disagreements() {
    // The engine counts the prompt otherwise: a tokenizer or template mismatch, even
    // though nothing was predicted.
    let tokenizer = cause_of(BLOCK, |_| (0, 100, cached(64, 99)));
    assert_eq!(tokenizer, Cause::TokenizerMismatch);
    // Registered 32 tokens a block, the engine caches 16-token blocks.
    let block_size = cause_of(32, |i| (0, 100, cached(if i == 2 { 48 } else { 64 }, 100)));
    assert_eq!(block_size, Cause::BlockSizeMismatch);
    // Nothing predicted, hits reported in registered-size blocks.
    let silent = cause_of(BLOCK, |_| (0, 100, cached(32, 100)));
    assert_eq!(silent, Cause::NoMatchingEvents);
    // A prefix predicted, less of it cached, or more.
    let over = cause_of(BLOCK, |i| {
        (4, 100, cached(if i < 3 { 16 } else { 96 }, 100))
    });
    assert_eq!(over, Cause::OverClaim);
    let under = cause_of(BLOCK, |i| {
        (4, 100, cached(if i < 2 { 16 } else { 96 }, 100))
    });
    assert_eq!(under, Cause::UnderClaim);
}

#[test]
fn the_no_events_explanation_names_a_hit_size_other_than_the_block_size() {
    let mut window = Window::default();
    let wrong = |raw_cached| Judged {
        outcome: Outcome::UnderClaim,
        predicted: 0,
        cached: raw_cached,
        raw_cached,
        prompt_tokens: 200,
        engine_prompt_tokens: None,
    };
    for raw in [64, 128, 64, 192] {
        window.push(wrong(raw), BLOCK);
    }
    let change = window.push(wrong(64), BLOCK);
    let Some(Change::Flagged(Cause::NoMatchingEvents, why)) = change else {
        panic!("{change:?}");
    };
    assert!(why.contains("multiple of 64 tokens"), "{why}");
    assert!(why.contains("publishes no KV events"), "{why}");
}

#[test]
fn a_worker_that_left_is_forgotten_with_its_series_and_not_brought_back() {
    let (m, registry, workers) = monitor(BLOCK);
    for _ in 0..FLAG_AT {
        judge(&m, 0, 100, cached(64, 100));
    }
    assert!(page(&registry).contains(r#"worker="1""#));
    let late = m.pending(WorkerId(1), 0, 0, 100).expect("registered");
    workers.remove(WorkerId(1));
    m.forget(WorkerId(1));
    assert!(
        !page(&registry).contains(r#"worker="1""#),
        "{}",
        page(&registry)
    );
    assert_eq!(m.flagged(WorkerId(1)), None);
    // An answer that was streaming when its worker left.
    late.judge(cached(64, 100));
    assert!(!page(&registry).contains(r#"worker="1""#));
    assert!(
        m.pending(WorkerId(1), 0, 0, 100).is_none(),
        "unknown block size"
    );
}

/// `WINDOW` answers on worker 1 predicting `overlap` blocks of a 100-token prompt
/// whose engine served `served` tokens, each a `mismatch` the router confirmed as a
/// race: counted apart (`excused`) and never flagging; the same answers left as
/// mismatches flag the worker with `cause`.
fn confirmed_races_never_flag(
    overlap: u32,
    served: u64,
    mismatch: Outcome,
    excused: &str,
    cause: Cause,
) {
    let (m, registry, _) = monitor(BLOCK);
    let prediction = m
        .pending(WorkerId(1), overlap, 0, 100)
        .expect("registered")
        .prediction;
    for _ in 0..WINDOW {
        let mut judged = prediction.judge(cached(served, 100)).expect("reported");
        assert_eq!(judged.outcome, mismatch);
        judged.outcome = race::settled(judged.outcome, Ok(true));
        m.settle(&prediction, Some(judged));
    }
    assert_eq!(outcome(&registry, excused), WINDOW as f64);
    assert_eq!(outcome(&registry, mismatch.as_str()), 0.0);
    assert_eq!(m.flagged(WorkerId(1)), None, "races are not disagreements");
    for _ in 0..FLAG_AT {
        judge(&m, overlap, 100, cached(served, 100));
    }
    assert_eq!(m.flagged(WorkerId(1)), Some(cause));
}

/// An over-claim the router shows to be a raced eviction is counted `evicted`.
#[test]
fn evicted_answers_are_counted_apart_and_never_flag() {
    confirmed_races_never_flag(4, 32, Outcome::OverClaim, "evicted", Cause::OverClaim);
}

/// An under-claim whose served prefix the index holds when asked is counted `in_flight`.
#[test]
fn under_claims_the_index_confirms_late_are_counted_in_flight_and_never_flag() {
    confirmed_races_never_flag(1, 48, Outcome::UnderClaim, "in_flight", Cause::UnderClaim);
}
