//! Scheduler configuration: which policy picks the (worker, dp_rank), with its knobs.
//!
//! The policy is an enum whose variants carry their own typed settings, so a knob that
//! only makes sense for the KV policy (such as `temperature`) cannot be set for
//! round-robin. Configuration is validated once, in [`crate::Scheduler::new`]; it is
//! plain data, cheap to clone, and costs nothing at scheduling time.

use crate::error::SchedulerError;
use kv_events::routing::PolicyKind;

/// Everything the scheduler needs to know up front.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SchedulerConfig {
    /// The daemon's default policy; a request may override it per call.
    /// Default: [`PolicyConfig::Kv`] with [`KvPolicyConfig::default`].
    pub policy: PolicyConfig,
}

impl SchedulerConfig {
    /// Checks every field.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] naming the first bad field.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        self.policy.validate()
    }
}

/// A routing policy together with its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PolicyConfig {
    /// KV-cache-aware cost: uncached prompt blocks plus active decode blocks.
    Kv(KvPolicyConfig),
    /// Cycle through the registered ranks in order, ignoring cache and load.
    RoundRobin,
    /// Pick a registered rank uniformly at random.
    Random,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::Kv(KvPolicyConfig::default())
    }
}

impl PolicyConfig {
    /// The wire name of this policy.
    pub fn kind(&self) -> PolicyKind {
        match self {
            PolicyConfig::Kv(_) => PolicyKind::Kv,
            PolicyConfig::RoundRobin => PolicyKind::RoundRobin,
            PolicyConfig::Random => PolicyKind::Random,
        }
    }

    /// Checks the policy's knobs.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] naming the bad field.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        match self {
            PolicyConfig::Kv(kv) => kv.validate(),
            PolicyConfig::RoundRobin | PolicyConfig::Random => Ok(()),
        }
    }
}

/// Knobs of the KV-aware policy (see [`crate::selector`] for the cost formula).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvPolicyConfig {
    /// Weight of uncached prompt blocks (prefill work) against active decode blocks.
    /// Higher favours cache hits and so TTFT; lower favours even decode load and so
    /// ITL; 0 is pure load balancing. Finite and ≥ 0. Default 1.0.
    pub overlap_weight: f64,
    /// Softmax temperature over normalized costs. 0 always picks the lowest cost
    /// (exact ties broken uniformly at random); larger values spread requests over
    /// worse-scoring ranks, approaching uniform. Finite and ≥ 0. Default 0.0.
    pub temperature: f64,
}

impl Default for KvPolicyConfig {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
            temperature: 0.0,
        }
    }
}

impl KvPolicyConfig {
    /// Checks that both knobs are finite and non-negative.
    ///
    /// # Errors
    /// [`SchedulerError::InvalidConfig`] with field `policy.kv.overlap_weight` or
    /// `policy.kv.temperature`.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        check_non_negative("policy.kv.overlap_weight", self.overlap_weight)?;
        check_non_negative("policy.kv.temperature", self.temperature)
    }
}

fn check_non_negative(field: &'static str, value: f64) -> Result<(), SchedulerError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(SchedulerError::InvalidConfig {
            field,
            reason: format!("must be finite and >= 0, got {value}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(overlap_weight: f64, temperature: f64) -> SchedulerConfig {
        SchedulerConfig {
            policy: PolicyConfig::Kv(KvPolicyConfig {
                overlap_weight,
                temperature,
            }),
        }
    }

    fn bad_field(config: &SchedulerConfig) -> &'static str {
        match config.validate() {
            Err(SchedulerError::InvalidConfig { field, .. }) => field,
            other => panic!("expected invalid config, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_kv_with_unit_weight_and_zero_temperature() {
        let config = SchedulerConfig::default();
        assert_eq!(config.policy.kind(), PolicyKind::Kv);
        assert_eq!(
            config.policy,
            PolicyConfig::Kv(KvPolicyConfig {
                overlap_weight: 1.0,
                temperature: 0.0
            })
        );
        assert!(config.validate().is_ok());
    }

    #[test]
    fn kind_maps_every_variant() {
        assert_eq!(PolicyConfig::RoundRobin.kind(), PolicyKind::RoundRobin);
        assert_eq!(PolicyConfig::Random.kind(), PolicyKind::Random);
        assert_eq!(
            PolicyConfig::Kv(KvPolicyConfig::default()).kind(),
            PolicyKind::Kv
        );
    }

    #[test]
    fn validation_names_the_bad_field() {
        assert_eq!(bad_field(&kv(-0.5, 0.0)), "policy.kv.overlap_weight");
        assert_eq!(bad_field(&kv(f64::NAN, 0.0)), "policy.kv.overlap_weight");
        assert_eq!(
            bad_field(&kv(f64::INFINITY, 0.0)),
            "policy.kv.overlap_weight"
        );
        assert_eq!(bad_field(&kv(1.0, -1.0)), "policy.kv.temperature");
        assert_eq!(bad_field(&kv(1.0, f64::NAN)), "policy.kv.temperature");
        assert_eq!(bad_field(&kv(1.0, f64::INFINITY)), "policy.kv.temperature");
        assert!(kv(0.0, 0.0).validate().is_ok());
        assert!(kv(2.5, 10.0).validate().is_ok());
    }

    #[test]
    fn error_message_is_lowercase_and_names_field_and_value() {
        let err = kv(1.0, -2.0).validate().unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid config field `policy.kv.temperature`: must be finite and >= 0, got -2"
        );
    }
}
