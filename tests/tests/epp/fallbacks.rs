//! The pick's fallback list, the subset as the route query's eligible set, and the
//! booking moved to the pod the proxy reports it served.

use super::*;

/// The router's booked requests on worker `n` (rank 0).
fn booked_on(stack: &EppStack, n: u64) -> usize {
    let rank = WorkerRank::new(WorkerId(n), DpRank(0));
    stack
        .daemon
        .state()
        .scheduler()
        .rank_load(rank)
        .active_requests
}

#[tokio::test]
async fn fallbacks_name_the_next_cheapest_pods_after_the_pick() {
    let (mut stack, body) = three_workers_the_second_holding_the_prefix().await;
    // Worker 3 holds half of the prefix: the cheapest alternate; worker 1 nothing.
    let prefix = long_prefix();
    stack.hold(3, &prefix[..prefix.len() / 2]).await;
    let (envoy, picked) = stack.open(&body, None).await;
    assert_eq!(endpoints(&picked), [pod(2), pod(3), pod(1)]);
    assert_eq!(stack.booked(), 1, "only the primary is booked");
    assert_eq!(booked_on(&stack, 2), 1);
    drop(envoy);
    stack.no_booking_left().await;
    stack.stop().await;
    // `--fallbacks 0` names one endpoint.
    let single = EppStack::start(2, |_| {}, &["--fallbacks", "0"]).await;
    let (_envoy, picked) = single.open(&completion(&long_prefix()), None).await;
    assert_eq!(endpoints(&picked).len(), 1, "{picked:?}");
    single.stop().await;
}

/// A subset leaving out more workers than a route query may exclude (64) is the
/// query's eligible set: the pick and its fallbacks stay inside it, even when a pod
/// outside holds the prompt.
#[tokio::test]
async fn a_subset_leaving_out_many_pods_is_honoured() {
    let mut stack = EppStack::start(100, |_| {}, &[]).await;
    let prefix = long_prefix();
    stack.hold(90, &prefix).await;
    let body = completion(&integration_tests::continued(&prefix));
    let (outside, picked) = stack.open(&body, None).await;
    assert_eq!(
        endpoint(&picked),
        pod(90),
        "without a subset the holder wins"
    );
    let subset: Vec<String> = (1..=30).map(pod).collect();
    let (envoy, picked) = stack.open(&body, Some(&subset)).await;
    let named = endpoints(&picked);
    assert_eq!(named.len(), 3, "{named:?}");
    for endpoint in &named {
        assert!(
            subset.iter().any(|p| p == endpoint),
            "{endpoint} is in the subset"
        );
    }
    drop(envoy);
    drop(outside);
    stack.no_booking_left().await;
    stack.stop().await;
}

/// The proxy retried down the list and reports (in the `envoy.lb` metadata, as the
/// protocol describes) that another pod served: the booking moves there while the
/// response streams, and is freed there at the end.
#[tokio::test]
async fn the_booking_moves_to_the_pod_the_proxy_served() {
    let (stack, body) = three_workers_the_second_holding_the_prefix().await;
    let (mut envoy, picked) = stack.open(&body, None).await;
    assert_eq!(endpoint(&picked), pod(2));
    // Worker 3's pod answered (whether the proxy took it from the list or not).
    let moved_to = 3;
    envoy.response_headers_served(&pod(moved_to), true).await;
    envoy.response_chunk(b"data: {}\n\n", false).await;
    eventually("the booking to move to the served worker", WAIT, || async {
        (booked_on(&stack, moved_to) == 1 && booked_on(&stack, 2) == 0).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(stack.booked(), 1, "moved, not copied");
    assert_eq!(stack.epp.metrics().rebooks("moved"), 1);
    let text = stack.metrics().await;
    assert!(
        text.contains("kv_epp_served_total{served=\"mismatch\"} 1"),
        "{text}"
    );
    envoy.response_chunk(b"data: [DONE]\n\n", true).await;
    stack.no_booking_left().await;
    stack.stop().await;
}
