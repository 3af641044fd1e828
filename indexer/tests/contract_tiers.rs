//! The storage-tier contract, run over every implementation (see `contract.rs`): a
//! rank's blocks on CPU or disk are held by the index but are not GPU overlap; the
//! query answers them separately as the any-tier overlap (`OverlapScores::any_tier`,
//! filled only where it exceeds the GPU overlap).

mod common;
mod subject;

use common::{batch, chain, cleared, on_tier, removed, stored, wr};
use kv_events::StorageTier::{Cpu, Disk};
use subject::Subject;

#[tokio::test]
async fn a_lower_tier_chain_below_gpu_parents_is_any_tier_overlap_only() {
    for mut s in Subject::all() {
        let name = s.name;
        // Worker 1 holds blocks 0, 1 on the GPU and block 2 on CPU below them (the
        // parent is held on the GPU only); block 3 on disk below the CPU block.
        s.apply(batch(
            1,
            vec![
                stored(0, None, &chain(100, 2)),
                on_tier(stored(0, Some(101), &[(102, 2)]), Cpu),
                on_tier(stored(0, Some(102), &[(103, 3)]), Disk),
            ],
        ))
        .await;
        s.apply(batch(2, vec![stored(0, None, &chain(200, 1))]))
            .await;
        let query = [0, 1, 2, 3, 4];
        assert_eq!(
            s.find(&query).await,
            vec![(wr(1, 0), 2), (wr(2, 0), 1)],
            "{name}: GPU overlap ignores lower tiers"
        );
        assert_eq!(
            s.find_any_tier(&query).await,
            vec![(wr(1, 0), 4)],
            "{name}: any-tier overlap, only where it exceeds the GPU's"
        );
        // Three holders (GPU, CPU, disk) for worker 1, one for worker 2.
        assert_eq!(s.entries_and_ranks().await, (5, 4), "{name}");
        let report = s.report().await;
        assert_eq!(
            report.blocks_per_rank,
            vec![(wr(1, 0), 2), (wr(2, 0), 1)],
            "{name}: blocks per rank count the GPU"
        );
    }
}

#[tokio::test]
async fn an_offloaded_chain_evicted_from_the_gpu_still_scores_on_any_tier() {
    for mut s in Subject::all() {
        let name = s.name;
        // vLLM's offloading: the GPU chain is copied to CPU (same engine hashes), then
        // its tail is evicted from the GPU.
        s.apply(batch(
            3,
            vec![
                stored(1, None, &chain(300, 4)),
                on_tier(stored(1, None, &chain(300, 4)), Cpu),
                removed(1, &[302, 303]),
            ],
        ))
        .await;
        assert_eq!(s.find(&[0, 1, 2, 3]).await, vec![(wr(3, 1), 2)], "{name}");
        assert_eq!(
            s.find_any_tier(&[0, 1, 2, 3]).await,
            vec![(wr(3, 1), 4)],
            "{name}"
        );
        // Evicted from CPU too: block 3 is gone from every tier.
        s.apply(batch(3, vec![on_tier(removed(1, &[303]), Cpu)]))
            .await;
        assert_eq!(
            s.find_any_tier(&[0, 1, 2, 3]).await,
            vec![(wr(3, 1), 3)],
            "{name}"
        );
        // A lower-tier store whose parent no tier holds is refused as on the GPU.
        s.apply(batch(
            3,
            vec![on_tier(stored(1, Some(999), &[(998, 9)]), Cpu)],
        ))
        .await;
        assert_eq!(s.find_any_tier(&[9]).await, vec![], "{name}");
    }
}

#[tokio::test]
async fn cleared_and_remove_worker_release_every_tier() {
    for mut s in Subject::all() {
        let name = s.name;
        for worker in [4, 5] {
            s.apply(batch(
                worker,
                vec![
                    stored(0, None, &chain(400, 1)),
                    on_tier(stored(0, Some(400), &[(401, 1)]), Cpu),
                ],
            ))
            .await;
        }
        assert_eq!(
            s.find_any_tier(&[0, 1]).await,
            vec![(wr(4, 0), 2), (wr(5, 0), 2)],
            "{name}"
        );
        s.apply(batch(4, vec![cleared(0)])).await;
        s.remove_worker(5).await;
        assert!(s.find(&[0, 1]).await.is_empty(), "{name}");
        assert!(s.find_any_tier(&[0, 1]).await.is_empty(), "{name}");
        assert_eq!(s.entries_and_ranks().await, (0, 0), "{name}");
    }
}

#[tokio::test]
async fn a_dump_carries_each_chains_tier() {
    let queries: [&[u64]; 4] = [&[0, 1, 2, 3], &[0, 1], &[0, 5], &[7]];
    for mut s in Subject::all() {
        let name = s.name;
        s.apply(batch(
            6,
            vec![
                stored(0, None, &chain(600, 2)),
                on_tier(stored(0, Some(601), &[(602, 2), (603, 3)]), Cpu),
                on_tier(stored(0, Some(600), &[(605, 5)]), Disk),
                on_tier(stored(1, None, &[(607, 7)]), Cpu),
            ],
        ))
        .await;
        let dump = s.dump().await;
        let mut copy = s.empty_like();
        for batch in dump.clone() {
            copy.apply(batch).await;
        }
        for query in queries {
            assert_eq!(copy.find(query).await, s.find(query).await, "{name}");
            assert_eq!(
                copy.find_any_tier(query).await,
                s.find_any_tier(query).await,
                "{name}: {query:?}"
            );
        }
        assert_eq!(
            s.find_any_tier(&[0, 1, 2, 3]).await,
            vec![(wr(6, 0), 4)],
            "{name}"
        );
        assert_eq!(s.find_any_tier(&[7]).await, vec![(wr(6, 1), 1)], "{name}");
        assert_eq!(copy.entries_and_ranks().await, (6, 4), "{name}");
        assert_eq!(copy.dump().await, dump, "{name}: same events again");
    }
}
