//! Recorded engine ZMQ streams in `kv-events/tests/fixtures/engines/` (see its README):
//! a `*_frames.bin` file is every frame of the stream in order, each as a 4-byte
//! big-endian length then its bytes; a message is three frames (topic, engine seq,
//! msgpack payload).

use kv_events::engines::{EngineBatch, decode_batch};

/// The bytes of fixture `name`.
///
/// # Panics
/// When the file cannot be read: a missing fixture must fail the test loudly.
pub fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../kv-events/tests/fixtures/engines/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The messages of frames fixture `name`, in recorded order: (engine seq, decoded
/// batch).
///
/// # Panics
/// On a truncated frame, a message that is not (`kv-events`, seq, payload), or a
/// payload that does not decode: a broken fixture must fail the test loudly.
pub fn messages(name: &str) -> Vec<(u64, EngineBatch)> {
    let bytes = fixture(name);
    let mut frames = Vec::new();
    let mut rest = bytes.as_slice();
    while !rest.is_empty() {
        let (len, tail) = rest.split_at_checked(4).expect("a 4-byte frame length");
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let (frame, tail) = tail.split_at_checked(len).expect("a whole frame");
        frames.push(frame);
        rest = tail;
    }
    frames
        .chunks(3)
        .map(|message| {
            let [topic, seq, payload] = message else {
                panic!("three frames per message")
            };
            assert_eq!(*topic, b"kv-events");
            let seq: [u8; 8] = (*seq).try_into().expect("an 8-byte seq frame");
            let batch = decode_batch(payload).expect("a payload that decodes");
            (u64::from_be_bytes(seq), batch)
        })
        .collect()
}
