//! `BUFFERED`: Envoy answers nothing of the body before the headers' answer, but
//! holds the headers until the buffered body is answered too, so the pick rides on
//! the body's answer.

use super::*;

/// Both requests continuing the held prefix land on its pod, though the headers were
/// answered before any of the body was seen; the body passes unchanged, the response
/// passes with an empty answer, and every booking is freed. An oversized body is 413
/// on the body's answer.
#[tokio::test]
async fn buffered_mode_picks_on_the_body_answer() {
    let (stack, body) = three_workers_the_second_holding_the_prefix().await;
    for _ in 0..2 {
        let mut envoy = stack.open_on_the_prefix_pod(Mode::Buffered, &body, 1).await;
        envoy.response_headers(&pod(2)).await;
        envoy
            .response_chunk(b"data: {}\n\ndata: [DONE]\n\n", true)
            .await;
        stack.no_booking_left().await;
    }
    stack.stop().await;

    let stack = EppStack::start(1, |_| {}, &["--max-body-bytes", "1024"]).await;
    let big = completion(&(0..400).collect::<Vec<u32>>());
    let (_big, picked) = stack.open_in(Mode::Buffered, &big, 1, None).await;
    assert!(
        matches!(picked, Picked::Refused { status: 413, .. }),
        "{picked:?}"
    );
    assert_eq!(stack.booked(), 0);
    stack.stop().await;
}
