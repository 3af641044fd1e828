//! Session affinity across replicas: a booking's sync message carries its session, so
//! every replica records the chosen rank as the session's last rank, and a session's
//! turns stay on one worker whichever replica the queue group hands them to.

use super::{WAIT, setup};
use integration_tests::eventually;
use kv_events::routing::{LifecycleEvent, Prompt, RouteReply, RouteRequest, SessionId};
use router_daemon::Daemon;
use scheduler::SessionOutcome;

/// Turns `daemon` routed itself: its session decisions of every outcome.
fn routed_by(daemon: &Daemon) -> u64 {
    let sessions = &daemon.state().counters.metrics.sessions;
    [
        SessionOutcome::Miss,
        SessionOutcome::Hit,
        SessionOutcome::Override,
    ]
    .into_iter()
    .map(|o| sessions.decisions(o))
    .sum()
}

/// Session decisions of `outcome` summed over the replicas.
fn decisions(daemons: &[Daemon], outcome: SessionOutcome) -> u64 {
    daemons
        .iter()
        .map(|d| d.state().counters.metrics.sessions.decisions(outcome))
        .sum()
}

#[tokio::test]
async fn a_sessions_turns_stay_on_one_worker_across_replicas() -> anyhow::Result<()> {
    let (cluster, daemons) = setup(2, true).await?;
    let session = SessionId::new("agent-run-5")?;
    let mut worker = None;
    let mut turns = 0;
    // Until the queue group has handed each replica at least two turns (it picks a
    // member at random), and at least 6 turns.
    while turns < 6 || daemons.iter().any(|d| routed_by(d) < 2) {
        anyhow::ensure!(turns < 64, "the queue group never reached both replicas");
        // Unrelated prompts (nothing cached for them), freed before the next turn:
        // every worker costs the same, and without the session a replica that has
        // not seen it breaks the tie at random among 4.
        let id = format!("turn-{turns}");
        let token_ids = (0..16).map(|t| 900_000 + turns * 100 + t).collect();
        let mut request = RouteRequest::new(id.as_str(), Prompt::Tokens { token_ids });
        request.session_id = Some(session.clone());
        let RouteReply::Routed(decision) = cluster.route(&request).await? else {
            anyhow::bail!("turn {turns} was not routed");
        };
        let first = *worker.get_or_insert(decision.worker_id);
        anyhow::ensure!(
            decision.worker_id == first,
            "turn {turns} left the session's worker {first} for {}",
            decision.worker_id
        );
        // Both replicas applied the booking (and with it the session) ...
        for daemon in &daemons {
            eventually("the booking to reach every replica", WAIT, || async {
                (daemon.state().scheduler().active_requests() == 1).then_some(())
            })
            .await?;
        }
        // ... and its free, so the next turn sees level costs.
        cluster.lifecycle(&id, LifecycleEvent::Freed).await?;
        for daemon in &daemons {
            eventually("the turn to be freed everywhere", WAIT, || async {
                (daemon.state().scheduler().active_requests() == 0).then_some(())
            })
            .await?;
        }
        turns += 1;
    }
    // Only the very first turn was new; each replica's first turn already knew it.
    assert_eq!(decisions(&daemons, SessionOutcome::Miss), 1);
    assert_eq!(
        decisions(&daemons, SessionOutcome::Hit),
        u64::from(turns) - 1
    );
    for daemon in daemons {
        assert_eq!(daemon.state().scheduler().sessions_held(), 1);
        daemon.shutdown().await?;
    }
    Ok(())
}
