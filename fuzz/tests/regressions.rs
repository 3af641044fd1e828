//! Inputs the fuzz harness once failed on, kept as tests (each reproduced its finding
//! before the fix). New ones come from the `test_snippet` the long run prints.

#[global_allocator]
static ALLOC: peak_alloc::PeakAlloc = peak_alloc::PeakAlloc;

use kv_fuzz::targets::Verdict;

/// A `KvEventBatch` whose `stored` event nests `levels` arrays, each announcing
/// `u32::MAX` elements with only the next array behind it.
fn lying_nested_arrays(levels: usize) -> Vec<u8> {
    let mut bytes = vec![0x83];
    bytes.extend(b"\xa9worker_id\x07\xa5epoch\x01\xa6events\x91");
    bytes.extend(b"\x83\xa8event_id\x00\xa7dp_rank\x00\xa4data\x82\xa4type\xa6stored\xa6blocks");
    for _ in 0..levels {
        bytes.extend([0xdd, 0xff, 0xff, 0xff, 0xff]);
    }
    bytes
}

#[test]
fn lying_lengths_inside_a_tagged_event_are_refused_before_allocating() {
    let _serial = kv_fuzz::meter::one_test_at_a_time();
    // Before the codec checked lengths, serde pre-allocated 1 MiB per announced
    // array while buffering the tagged `data` map: 30 MiB for these 222 bytes.
    let input = lying_nested_arrays(30);
    assert!(matches!(
        kv_fuzz::assert_handles("events", &input),
        Verdict::Refused(_)
    ));
}

/// Runs `f` on a thread with a tokio worker's stack, as the daemon would.
fn on_worker_stack<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    std::thread::Builder::new()
        .stack_size(kv_fuzz::runner::WORKER_STACK_BYTES)
        .spawn(f)
        .expect("spawn a thread")
        .join()
        .expect("no panic")
}

#[test]
fn deep_nesting_is_refused_on_a_worker_sized_stack() {
    let _serial = kv_fuzz::meter::one_test_at_a_time();
    // Before the codec capped nesting at 32 levels, rmp-serde recursed up to 1,024
    // levels (skipping an unknown key's value) and overflowed a 2 MiB stack in a
    // debug build: the process aborted.
    let mut input = vec![0x84];
    input.extend(b"\xa9worker_id\x07\xa5epoch\x01\xa6events\x90\xa6future");
    input.extend(std::iter::repeat_n(0x91, 100_000));
    input.push(0x00);
    let verdict = on_worker_stack(move || kv_fuzz::assert_handles("events", &input));
    assert!(matches!(verdict, Verdict::Refused(e) if e.contains("nesting")));
}

#[test]
fn engine_token_ids_announcing_4g_elements_are_refused_before_allocating() {
    let _serial = kv_fuzz::meter::one_test_at_a_time();
    // A vLLM BlockStored (tagged map) whose token_ids announce u32::MAX elements and
    // hold 2: the engine decoder reserved 1 MiB for them (serde's cap) from 80 bytes.
    let mut input = vec![
        0x93, 0xcb, 0x41, 0xd9, 0x54, 0xfc, 0x40, 0x20, 0, 0, 0x91, 0x85,
    ];
    input.extend(b"\xa4type\xabBlockStored\xacblock_hashes\x91\x01");
    input.extend(b"\xb1parent_block_hash\xc0\xa9token_ids\xdd\xff\xff\xff\xff\x01\x02");
    input.extend(b"\xaablock_size\x10");
    input.push(0xc0);
    let verdict = kv_fuzz::assert_handles("engine_batch", &input);
    assert!(matches!(verdict, Verdict::Refused(e) if e.contains("announces")));
}

#[test]
fn a_registration_with_four_billion_ranks_is_refused() {
    let _serial = kv_fuzz::meter::one_test_at_a_time();
    // Applied, this etcd value made `Scheduler::add_worker` build every rank (≈ 48
    // bytes each, ~200 GiB); the directory now refuses `dp_size` over its limit.
    let input = br#"{"worker_id":7,"dp_size":4294967295,"block_size":16,"total_kv_blocks":1}"#;
    let verdict = kv_fuzz::assert_handles("registration", input);
    assert!(
        matches!(&verdict, Verdict::Refused(e) if e.contains("dp_size")),
        "{verdict:?}"
    );
}

#[test]
fn small_engine_events_do_not_decode_into_large_ones() {
    let _serial = kv_fuzz::meter::one_test_at_a_time();
    // 10,001 three-byte events of an unknown type (`["\0"]`, 30 KB): each decoded
    // into a ~200-byte `EngineEvent` (its `BlockStored` variant held inline), 3.1 MB
    // at peak, 104 bytes per input byte. `BlockStored` is boxed now: 21.
    let mut input = vec![
        0x93, 0xcb, 0x41, 0xd9, 0x54, 0xfc, 0x41, 0, 0, 0, 0xdc, 0x27, 0x11,
    ];
    for _ in 0..10_001 {
        input.extend([0x91, 0xa1, 0x00]);
    }
    input.push(0xc0);
    let target = kv_fuzz::targets::by_name("engine_batch").expect("the target exists");
    let meter = kv_fuzz::meter::Meter::new().expect("the counting allocator is installed");
    let handled = kv_fuzz::runner::check(target, &meter, kv_fuzz::Bound::DEFAULT, &input)
        .expect("within the bound");
    assert_eq!(handled.verdict, Verdict::Accepted);
    let per_byte = handled.peak / input.len();
    assert!(per_byte < 50, "{per_byte} heap bytes per payload byte");
}

#[test]
fn a_chat_body_is_not_copied_to_read_its_messages() {
    let _serial = kv_fuzz::meter::one_test_at_a_time();
    // `parse_chat` deserialized the messages from a copy of the list: the body's
    // JSON tree, that copy and the messages' own fields were alive at once, 120 heap
    // bytes per body byte here; 98 without the copy.
    let extra: Vec<String> = (0..20_000).map(|i| format!("{{\"a\":{i}}}")).collect();
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"hi","x":[{}]}}]}}"#,
        extra.join(",")
    );
    let target = kv_fuzz::targets::by_name("gateway_chat").expect("the target exists");
    let meter = kv_fuzz::meter::Meter::new().expect("the counting allocator is installed");
    let handled = kv_fuzz::runner::check(target, &meter, kv_fuzz::Bound::DEFAULT, body.as_bytes())
        .expect("within the bound");
    assert_eq!(handled.verdict, Verdict::Accepted);
    let per_byte = handled.peak / body.len();
    assert!(per_byte < 110, "{per_byte} heap bytes per body byte");
}
