//! Busy ranks: when a rank carries so much load that routing more work to it would
//! only queue inside the engine, the scheduler skips it; when every eligible rank is
//! busy, `schedule` fails with [`crate::SchedulerError::AllBusy`] and the daemon
//! holds the request in its wait queue until load frees.
//!
//! A rank is busy when its active decode blocks or its prefill tokens reach a
//! threshold. Each threshold is absolute or a fraction of the rank's capacity from
//! its registration (`total_kv_blocks`, and `total_kv_blocks × block_size` tokens for
//! prefill). The load compared is the larger of what this router booked (the
//! projection, see [`crate::RankLoad`]) and what the engine last reported in its
//! `LoadMetrics`, so load the router cannot see (other routers, direct traffic) still
//! counts. The check is O(1) per rank.

use crate::error::SchedulerError;
use crate::load::RankLoad;
use kv_events::LoadMetrics;
use kv_events::discovery::WorkerRegistration;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// One busy threshold: an absolute amount, or a fraction of the rank's capacity.
///
/// Text form (flags): `1500` is absolute, `85%` is the fraction 0.85. Serde form:
/// `{"absolute": 1500}` or `{"fraction": 0.85}`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Threshold {
    /// Busy at or above this many units (blocks or tokens); at least 1.
    Absolute(u64),
    /// Busy at or above this fraction of the capacity; finite and > 0 (may exceed 1).
    /// A rank that registered no capacity (`total_kv_blocks` 0) is never busy by a
    /// fraction.
    Fraction(f64),
}

impl Threshold {
    /// Whether `load` reaches the threshold for a rank of `capacity` units.
    pub fn reached(&self, load: u64, capacity: u64) -> bool {
        match *self {
            Threshold::Absolute(limit) => load >= limit,
            Threshold::Fraction(f) => capacity > 0 && load as f64 >= f * capacity as f64,
        }
    }

    fn validate(&self, field: &'static str) -> Result<(), SchedulerError> {
        let ok = match *self {
            Threshold::Absolute(limit) => limit >= 1,
            Threshold::Fraction(f) => f.is_finite() && f > 0.0,
        };
        if ok {
            Ok(())
        } else {
            Err(SchedulerError::InvalidConfig {
                field,
                reason: format!("{self} must be an amount >= 1 or a fraction > 0%"),
            })
        }
    }
}

impl fmt::Display for Threshold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Threshold::Absolute(limit) => write!(f, "{limit}"),
            Threshold::Fraction(frac) => write!(f, "{}%", frac * 100.0),
        }
    }
}

/// Why a threshold string did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid threshold `{0}`: expected an amount like `1500` or a percentage like `85%`")]
pub struct ThresholdParseError(String);

impl FromStr for Threshold {
    type Err = ThresholdParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ThresholdParseError(s.to_owned());
        let t = s.trim();
        match t.strip_suffix('%') {
            Some(pct) => {
                let pct: f64 = pct.trim().parse().map_err(|_| err())?;
                Ok(Threshold::Fraction(pct / 100.0))
            }
            None => t.parse().map(Threshold::Absolute).map_err(|_| err()),
        }
    }
}

/// The busy thresholds of every rank. `None` disables a threshold; with both `None`
/// (the default) no rank is ever busy and requests never wait.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BusyThresholds {
    /// Busy when active decode blocks reach this (capacity: `total_kv_blocks`).
    pub decode_blocks: Option<Threshold>,
    /// Busy when in-flight prefill tokens reach this (capacity:
    /// `total_kv_blocks × block_size` tokens).
    pub prefill_tokens: Option<Threshold>,
}

impl BusyThresholds {
    /// Whether any threshold is set.
    pub fn enabled(&self) -> bool {
        self.decode_blocks.is_some() || self.prefill_tokens.is_some()
    }

    /// Whether a rank of worker `reg` is busy with `booked` load (this router's
    /// projection) and `reported` load (the engine's latest sample, if any).
    pub fn is_busy(
        &self,
        booked: &RankLoad,
        reported: Option<&LoadMetrics>,
        reg: &WorkerRegistration,
    ) -> bool {
        let decode = booked
            .active_decode_blocks
            .max(reported.map_or(0, |m| m.active_decode_blocks));
        let prefill = booked
            .active_prefill_tokens
            .max(reported.map_or(0, |m| m.active_prefill_tokens));
        let token_capacity = reg
            .total_kv_blocks
            .saturating_mul(u64::from(reg.block_size));
        self.decode_blocks
            .is_some_and(|t| t.reached(decode, reg.total_kv_blocks))
            || self
                .prefill_tokens
                .is_some_and(|t| t.reached(prefill, token_capacity))
    }

    /// Checks both thresholds.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] with field `busy.decode_blocks` or
    /// `busy.prefill_tokens`.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        if let Some(t) = self.decode_blocks {
            t.validate("busy.decode_blocks")?;
        }
        if let Some(t) = self.prefill_tokens {
            t.validate("busy.prefill_tokens")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_events::{DpRank, WorkerId};

    fn reg(total_kv_blocks: u64) -> WorkerRegistration {
        WorkerRegistration {
            worker_id: WorkerId(1),
            dp_size: 1,
            block_size: 16,
            total_kv_blocks,
            url: None,
            epoch: 0,
            max_model_len: None,
            role: Default::default(),
            kv_transfer: None,
        }
    }

    fn load(decode: u64, prefill: u64) -> RankLoad {
        RankLoad {
            active_decode_blocks: decode,
            active_prefill_tokens: prefill,
            ..RankLoad::default()
        }
    }

    #[test]
    fn thresholds_parse_and_print() {
        assert_eq!("1500".parse(), Ok(Threshold::Absolute(1500)));
        assert_eq!(" 85% ".parse(), Ok(Threshold::Fraction(0.85)));
        assert!("85 percent".parse::<Threshold>().is_err());
        assert!("-3".parse::<Threshold>().is_err());
        assert_eq!(Threshold::Absolute(7).to_string(), "7");
        assert_eq!(Threshold::Fraction(0.5).to_string(), "50%");
    }

    #[test]
    fn absolute_and_fraction_limits() {
        assert!(!Threshold::Absolute(10).reached(9, 0));
        assert!(Threshold::Absolute(10).reached(10, 0));
        assert!(!Threshold::Fraction(0.5).reached(49, 100));
        assert!(Threshold::Fraction(0.5).reached(50, 100));
        // Unknown capacity: a fraction never triggers.
        assert!(!Threshold::Fraction(0.5).reached(u64::MAX, 0));
    }

    #[test]
    fn busy_uses_the_larger_of_booked_and_reported_load() {
        let busy = BusyThresholds {
            decode_blocks: Some(Threshold::Fraction(0.8)),
            prefill_tokens: Some(Threshold::Absolute(1000)),
        };
        let reg = reg(100);
        assert!(!busy.is_busy(&load(79, 999), None, &reg));
        assert!(busy.is_busy(&load(80, 0), None, &reg));
        assert!(busy.is_busy(&load(0, 1000), None, &reg));
        let reported = LoadMetrics {
            worker_id: WorkerId(1),
            dp_rank: DpRank(0),
            active_decode_blocks: 85,
            ..LoadMetrics::default()
        };
        assert!(busy.is_busy(&load(10, 0), Some(&reported), &reg));
        assert!(!BusyThresholds::default().is_busy(&load(u64::MAX, u64::MAX), None, &reg));
        assert!(!BusyThresholds::default().enabled());
        assert!(busy.enabled());
    }

    #[test]
    fn prefill_fraction_is_of_kv_tokens() {
        let busy = BusyThresholds {
            prefill_tokens: Some(Threshold::Fraction(0.25)),
            ..BusyThresholds::default()
        };
        // 100 blocks × 16 tokens = 1600 tokens; a quarter is 400.
        assert!(!busy.is_busy(&load(0, 399), None, &reg(100)));
        assert!(busy.is_busy(&load(0, 400), None, &reg(100)));
    }

    #[test]
    fn invalid_thresholds_name_their_field() {
        let zero = BusyThresholds {
            decode_blocks: Some(Threshold::Absolute(0)),
            ..BusyThresholds::default()
        };
        assert!(matches!(
            zero.validate(),
            Err(SchedulerError::InvalidConfig {
                field: "busy.decode_blocks",
                ..
            })
        ));
        let negative = BusyThresholds {
            prefill_tokens: Some(Threshold::Fraction(-0.1)),
            ..BusyThresholds::default()
        };
        assert!(matches!(
            negative.validate(),
            Err(SchedulerError::InvalidConfig {
                field: "busy.prefill_tokens",
                ..
            })
        ));
    }
}
