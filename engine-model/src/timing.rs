//! The step-time model: how long one forward pass of the mock engine takes.
//!
//! A real engine's step time is dominated by three costs: a fixed per-step cost (reading
//! the model weights once from HBM, kernel launches, sampling), compute that grows with
//! the number of prompt tokens prefilled in the step, and memory traffic that grows with
//! the decode batch (per-sequence overhead plus reading each sequence's KV cache). The
//! mock engine charges exactly those, linearly:
//!
//! ```text
//! t_step [ms] = step_base_ms
//!             + prefill_ms_per_token × prefill_tokens
//!             + decode_ms_per_seq    × decode_seqs
//!             + kv_read_ms_per_token × decode_context_tokens
//! ```
//!
//! The defaults are order-of-magnitude values for an 8B-parameter dense model in bf16
//! on one H100-class GPU, chosen to resemble published vLLM benchmark numbers; they are
//! not a measurement. See `docs/engine-model.md` for the derivation of each term.
//! Evaluating the model costs a handful of floating-point operations.

/// The work done in one engine step, the input of [`TimingModel::step_duration_ms`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepWork {
    /// Prompt tokens computed in this step (sum of all prefill chunks), in tokens.
    pub prefill_tokens: u64,
    /// Requests that decoded one token in this step.
    pub decode_seqs: u64,
    /// KV cache entries read by the decoding requests (their current context lengths:
    /// prompt plus tokens generated so far, summed), in tokens.
    pub decode_context_tokens: u64,
}

impl StepWork {
    /// True when the step did nothing (no prefill and no decode).
    pub fn is_empty(&self) -> bool {
        self.prefill_tokens == 0 && self.decode_seqs == 0
    }
}

/// Linear step-time model; all coefficients are in model milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    /// Fixed cost of any non-empty step, in ms (weight read + launch overhead).
    pub step_base_ms: f64,
    /// Cost per prefilled prompt token, in ms per token (inverse prefill throughput).
    pub prefill_ms_per_token: f64,
    /// Cost per decoding sequence, in ms per sequence (sampling and per-sequence work).
    pub decode_ms_per_seq: f64,
    /// Cost per KV cache token read by decode attention, in ms per token.
    pub kv_read_ms_per_token: f64,
}

impl TimingModel {
    /// Order-of-magnitude defaults for an 8B dense model (bf16) on one H100-class GPU.
    ///
    /// - `step_base_ms = 9.0`: 16 GB of weights at ~3.3 TB/s HBM is ~5 ms per step, plus
    ///   scheduling, launch and sampling overhead; a small-batch decode step lands near
    ///   9–10 ms, in the 10–15 ms range reported for vLLM on such hardware.
    /// - `prefill_ms_per_token = 0.06`: ~16.7k prompt tokens/s once a chunk is large,
    ///   within the 10–20k tokens/s usually seen for 8B prefill on one H100.
    /// - `decode_ms_per_seq = 0.04`: 64 extra decoding sequences add ~2.5 ms.
    /// - `kv_read_ms_per_token = 4e-5`: Llama-3-8B stores 128 KiB of KV per token
    ///   (2 × 32 layers × 8 KV heads × 128 dims × 2 bytes); reading it at ~3.3 TB/s
    ///   takes ~4e-5 ms.
    pub const H100_8B: TimingModel = TimingModel {
        step_base_ms: 9.0,
        prefill_ms_per_token: 0.06,
        decode_ms_per_seq: 0.04,
        kv_read_ms_per_token: 4e-5,
    };

    /// Duration of a step that did `work`, in model ms; 0 for an empty step.
    pub fn step_duration_ms(&self, work: &StepWork) -> f64 {
        if work.is_empty() {
            return 0.0;
        }
        self.step_base_ms
            + self.prefill_ms_per_token * work.prefill_tokens as f64
            + self.decode_ms_per_seq * work.decode_seqs as f64
            + self.kv_read_ms_per_token * work.decode_context_tokens as f64
    }
}

impl Default for TimingModel {
    /// [`TimingModel::H100_8B`].
    fn default() -> Self {
        Self::H100_8B
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn empty_step_takes_no_time() {
        assert_eq!(
            TimingModel::default().step_duration_ms(&StepWork::default()),
            0.0
        );
    }

    #[test]
    fn each_term_contributes_linearly() {
        let m = TimingModel {
            step_base_ms: 10.0,
            prefill_ms_per_token: 0.5,
            decode_ms_per_seq: 2.0,
            kv_read_ms_per_token: 0.01,
        };
        let work = StepWork {
            prefill_tokens: 100,
            decode_seqs: 3,
            decode_context_tokens: 1000,
        };
        // 10 + 0.5*100 + 2*3 + 0.01*1000
        assert!(close(m.step_duration_ms(&work), 76.0));
        let decode_only = StepWork {
            prefill_tokens: 0,
            decode_seqs: 1,
            decode_context_tokens: 0,
        };
        assert!(close(m.step_duration_ms(&decode_only), 12.0));
    }

    #[test]
    fn defaults_are_in_the_documented_ranges() {
        let m = TimingModel::default();
        // Small-batch decode step: ~9-15 ms.
        let small_decode = m.step_duration_ms(&StepWork {
            prefill_tokens: 0,
            decode_seqs: 4,
            decode_context_tokens: 4 * 2_000,
        });
        assert!((9.0..15.0).contains(&small_decode), "{small_decode}");
        // A full 8192-token prefill chunk runs at 10k-20k tokens/s.
        let chunk = m.step_duration_ms(&StepWork {
            prefill_tokens: 8_192,
            ..StepWork::default()
        });
        let tokens_per_s = 8_192.0 / (chunk / 1_000.0);
        assert!(
            (10_000.0..20_000.0).contains(&tokens_per_s),
            "{tokens_per_s}"
        );
    }
}
