//! Prototype routing costs, evaluated by the lab itself rather than by the
//! `scheduler` crate.
//!
//! A new cost idea is cheapest to try here: the lab gives it the same inputs the
//! scheduler has at decision time — the index's overlap blocks per rank and the load
//! the router booked itself (pending prefill tokens, decode blocks, active requests) —
//! and runs it on the same simulated cluster as the real policies. An idea that wins
//! becomes a scheduler policy; its prototype stays here so the ablation in
//! `docs/benchmarks.md` can be re-run. This file names the prototypes and their knobs;
//! [`super::candidate_router`] evaluates them.

/// Knobs of the predicted-TTFT prototype (see [`Candidate`] for the formula).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PredictedTtftKnobs {
    /// Credit in-flight prefixes: a rank's overlap is the larger of the index's and
    /// the prompt blocks of requests booked there and not yet freed
    /// ([`super::inflight`]).
    pub in_flight: bool,
    /// Credit per cached token on every rank; 1 means a cached token is worth exactly
    /// the prefill it saves this request. [`Self::base_shape`] says how its part
    /// above 1 depends on the load.
    pub base_credit: f64,
    /// How the base credit above 1 depends on the rank's and the fleet's queue.
    pub base_shape: BaseShape,
    /// Extra credit on a rank whose pending prefill is the cluster minimum, halving
    /// once the rank's pending prefill exceeds the minimum by one
    /// `max_num_batched_tokens`: reuse is worth more where it does not make the
    /// request queue (decay of overlap credit under load).
    pub balanced_credit: f64,
    /// Extra credit per step (`max_num_batched_tokens`) of the least-loaded rank's
    /// pending prefill: when every rank has a queue, a cached token saves time for
    /// every request queued behind this one, not only for this one.
    pub backlog_credit: f64,
    /// The credits above apply only when the rank caches at least this fraction of
    /// the prompt; below it a cached token is worth exactly its own prefill (credit
    /// 1), so a short shared prefix (a system prompt) does not pull every request to
    /// the rank holding it. SGLang's cache-aware router uses 0.3 as its match-ratio
    /// threshold.
    pub min_match_ratio: f64,
}

/// How the part of the base credit above 1 depends on the load (prototypes of the
/// light-load fix, issue 17): `base = 1 + (base_credit − 1) × f`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BaseShape {
    /// `f = 1`: the same on every rank, however long its queue.
    Flat,
    /// `f = 1 / (1 + (P − P_min) / (steps × B))`: halves once the rank's pending
    /// prefill exceeds the minimum by `steps` batch budgets (the balanced credit's
    /// decay at `steps` = 1).
    Decay {
        /// Excess queue, in batch budgets, at which the base credit above 1 halves;
        /// greater than 0.
        steps: f64,
    },
    /// `f = min(1, P_min / B)`: only when every rank has a queue.
    Backlog,
    /// `f = max(decay, backlog)`: decays with the excess queue unless the whole
    /// fleet is backlogged.
    Mix {
        /// As in [`BaseShape::Decay`].
        steps: f64,
    },
    /// `f = max(decay, min(1, P_mean / B))`: as [`BaseShape::Mix`] with the fleet's
    /// mean pending prefill instead of its minimum, so a fleet where most ranks
    /// queue keeps the credit even while one rank is idle.
    MixMean {
        /// As in [`BaseShape::Decay`].
        steps: f64,
    },
    /// `f = max(decay, share of ranks with at least one budget pending)`: as
    /// [`BaseShape::Mix`] with the fleet's busy share as the floor.
    MixBusy {
        /// As in [`BaseShape::Decay`].
        steps: f64,
    },
}

impl BaseShape {
    /// The factor `f`, given the rank's excess pending prefill, the least-loaded
    /// rank's and the mean over the ranks, all in batch budgets, and the share of
    /// ranks with at least one budget pending, in `[0, 1]`.
    pub fn factor(
        self,
        excess_steps: f64,
        min_pending_steps: f64,
        mean_pending_steps: f64,
        busy_share: f64,
    ) -> f64 {
        let decay = |steps: f64| 1.0 / (1.0 + excess_steps / steps);
        let backlog = min_pending_steps.min(1.0);
        match self {
            BaseShape::Flat => 1.0,
            BaseShape::Decay { steps } => decay(steps),
            BaseShape::Backlog => backlog,
            BaseShape::Mix { steps } => decay(steps).max(backlog),
            BaseShape::MixMean { steps } => decay(steps).max(mean_pending_steps.min(1.0)),
            BaseShape::MixBusy { steps } => decay(steps).max(busy_share),
        }
    }

    /// `flat`, `decay:<steps>`, `backlog`, `mix:<steps>`, `mix-mean:<steps>` or
    /// `mix-busy:<steps>`.
    fn name(self) -> String {
        match self {
            BaseShape::Flat => "flat".to_owned(),
            BaseShape::Decay { steps } => format!("decay:{steps}"),
            BaseShape::Backlog => "backlog".to_owned(),
            BaseShape::Mix { steps } => format!("mix:{steps}"),
            BaseShape::MixMean { steps } => format!("mix-mean:{steps}"),
            BaseShape::MixBusy { steps } => format!("mix-busy:{steps}"),
        }
    }

    fn parse(s: &str) -> Option<Self> {
        let steps = |v: &str| v.parse::<f64>().ok().filter(|x| x.is_finite() && *x > 0.0);
        match s.split_once(':') {
            None if s == "flat" => Some(BaseShape::Flat),
            None if s == "backlog" => Some(BaseShape::Backlog),
            Some(("decay", v)) => steps(v).map(|steps| BaseShape::Decay { steps }),
            Some(("mix", v)) => steps(v).map(|steps| BaseShape::Mix { steps }),
            Some(("mix-mean", v)) => steps(v).map(|steps| BaseShape::MixMean { steps }),
            Some(("mix-busy", v)) => steps(v).map(|steps| BaseShape::MixBusy { steps }),
            _ => None,
        }
    }
}

/// A prototype cost, in predicted model ms. Lower wins.
///
/// With `P` the rank's booked pending prefill tokens, `P_min` the smallest `P` over
/// the ranks, `B` = `max_num_batched_tokens`, `N` the prompt tokens, `O` the cached
/// prompt tokens on the rank (overlap blocks × block size, at most `N`), `R` the
/// rank's active requests and `D` its active decode blocks:
///
/// ```text
/// credit = 1                                                          if O < min_match_ratio × N
///        = 1 + (base_credit − 1) × f + balanced_credit / (1 + (P − P_min) / B)
///          + backlog_credit × P_min / B                                otherwise
/// steps  = max(1, ceil((P + N − O) / B))
/// cost   = prefill_ms_per_token × (P + N − credit × O)
///        + steps × (step_base_ms + decode_ms_per_seq × R + kv_read_ms_per_token × D × block_size)
/// ```
///
/// With `credit = 1` the cost is the timing model's prediction of the request's TTFT
/// on that rank: the rank prefills everything booked before it (FCFS) plus the
/// request's uncached tokens, and every prefill step also carries the running decodes
/// (`docs/engine-model.md`). Credits above 1 value reuse beyond this request's own
/// saving. `f` is 1 unless [`PredictedTtftKnobs::base_shape`] says otherwise
/// ([`BaseShape`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Candidate {
    /// Prototype of a predicted-TTFT cost with the given knobs.
    PredictedTtft(PredictedTtftKnobs),
}

impl Candidate {
    /// `ttft`: the plain prediction (credit 1, index overlap only).
    pub const TTFT: Candidate = Candidate::PredictedTtft(PredictedTtftKnobs {
        in_flight: false,
        base_credit: 1.0,
        base_shape: BaseShape::Flat,
        balanced_credit: 0.0,
        backlog_credit: 0.0,
        min_match_ratio: 0.0,
    });
    /// `ttft-inflight`: the plain prediction, crediting in-flight prefixes.
    pub const TTFT_INFLIGHT: Candidate = Candidate::PredictedTtft(PredictedTtftKnobs {
        in_flight: true,
        base_credit: 1.0,
        base_shape: BaseShape::Flat,
        balanced_credit: 0.0,
        backlog_credit: 0.0,
        min_match_ratio: 0.0,
    });
    /// `ttft-credit`: in-flight prefixes and the credits (12, 40, 1) above a 0.3 match
    /// ratio: the first tuning, on seed 42 (`docs/benchmarks.md`).
    pub const TTFT_CREDIT: Candidate = Candidate::PredictedTtft(PredictedTtftKnobs {
        in_flight: true,
        base_credit: 12.0,
        base_shape: BaseShape::Flat,
        balanced_credit: 40.0,
        backlog_credit: 1.0,
        min_match_ratio: 0.3,
    });
    /// `ttft-tuned`: the credits (12, 40, 0.5) above a 0.2 match ratio, the best of a
    /// 108-point grid that held on four seeds; the prototype of the scheduler's
    /// `predicted-ttft` defaults.
    pub const TTFT_TUNED: Candidate = Candidate::PredictedTtft(PredictedTtftKnobs {
        in_flight: true,
        base_credit: 12.0,
        base_shape: BaseShape::Flat,
        balanced_credit: 40.0,
        backlog_credit: 0.5,
        min_match_ratio: 0.2,
    });

    /// Every named prototype, in documentation order.
    pub const ALL: [Candidate; 4] = [
        Candidate::TTFT,
        Candidate::TTFT_INFLIGHT,
        Candidate::TTFT_CREDIT,
        Candidate::TTFT_TUNED,
    ];

    /// Whether the router should credit in-flight prefixes (see [`super::inflight`]).
    pub fn uses_in_flight(self) -> bool {
        match self {
            Candidate::PredictedTtft(k) => k.in_flight,
        }
    }

    /// The command-line name: `ttft`, `ttft-inflight`, `ttft-credit`, `ttft-tuned`,
    /// or `ttft:<base>,<balanced>,<backlog>,<inflight 0|1>,<min ratio>[,<base shape>]`
    /// for other knobs (the shape is left out when [`BaseShape::Flat`]).
    pub fn name(self) -> String {
        if self == Candidate::TTFT {
            "ttft".to_owned()
        } else if self == Candidate::TTFT_INFLIGHT {
            "ttft-inflight".to_owned()
        } else if self == Candidate::TTFT_CREDIT {
            "ttft-credit".to_owned()
        } else if self == Candidate::TTFT_TUNED {
            "ttft-tuned".to_owned()
        } else {
            let Candidate::PredictedTtft(k) = self;
            let shape = match k.base_shape {
                BaseShape::Flat => String::new(),
                other => format!(",{}", other.name()),
            };
            format!(
                "ttft:{},{},{},{},{}{shape}",
                k.base_credit,
                k.balanced_credit,
                k.backlog_credit,
                u8::from(k.in_flight),
                k.min_match_ratio
            )
        }
    }
}

/// Parses `<base>,<balanced>,<backlog>,<inflight 0|1>,<min ratio>[,<base shape>]`
/// (credits finite and ≥ 0; shape `flat`, `decay:<steps>`, `backlog`, `mix:<steps>`,
/// `mix-mean:<steps>` or `mix-busy:<steps>`).
fn parse_knobs(s: &str) -> Option<PredictedTtftKnobs> {
    let parts: Vec<&str> = s.split(',').collect();
    let (base, balanced, backlog, in_flight, ratio, shape) = match parts.as_slice() {
        [a, b, c, d, e] => (*a, *b, *c, *d, *e, BaseShape::Flat),
        [a, b, c, d, e, f] => (*a, *b, *c, *d, *e, BaseShape::parse(f)?),
        _ => return None,
    };
    let credit = |v: &str| v.parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0);
    Some(PredictedTtftKnobs {
        in_flight: match in_flight {
            "0" => false,
            "1" => true,
            _ => return None,
        },
        base_credit: credit(base)?,
        base_shape: shape,
        balanced_credit: credit(balanced)?,
        backlog_credit: credit(backlog)?,
        min_match_ratio: credit(ratio)?,
    })
}

impl std::str::FromStr for Candidate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(knobs) = s.strip_prefix("ttft:") {
            return parse_knobs(knobs)
                .map(Candidate::PredictedTtft)
                .ok_or_else(|| {
                    format!(
                        "candidate `{s}`: expected ttft:<base>,<balanced>,<backlog>,<0|1>,<ratio>[,<shape>]"
                    )
                });
        }
        Candidate::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                let names: Vec<String> = Candidate::ALL.iter().map(|c| c.name()).collect();
                format!(
                    "unknown candidate `{s}` (expected one of {}, or ttft:<base>,<balanced>,<backlog>,<0|1>,<ratio>[,<shape>])",
                    names.join(", ")
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for c in Candidate::ALL {
            assert_eq!(c.name().parse::<Candidate>(), Ok(c));
        }
        assert!(
            "nope"
                .parse::<Candidate>()
                .unwrap_err()
                .contains("ttft-credit")
        );
        let custom = Candidate::PredictedTtft(PredictedTtftKnobs {
            in_flight: false,
            base_credit: 3.0,
            base_shape: BaseShape::Flat,
            balanced_credit: 0.5,
            backlog_credit: 0.0,
            min_match_ratio: 0.25,
        });
        assert_eq!(custom.name(), "ttft:3,0.5,0,0,0.25");
        assert_eq!(custom.name().parse::<Candidate>(), Ok(custom));
        for shape in [
            BaseShape::Decay { steps: 2.0 },
            BaseShape::Backlog,
            BaseShape::Mix { steps: 0.5 },
            BaseShape::MixMean { steps: 2.0 },
            BaseShape::MixBusy { steps: 4.0 },
        ] {
            let c = Candidate::PredictedTtft(PredictedTtftKnobs {
                base_shape: shape,
                ..custom_knobs(&custom)
            });
            assert_eq!(c.name().parse::<Candidate>(), Ok(c), "{}", c.name());
        }
        assert_eq!("ttft:3,0.5,0,0,0.25,flat".parse::<Candidate>(), Ok(custom));
        for bad in [
            "ttft:1,2,3,1",
            "ttft:1,2,3,1,0,decay:0",
            "ttft:1,2,3,1,0,steep",
            "ttft:1,2,3,2,0",
            "ttft:-1,0,0,0,0",
            "ttft:x,0,0,1,0",
        ] {
            assert!(bad.parse::<Candidate>().is_err(), "{bad}");
        }
        assert!(Candidate::TTFT_CREDIT.uses_in_flight() && !Candidate::TTFT.uses_in_flight());
    }

    fn custom_knobs(c: &Candidate) -> PredictedTtftKnobs {
        let Candidate::PredictedTtft(k) = *c;
        k
    }

    #[test]
    fn base_shapes_scale_the_base_credit_with_the_queue() {
        let decay = |steps| BaseShape::Decay { steps };
        let mix = |steps| BaseShape::Mix { steps };
        let mix_mean = |steps| BaseShape::MixMean { steps };
        let mix_busy = |steps| BaseShape::MixBusy { steps };
        // (shape, [excess, min pending, mean pending, busy share], factor)
        let cases = [
            (BaseShape::Flat, [6.0, 0.0, 0.0, 0.0], 1.0),
            // Halves at `steps` budgets of excess queue.
            (decay(2.0), [2.0, 0.0, 0.0, 0.0], 0.5),
            (decay(1.0), [0.0, 5.0, 5.0, 0.0], 1.0),
            // Only a backlogged fleet earns it, in full from one budget on.
            (BaseShape::Backlog, [0.0, 0.0, 0.0, 0.0], 0.0),
            (BaseShape::Backlog, [0.0, 0.5, 0.5, 0.0], 0.5),
            (BaseShape::Backlog, [3.0, 4.0, 6.0, 0.0], 1.0),
            // The larger of the two.
            (mix(1.0), [3.0, 0.0, 2.0, 0.0], 0.25),
            (mix(1.0), [3.0, 2.0, 3.0, 0.0], 1.0),
            // The mean queue keeps it while one rank idles; `mix` gives 0.25 there.
            (mix_mean(1.0), [3.0, 0.0, 2.0, 0.0], 1.0),
            (mix_mean(1.0), [3.0, 0.0, 0.5, 0.0], 0.5),
            // The busy share: 7 of 8 ranks queue.
            (mix_busy(1.0), [3.0, 0.0, 0.0, 0.875], 0.875),
            (mix_busy(1.0), [3.0, 0.0, 5.0, 0.0], 0.25),
        ];
        for (shape, [excess, min, mean, busy], want) in cases {
            assert_eq!(shape.factor(excess, min, mean, busy), want, "{shape:?}");
        }
    }
}
