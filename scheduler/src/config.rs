//! Scheduler configuration: the policy and its knobs, how booked load is counted and
//! expires, when a rank is busy, and how long a prefill is expected to take.
//!
//! Each part is a typed sub-config with a documented `Default` and serde derives, so
//! the daemon can fill it from flags today and from a TOML file later without a
//! translation layer. Configuration is validated once, in [`crate::Scheduler::new`];
//! it is plain data, cheap to clone, and costs nothing at scheduling time.

use crate::busy::BusyThresholds;
use crate::calibration::CalibrationConfig;
use crate::disaggregation::DisaggregationConfig;
pub use crate::duration_ms;
use crate::error::SchedulerError;
use crate::liveness::LivenessConfig;
use crate::policy::PolicyConfig;
use crate::sessions::SessionConfig;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Everything the scheduler needs to know up front.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// The daemon's default policy; a request may override it per call.
    /// Default: [`PolicyConfig::PredictedTtft`] with
    /// [`crate::PredictedTtftConfig::default`] (see [`PolicyConfig::default`]).
    pub policy: PolicyConfig,
    /// How booked requests are counted and when they expire.
    pub sequences: SequencesConfig,
    /// When a rank counts as busy and is skipped. Default: never.
    pub busy: BusyThresholds,
    /// How the expected prefill duration of a booking is estimated (it drives the
    /// linear decay of the oldest in-flight prefill). Default: unknown, no decay.
    pub prefill_duration: PrefillDurationModel,
    /// When a rank whose load metrics went silent is deprioritized and excluded.
    /// Default: on, 1 s interval, quiet after 3, silent after 10.
    pub liveness: LivenessConfig,
    /// Whether `predicted-ttft` learns each rank's step-time constants from observed
    /// TTFTs (see [`crate::calibration`]). Default: on; forgetting 0.995, constants
    /// within 8× of the configured ones, outliers clipped at 4×, 20 samples of
    /// warm-up.
    pub calibration: CalibrationConfig,
    /// Session affinity for requests that carry a session id (see
    /// [`crate::sessions`]). Default: on, 65,536 sessions, 10 min TTL, margins 50 ms
    /// (`predicted-ttft`) and 10% (`kv`, `kv-normalized`).
    pub sessions: SessionConfig,
    /// When a request that allows disaggregation is prefilled by its decode worker
    /// instead (see [`crate::disaggregation`]). Default: up to 1,024 uncached tokens,
    /// or 80% of the prompt's blocks held by the decode rank.
    pub disaggregation: DisaggregationConfig,
}

impl SchedulerConfig {
    /// Checks every field.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] naming the first bad field.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        self.policy.validate()?;
        self.sequences.validate()?;
        self.busy.validate()?;
        self.liveness.validate()?;
        self.calibration.validate()?;
        self.sessions.validate()?;
        self.disaggregation.validate()?;
        self.prefill_duration.validate()
    }
}

/// How the active-sequence write model counts load and ages requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SequencesConfig {
    /// Whether concurrent requests on one rank that share a prompt prefix share its
    /// KV blocks during decode (prefix caching with cascade or shared-prefix
    /// attention, as vLLM and SGLang do): their common blocks then count once in the
    /// rank's active decode blocks. Set to false for engines that copy the prefix per
    /// request. Default true.
    pub assume_kv_reuse: bool,
    /// A booked request that gets no lifecycle message (`prefill_done`, `keep_alive`,
    /// `freed`) for this long is dropped, as its frontend presumably crashed. Every
    /// lifecycle message restarts the clock. Must be at least 1 ms. Default 10 min:
    /// twice Dynamo's fixed 5-minute stale-request sweep, which is known to drop long
    /// healthy requests; frontends of requests that may run longer send `keep_alive`.
    #[serde(rename = "request_ttl_ms", with = "duration_ms")]
    pub request_ttl: Duration,
}

impl Default for SequencesConfig {
    fn default() -> Self {
        Self {
            assume_kv_reuse: true,
            request_ttl: Duration::from_secs(600),
        }
    }
}

impl SequencesConfig {
    /// Checks the TTL.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] for `sequences.request_ttl_ms` below 1 ms.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        if self.request_ttl < Duration::from_millis(1) {
            return Err(SchedulerError::InvalidConfig {
                field: "sequences.request_ttl_ms",
                reason: "must be at least 1 ms".into(),
            });
        }
        Ok(())
    }
}

/// How long the prefill of a booked request is expected to take. The estimate is
/// computed once, at booking, into the request's [`crate::PrefillLoadHint`].
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "model", rename_all = "kebab-case", deny_unknown_fields)]
pub enum PrefillDurationModel {
    /// No estimate: a rank's prefill load only drops at `prefill_done`.
    #[default]
    Unknown,
    /// Prefill runs at a fixed rate: `uncached tokens / tokens_per_second`. Measure it
    /// on the engine (prompt tokens per second of one rank at the typical batch).
    Throughput {
        /// Prefill rate of one rank, tokens per second; finite and > 0.
        tokens_per_second: f64,
    },
}

impl PrefillDurationModel {
    /// The expected duration of prefilling `tokens` tokens, `None` without a model.
    pub fn expected(&self, tokens: u64) -> Option<Duration> {
        match self {
            PrefillDurationModel::Unknown => None,
            PrefillDurationModel::Throughput { tokens_per_second } => {
                Duration::try_from_secs_f64(tokens as f64 / tokens_per_second).ok()
            }
        }
    }

    /// Checks the rate.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] for a rate that is not finite and positive.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        match self {
            PrefillDurationModel::Unknown => Ok(()),
            PrefillDurationModel::Throughput { tokens_per_second } => {
                if tokens_per_second.is_finite() && *tokens_per_second > 0.0 {
                    Ok(())
                } else {
                    Err(SchedulerError::InvalidConfig {
                        field: "prefill_duration.tokens_per_second",
                        reason: format!("must be finite and > 0, got {tokens_per_second}"),
                    })
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::busy::Threshold;
    use crate::policy::PredictedTtftConfig;
    use kv_events::routing::PolicyKind;

    fn bad_field(config: &SchedulerConfig) -> &'static str {
        match config.validate() {
            Err(SchedulerError::InvalidConfig { field, .. }) => field,
            other => panic!("expected invalid config, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_calibrated_predicted_ttft_reuse_ten_minutes_never_busy_no_decay() {
        let config = SchedulerConfig::default();
        assert_eq!(config.policy.kind(), PolicyKind::PredictedTtft);
        assert_eq!(
            config.policy,
            PolicyConfig::PredictedTtft(PredictedTtftConfig::default())
        );
        assert!(config.sequences.assume_kv_reuse);
        assert_eq!(config.sequences.request_ttl, Duration::from_secs(600));
        assert_eq!(config.busy, BusyThresholds::default());
        assert_eq!(config.prefill_duration, PrefillDurationModel::Unknown);
        assert!(config.calibration.enabled, "calibration is on by default");
        assert!(config.validate().is_ok());
    }

    #[test]
    fn validation_names_the_bad_field() {
        let mut config = SchedulerConfig::default();
        config.sequences.request_ttl = Duration::ZERO;
        assert_eq!(bad_field(&config), "sequences.request_ttl_ms");

        let config = SchedulerConfig {
            prefill_duration: PrefillDurationModel::Throughput {
                tokens_per_second: 0.0,
            },
            ..SchedulerConfig::default()
        };
        assert_eq!(bad_field(&config), "prefill_duration.tokens_per_second");

        let mut config = SchedulerConfig::default();
        config.busy.decode_blocks = Some(Threshold::Fraction(f64::NAN));
        assert_eq!(bad_field(&config), "busy.decode_blocks");

        let mut config = SchedulerConfig::default();
        config.disaggregation.min_decode_overlap = 2.0;
        assert_eq!(bad_field(&config), "disaggregation.min_decode_overlap");

        for (bad, field) in [
            (
                CalibrationConfig {
                    forgetting: 0.0,
                    ..CalibrationConfig::default()
                },
                "calibration.forgetting",
            ),
            (
                CalibrationConfig {
                    forgetting: f64::NAN,
                    ..CalibrationConfig::default()
                },
                "calibration.forgetting",
            ),
            (
                CalibrationConfig {
                    max_factor: 0.5,
                    ..CalibrationConfig::default()
                },
                "calibration.max_factor",
            ),
            (
                CalibrationConfig {
                    outlier_ratio: 1.0,
                    ..CalibrationConfig::default()
                },
                "calibration.outlier_ratio",
            ),
            (
                CalibrationConfig {
                    max_queue_steps: 0,
                    ..CalibrationConfig::default()
                },
                "calibration.max_queue_steps",
            ),
        ] {
            let config = SchedulerConfig {
                calibration: bad,
                ..SchedulerConfig::default()
            };
            assert_eq!(bad_field(&config), field);
        }
    }

    #[test]
    fn throughput_model_divides_tokens_by_rate() {
        let model = PrefillDurationModel::Throughput {
            tokens_per_second: 1000.0,
        };
        assert_eq!(model.expected(250), Some(Duration::from_millis(250)));
        assert_eq!(model.expected(0), Some(Duration::ZERO));
        assert_eq!(PrefillDurationModel::Unknown.expected(250), None);
    }

    #[test]
    fn config_round_trips_through_json_with_readable_units() {
        let config = SchedulerConfig {
            policy: PolicyConfig::default_for(PolicyKind::CacheAwareThreshold),
            sequences: SequencesConfig {
                assume_kv_reuse: false,
                request_ttl: Duration::from_millis(1500),
            },
            busy: BusyThresholds {
                decode_blocks: Some(Threshold::Fraction(0.9)),
                prefill_tokens: Some(Threshold::Absolute(8192)),
            },
            prefill_duration: PrefillDurationModel::Throughput {
                tokens_per_second: 5000.0,
            },
            liveness: LivenessConfig {
                enabled: false,
                metrics_interval: Duration::from_millis(250),
                quiet_intervals: 2,
                silent_intervals: 4,
            },
            calibration: CalibrationConfig {
                enabled: true,
                forgetting: 0.99,
                max_factor: 4.0,
                outlier_ratio: 3.0,
                warmup_samples: 5,
                max_queue_steps: 3,
            },
            sessions: SessionConfig {
                capacity: 10,
                ..SessionConfig::default()
            },
            disaggregation: DisaggregationConfig {
                max_local_prefill_tokens: 256,
                min_decode_overlap: 0.5,
            },
        };
        let json = serde_json::to_value(&config).unwrap();
        assert_eq!(json["sequences"]["request_ttl_ms"], 1500);
        assert_eq!(json["policy"]["kind"], "cache-aware-threshold");
        assert_eq!(json["prefill_duration"]["model"], "throughput");
        assert_eq!(json["liveness"]["metrics_interval_ms"], 250);
        assert_eq!(json["calibration"]["warmup_samples"], 5);
        assert_eq!(json["sessions"]["ttl_ms"], 600_000);
        assert_eq!(json["disaggregation"]["min_decode_overlap"], 0.5);
        let back: SchedulerConfig = serde_json::from_value(json).unwrap();
        assert_eq!(back, config);
        // Missing sections take their defaults.
        let partial: SchedulerConfig =
            serde_json::from_str(r#"{"policy": {"kind": "round-robin"}}"#).unwrap();
        assert_eq!(partial.policy, PolicyConfig::RoundRobin);
        assert_eq!(partial.sequences, SequencesConfig::default());
    }
}
