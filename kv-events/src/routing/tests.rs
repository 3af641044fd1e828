//! Round trips and refusals of the routing messages.

use super::*;
use crate::codec::{decode, encode};

#[test]
fn route_messages_round_trip() {
    let req = RouteRequest {
        policy: Some(PolicyKind::KvNormalized),
        dp_rank: Some(DpRank(3)),
        overrides: CostOverrides {
            temperature: Some(0.5),
            ..CostOverrides::default()
        },
        priority: -2,
        exclude_workers: vec![WorkerId(4), WorkerId(9)],
        eligible_workers: vec![WorkerId(2), WorkerId(4)],
        fallbacks: 2,
        ..RouteRequest::new(
            "r1",
            Prompt::Blocks {
                block_hashes: vec![LocalBlockHash(1)],
                num_tokens: 700,
            },
        )
    };
    assert_eq!(decode::<RouteRequest>(&encode(&req).unwrap()).unwrap(), req);

    let ok = RouteReply::Routed(RouteDecision {
        request_id: "r1".into(),
        worker_id: WorkerId(2),
        dp_rank: DpRank(0),
        overlap_blocks: 1,
        request_blocks: 2,
        in_flight_blocks: 1,
        kv_position: Some(Box::new(EventPosition {
            epoch: 3,
            event_id: 41,
        })),
        policy: PolicyKind::Kv,
        disaggregation: None,
        fallbacks: vec![RouteFallback {
            worker_id: WorkerId(4),
            dp_rank: DpRank(1),
            overlap_blocks: 0,
        }],
    });
    assert_eq!(decode::<RouteReply>(&encode(&ok).unwrap()).unwrap(), ok);
    // The new fields are absent when empty, so older peers see the old shape.
    let plain = encode(&RouteRequest::new(
        "r2",
        Prompt::Tokens { token_ids: vec![1] },
    ))
    .unwrap();
    let names = |key: &[u8]| plain.windows(key.len()).any(|w| w == key);
    assert!(!names(b"eligible_workers") && !names(b"fallbacks"));

    for code in [
        RouteErrorCode::NoWorkers,
        RouteErrorCode::RankUnavailable,
        RouteErrorCode::Overloaded,
    ] {
        let err = RouteReply::Error(RouteError {
            code,
            message: "no workers registered".into(),
        });
        assert_eq!(decode::<RouteReply>(&encode(&err).unwrap()).unwrap(), err);
    }

    for event in [
        LifecycleEvent::PrefillDone,
        LifecycleEvent::KeepAlive,
        LifecycleEvent::Freed,
    ] {
        let life = LifecycleMessage {
            request_id: "r1".into(),
            event,
        };
        assert_eq!(
            decode::<LifecycleMessage>(&encode(&life).unwrap()).unwrap(),
            life
        );
    }
}

#[test]
fn wire_names_are_stable() {
    let code: String = decode(&encode(&RouteErrorCode::RankUnavailable).unwrap()).unwrap();
    assert_eq!(code, "rank_unavailable");
    let event: String = decode(&encode(&LifecycleEvent::KeepAlive).unwrap()).unwrap();
    assert_eq!(event, "keep_alive");
}

#[test]
fn policy_names_parse_and_print() {
    for p in PolicyKind::ALL {
        assert_eq!(p.as_str().parse::<PolicyKind>().unwrap(), p);
        let wire: String = decode(&encode(&p).unwrap()).unwrap();
        assert_eq!(wire, p.as_str());
    }
    let err = "fastest".parse::<PolicyKind>().unwrap_err();
    assert!(err.contains("cache-aware-threshold"), "{err}");
}

#[test]
fn request_without_new_fields_decodes_with_defaults() {
    #[derive(Serialize)]
    struct Minimal {
        request_id: &'static str,
        prompt: Prompt,
    }
    let bytes = encode(&Minimal {
        request_id: "x",
        prompt: Prompt::Tokens {
            token_ids: vec![1, 2],
        },
    })
    .unwrap();
    let req: RouteRequest = decode(&bytes).unwrap();
    assert_eq!(
        req,
        RouteRequest::new(
            "x",
            Prompt::Tokens {
                token_ids: vec![1, 2]
            }
        )
    );
    // Without exclusions the key is not sent: older routers see the message they
    // know.
    let map: std::collections::BTreeMap<String, serde::de::IgnoredAny> =
        rmp_serde::from_slice(&encode(&req).unwrap()).unwrap();
    assert!(!map.contains_key("exclude_workers"), "{:?}", map.keys());
    assert!(!map.contains_key("session_id"), "{:?}", map.keys());
}

#[test]
fn a_session_id_round_trips_and_an_oversized_one_is_refused_as_malformed() {
    let with = |id: &str| {
        let mut req = RouteRequest::new("s", Prompt::Tokens { token_ids: vec![1] });
        req.session_id = Some(SessionId::new(id).expect("valid id"));
        req
    };
    let req = with("conversation-1");
    assert_eq!(decode::<RouteRequest>(&encode(&req).unwrap()).unwrap(), req);
    // In a batch entry too.
    let batch = RouteBatchRequest {
        requests: vec![req.clone()],
        order: BatchOrder::AsGiven,
    };
    assert_eq!(
        decode::<RouteBatchRequest>(&encode(&batch).unwrap()).unwrap(),
        batch
    );
    // A peer that writes a longer id than the limit: refused by name, before the
    // copy, through the same path (and metric reason) as any malformed request.
    #[derive(Serialize)]
    struct Raw<'a> {
        request_id: &'a str,
        prompt: Prompt,
        session_id: &'a str,
    }
    let long = "s".repeat(MAX_SESSION_ID_BYTES + 1);
    let bytes = encode(&Raw {
        request_id: "s",
        prompt: Prompt::Tokens { token_ids: vec![1] },
        session_id: &long,
    })
    .unwrap();
    let refusal =
        crate::limits::decode_within::<RouteRequest>(&bytes, &crate::limits::Limits::default())
            .expect_err("over the session id limit");
    assert_eq!(refusal.reason(), "malformed");
    assert!(
        refusal.to_string().contains("session_id is 257 bytes"),
        "{refusal}"
    );
}

#[test]
fn overrides_are_partial_and_omitted_when_empty() {
    #[derive(Serialize)]
    struct Partial {
        request_id: &'static str,
        prompt: Prompt,
        overrides: std::collections::BTreeMap<&'static str, f64>,
    }
    let bytes = encode(&Partial {
        request_id: "x",
        prompt: Prompt::Tokens { token_ids: vec![1] },
        overrides: [("overlap_credit", 0.5)].into_iter().collect(),
    })
    .unwrap();
    let req: RouteRequest = decode(&bytes).unwrap();
    assert_eq!(req.overrides.overlap_credit, Some(0.5));
    assert_eq!(req.overrides.temperature, None);

    // An empty override set is not written at all.
    let plain = RouteRequest::new("y", Prompt::Tokens { token_ids: vec![1] });
    let map: std::collections::BTreeMap<String, serde::de::IgnoredAny> =
        decode(&encode(&plain).unwrap()).unwrap();
    assert!(!map.contains_key("overrides"));
}

#[test]
fn batch_messages_round_trip_and_default_to_group_by_prefix() {
    let batch = RouteBatchRequest {
        requests: vec![
            RouteRequest::new("a", Prompt::Tokens { token_ids: vec![1] }),
            RouteRequest::new("b", Prompt::Tokens { token_ids: vec![2] }),
        ],
        order: BatchOrder::AsGiven,
    };
    let back: RouteBatchRequest = decode(&encode(&batch).unwrap()).unwrap();
    assert_eq!(back, batch);
    let order: String = decode(&encode(&BatchOrder::GroupByPrefix).unwrap()).unwrap();
    assert_eq!(order, "group-by-prefix");

    #[derive(Serialize)]
    struct NoOrder {
        requests: Vec<RouteRequest>,
    }
    let bytes = encode(&NoOrder {
        requests: batch.requests.clone(),
    })
    .unwrap();
    let back: RouteBatchRequest = decode(&bytes).unwrap();
    assert_eq!(back.order, BatchOrder::GroupByPrefix);

    let answered = RouteBatchReply::Answered {
        replies: vec![RouteReply::Error(RouteError {
            code: RouteErrorCode::Overloaded,
            message: "busy".into(),
        })],
    };
    assert_eq!(
        decode::<RouteBatchReply>(&encode(&answered).unwrap()).unwrap(),
        answered
    );
    let refused = RouteBatchReply::Error(RouteError {
        code: RouteErrorCode::BadRequest,
        message: "empty batch".into(),
    });
    let map: std::collections::BTreeMap<String, serde::de::IgnoredAny> =
        decode(&encode(&refused).unwrap()).unwrap();
    assert!(map.contains_key("status") && map.contains_key("code"));
    assert_eq!(
        decode::<RouteBatchReply>(&encode(&refused).unwrap()).unwrap(),
        refused
    );
}

/// The removals query and its replies round-trip; a decision without a position
/// does not name the field (older frontends see the old shape), and a position is
/// ordered by epoch before event id.
#[test]
fn removals_messages_round_trip() {
    let query = RemovalsQuery {
        worker_id: WorkerId(7),
        dp_rank: DpRank(1),
        after: EventPosition {
            epoch: 2,
            event_id: 9,
        },
        block_hashes: vec![LocalBlockHash(u64::MAX), LocalBlockHash(3)],
    };
    assert_eq!(
        decode::<RemovalsQuery>(&encode(&query).unwrap()).unwrap(),
        query
    );
    let answer = RemovalsReply::Answered(RemovalsAnswer {
        removed: vec![0],
        complete: true,
        cleared: false,
    });
    let bytes = encode(&answer).unwrap();
    assert!(!bytes.windows(7).any(|w| w == b"cleared"));
    assert_eq!(decode::<RemovalsReply>(&bytes).unwrap(), answer);
    let refused = RemovalsReply::Error(RouteError {
        code: RouteErrorCode::BadRequest,
        message: "too many".into(),
    });
    assert_eq!(
        decode::<RemovalsReply>(&encode(&refused).unwrap()).unwrap(),
        refused
    );

    let decision = RouteDecision {
        request_id: "r1".into(),
        worker_id: WorkerId(2),
        dp_rank: DpRank(0),
        overlap_blocks: 1,
        request_blocks: 2,
        in_flight_blocks: 0,
        kv_position: None,
        policy: PolicyKind::Kv,
        disaggregation: None,
        fallbacks: Vec::new(),
    };
    let bytes = encode(&RouteReply::Routed(decision)).unwrap();
    assert!(!bytes.windows(11).any(|w| w == b"kv_position"));

    let at = |epoch, event_id| EventPosition { epoch, event_id };
    assert!(at(1, 900) < at(2, 0) && at(2, 0) < at(2, 1));
}

fn life(id: &str, event: LifecycleEvent) -> LifecycleMessage {
    LifecycleMessage {
        request_id: id.into(),
        event,
    }
}

#[test]
fn lifecycle_batches_keep_their_order_and_single_messages_read_as_batches_of_one() {
    let messages = vec![
        life("a", LifecycleEvent::PrefillDone),
        life("b", LifecycleEvent::KeepAlive),
        life("a", LifecycleEvent::Freed),
    ];
    let payload = LifecycleBatch::encode(&messages).unwrap();
    let batch: LifecycleBatch = decode(&payload).unwrap();
    assert_eq!(batch.messages, messages);

    // One message keeps the single form, which routers before batches read.
    let one = LifecycleBatch::encode(&messages[..1]).unwrap();
    assert_eq!(one, encode(&messages[0]).unwrap());
    assert_eq!(
        decode::<LifecycleMessage>(&one).unwrap(),
        messages[0],
        "an older router reads it"
    );
    assert_eq!(
        decode::<LifecycleBatch>(&one).unwrap().messages,
        messages[..1]
    );
}

#[test]
fn a_lifecycle_payload_with_both_forms_or_neither_is_malformed() {
    #[derive(Serialize)]
    struct Both<'a> {
        request_id: &'a str,
        event: LifecycleEvent,
        messages: Vec<LifecycleMessage>,
    }
    let both = encode(&Both {
        request_id: "a",
        event: LifecycleEvent::Freed,
        messages: vec![life("b", LifecycleEvent::Freed)],
    })
    .unwrap();
    assert!(decode::<LifecycleBatch>(&both).is_err());
    #[derive(Serialize)]
    struct HalfSingle<'a> {
        request_id: &'a str,
    }
    let half = encode(&HalfSingle { request_id: "a" }).unwrap();
    assert!(decode::<LifecycleBatch>(&half).is_err());
    assert!(decode::<LifecycleBatch>(&encode(&serde_json::json!({})).unwrap()).is_err());
}
