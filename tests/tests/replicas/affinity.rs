//! Replica affinity: once a replica has answered a gateway, the gateway's next
//! queries go to one replica alone (its own subject, named by the reply's
//! `Kv-Router-Id` header; by default the lowest replica it has heard from) until the
//! window passes; a replica that is gone is let go without failing a query. Queries are sent one by one (no grouping), so each is its
//! own NATS message and only the pin keeps them on one replica.

use super::{REQUESTS, WAIT, own_bookings, request_prompt, setup};
use integration_tests::router_client::{self, ALONE, router_client_with};
use kv_events::routing::Prompt;
use kv_gateway::router::{PinTarget, ReplicaAffinity, RouterClient, RouterSettings};
use std::time::Duration;

/// Settings with affinity for `window` (`None`: off) pinning to `target`; a replica
/// is never let go for being slow here (`gateway_route_affinity.rs` tests that).
fn settings(window: Option<Duration>, target: PinTarget) -> RouterSettings {
    let affinity = window.map(|window| ReplicaAffinity {
        window,
        patience: WAIT,
        target,
    });
    router_client::settings(WAIT, ALONE, 16, affinity)
}

/// Routes requests `from..to` one after the other, `pause` apart; keeps their
/// bookings so the replicas keep them.
async fn route_one_by_one(
    client: &RouterClient,
    from: usize,
    to: usize,
    pause: Duration,
) -> anyhow::Result<Vec<kv_gateway::router::Booking>> {
    let mut bookings = Vec::new();
    for i in from..to {
        let prompt = Prompt::Tokens {
            token_ids: request_prompt(i),
        };
        let id = format!("r{i}").as_str().into();
        let (_, booking) = (client.route(id, prompt, &[], None, false).await)
            .map_err(|e| anyhow::anyhow!("r{i}: {e:?}"))?;
        bookings.push(booking);
        tokio::time::sleep(pause).await;
    }
    Ok(bookings)
}

#[tokio::test]
async fn a_gateway_stays_with_the_replica_that_answered_until_it_goes() -> anyhow::Result<()> {
    let (cluster, mut pair) = setup(2, true).await?;
    let (client, metrics) = router_client_with(
        &cluster.nats,
        &cluster.subjects,
        settings(Some(Duration::from_secs(60)), PinTarget::Lowest),
    );
    let events = |event: &str| metrics.affinity.with_label_values(&[event]).get();
    let bookings = route_one_by_one(&client, 0, REQUESTS, Duration::ZERO).await?;
    let own: Vec<usize> = pair.iter().map(own_bookings).collect();
    // The first queries may go to the higher replica (the first through the queue
    // group, the next pinned there) until the gateway's start-up roll call is
    // answered; from then on every query goes to the lower one, which holds the pin:
    // pinned once (the first query's answer came after the roll call's), or twice
    // with the move, never back.
    let moved = events("pinned");
    assert!(
        own.iter().sum::<usize>() == REQUESTS
            && own[0] > 0
            && (moved == 1 && own[1] <= 1 || moved == 2),
        "the lower replica booked every query once heard of: {own:?}, pinned {moved}"
    );

    // The pinned replica goes: the next queries are answered by the other one, none
    // fails.
    pair.remove(0).shutdown().await?;
    let before = own_bookings(&pair[0]);
    let after = route_one_by_one(&client, REQUESTS, 2 * REQUESTS, Duration::ZERO).await?;
    assert_eq!(
        own_bookings(&pair[0]) - before,
        REQUESTS,
        "the remaining replica booked every query after the other went"
    );
    // Pinned once more, to the remaining replica; let go once, because the first was
    // gone.
    let counted = ["pinned", "gone", "overloaded", "timed_out", "failed"].map(events);
    assert_eq!(
        counted,
        [moved + 1, 1, 0, 0, 0],
        "pinned, gone, overloaded, timed_out, failed"
    );
    drop((bookings, after));
    pair.remove(0).shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn without_a_pin_or_once_it_expires_the_queue_group_picks() -> anyhow::Result<()> {
    let (cluster, pair) = setup(2, true).await?;
    // Without affinity each query is the queue group's pick; with a 1 ms window
    // paused past after each query and the pin going to the replica that answered,
    // each query pins afresh. Either way both replicas book some (all on one:
    // probability 2 × 2^-24 per run).
    let mut kept = Vec::new();
    for (affinity, from) in [(None, 0), (Some(Duration::from_millis(1)), REQUESTS)] {
        let (client, metrics) = router_client_with(
            &cluster.nats,
            &cluster.subjects,
            settings(affinity, PinTarget::Answered),
        );
        let before: Vec<usize> = pair.iter().map(own_bookings).collect();
        let bookings =
            route_one_by_one(&client, from, from + REQUESTS, Duration::from_millis(5)).await?;
        let booked: Vec<usize> = (pair.iter().map(own_bookings))
            .zip(&before)
            .map(|(now, before)| now - before)
            .collect();
        assert!(
            booked.iter().all(|&n| n > 0),
            "both replicas booked some with affinity {affinity:?}: {booked:?}"
        );
        // Every query pinned afresh with the short window (an expired pin is not let
        // go, it lapses); nothing pinned without affinity.
        let pinned = metrics.affinity.with_label_values(&["pinned"]).get();
        let expected = if affinity.is_some() { REQUESTS } else { 0 };
        assert_eq!(pinned, expected as u64, "pins with affinity {affinity:?}");
        kept.extend(bookings);
    }
    drop(kept);
    for daemon in pair {
        daemon.shutdown().await?;
    }
    Ok(())
}

/// A roll call is answered by every replica, each naming itself in the reply and in
/// its `Kv-Router-Id` header; a replica that has shut down answers no more.
#[tokio::test]
async fn every_replica_answers_a_roll_call_naming_itself() -> anyhow::Result<()> {
    use futures::StreamExt as _;
    use kv_events::replicas::RollCallReply;
    use kv_events::{ROUTER_ID_HEADER, RouterId, decode};
    let (cluster, mut replicas) = setup(3, true).await?;
    let call = |nats: async_nats::Client, subject: String| async move {
        let inbox = nats.new_inbox();
        let mut replies = nats.subscribe(inbox.clone()).await?;
        nats.publish_with_reply(subject, inbox, "anything".into())
            .await?;
        let mut heard = Vec::new();
        // Every live replica answers at once; the wait only ends the collection.
        while let Ok(Some(reply)) =
            tokio::time::timeout(Duration::from_secs(2), replies.next()).await
        {
            let body: RollCallReply = decode(&reply.payload)?;
            let header = (reply.headers.as_ref())
                .and_then(|h| h.get(ROUTER_ID_HEADER))
                .and_then(|v| RouterId::parse_hex(v.as_str()));
            assert_eq!(header, Some(body.router_id), "the header names the replica");
            heard.push(body.router_id.0);
        }
        heard.sort_unstable();
        anyhow::Ok(heard)
    };
    let subject = cluster.subjects.router_roll_call();
    assert_eq!(
        call(cluster.nats.clone(), subject.clone()).await?,
        [100, 101, 102]
    );
    if let Some(last) = replicas.pop() {
        last.shutdown().await?;
    }
    assert_eq!(call(cluster.nats.clone(), subject).await?, [100, 101]);
    for daemon in replicas {
        daemon.shutdown().await?;
    }
    Ok(())
}
