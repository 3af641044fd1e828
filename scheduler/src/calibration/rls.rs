//! The estimator of one rank: recursive least squares with exponential forgetting
//! over three multipliers of the configured step-time model, bounded four ways.
//!
//! Model: an observed TTFT `y` (routed → `prefill_done`, in ms) is the configured
//! model's three parts `z = [prefill, step base, decode]` (ms, see
//! [`crate::policy::predicted_ttft::TtftFeatures::parts`]) weighted by the unknown
//! multipliers `θ`: `y ≈ zᵀθ`. Each sample is divided by the seed's prediction
//! `s = Σ z` before it enters the filter (`z/s`, `y/s`), so the filter minimises
//! *relative* error: TTFT noise grows with TTFT, and a long prompt should not
//! outweigh a hundred short ones.
//!
//! Update (Ljung & Söderström, *Theory and Practice of Recursive Identification*,
//! 1983, §2.6; Åström & Wittenmark, *Adaptive Control*, 2nd ed., §2.2, eq. 2.21), with
//! forgetting factor `λ`:
//!
//! ```text
//! e = y − zᵀθ                      innovation (after winsorising y, below)
//! K = P z / (λ + zᵀ P z)           gain; λ > 0 and P ⪰ 0, so never a division by 0
//! θ ← θ + K e
//! P ← (P − K zᵀ P) / λ
//! ```
//!
//! The bounds:
//! - **outliers**, twice: `y` is winsorised to `[ŷ / r, r × ŷ]` around the current
//!   prediction `ŷ = zᵀθ` (a hard bound, `r` the configured `outlier_ratio`), and the
//!   innovation is then clipped to `±k σ` with `σ` a running mean of the clipped
//!   absolute innovations (Huber's ψ with a recursive scale estimate, as in the
//!   recursive least M-estimate filter of Zou, Chan & Ng, *IEEE Signal Processing
//!   Letters* 7(11), 2000; `k` = [`HUBER_K`]). Once converged, one request stuck
//!   behind a preemption moves `θ` by a hair; a real change grows `σ` within tens
//!   of samples and is followed;
//! - **windup**: a direction the data does not excite (no decodes on an idle rank, a
//!   single repeated feature vector) would see its variance grow by `1/λ` per sample;
//!   the trace of `P` is capped at [`TRACE_CAP`] (the bounded-trace forgetting of
//!   Salgado, Goodwin & Middleton, *Int. J. Control* 47(2), 1988);
//! - **range**: each multiplier is projected onto `[1/f, f]` after every update
//!   (parameter projection, Goodwin & Sin, *Adaptive Filtering, Prediction and
//!   Control*, 1984, §3.7), `f` the configured `max_factor`;
//! - **degenerate input**: a sample whose seed prediction is not a positive finite
//!   number (all-zero features, every constant 0), or whose `y` is not finite, is
//!   skipped; should `θ` or `P` ever stop being finite, the estimator resets to its
//!   seed.
//!
//! Cost: 3×3 arithmetic per sample, 96 bytes of state per rank.

/// Initial covariance of every multiplier: `P₀ = I`. With normalised samples (their
/// parts sum to 1) the seed weighs about as much as one observation.
const P0: f64 = 1.0;

/// Cap of `trace(P)`: 10 × the initial 3, so an unexcited multiplier's variance stays
/// bounded while an excited one converges.
pub const TRACE_CAP: f64 = 30.0 * P0 / 3.0;

/// Innovations beyond `HUBER_K` running scales are clipped.
pub const HUBER_K: f64 = 3.0;

/// Weight of the newest innovation in the running scale `σ`.
const SCALE_RATE: f64 = 0.05;

/// `σ` starts at 50% of the prediction (the seed may be far off) and never drops
/// below 1% (exact data would otherwise freeze the estimate).
const SCALE_INIT: f64 = 0.5;
const SCALE_FLOOR: f64 = 0.01;

/// How an estimator treats its samples (from [`super::CalibrationConfig`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Bounds {
    /// Forgetting factor `λ` in (0, 1].
    pub forgetting: f64,
    /// Multipliers stay in `[1/max_factor, max_factor]`.
    pub max_factor: f64,
    /// Observations are winsorised to `[ŷ / outlier_ratio, outlier_ratio × ŷ]`.
    pub outlier_ratio: f64,
}

/// Multipliers of the seed's prefill, step-base and decode parts, and their
/// covariance.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rls {
    theta: [f64; 3],
    p: [[f64; 3]; 3],
    /// Running scale of the (relative) innovations.
    scale: f64,
    samples: u64,
}

impl Default for Rls {
    /// The seed: every multiplier 1, `P = P₀ I`, no samples.
    fn default() -> Self {
        Self {
            theta: [1.0; 3],
            p: [[P0, 0.0, 0.0], [0.0, P0, 0.0], [0.0, 0.0, P0]],
            scale: SCALE_INIT,
            samples: 0,
        }
    }
}

impl Rls {
    /// The multipliers `[prefill, step base, decode]`.
    pub fn theta(&self) -> [f64; 3] {
        self.theta
    }

    /// Samples taken (skipped ones not counted).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// `trace(P)`, the total variance left (at most [`TRACE_CAP`]).
    pub fn covariance_trace(&self) -> f64 {
        self.p[0][0] + self.p[1][1] + self.p[2][2]
    }

    /// Takes one observation: the seed model's parts `z` (ms) and the observed TTFT
    /// `y` (ms). Returns whether it was used (see the module docs for when not).
    pub fn update(&mut self, z: [f64; 3], y: f64, b: &Bounds) -> bool {
        let s: f64 = z.iter().sum();
        if !(s.is_finite() && s > f64::MIN_POSITIVE && y.is_finite())
            || z.iter().any(|&v| !(v.is_finite() && v >= 0.0))
        {
            return false;
        }
        let z = z.map(|v| v / s);
        let predicted = dot(&z, &self.theta);
        // θ > 0 and z ≥ 0 with Σz = 1, so `predicted` ≥ min θ > 0.
        let y = (y / s).clamp(predicted / b.outlier_ratio, predicted * b.outlier_ratio);
        let bound = HUBER_K * self.scale;
        let error = (y - predicted).clamp(-bound, bound);
        self.scale = ((1.0 - SCALE_RATE) * self.scale + SCALE_RATE * error.abs()).max(SCALE_FLOOR);
        let pz = mat_vec(&self.p, &z);
        let denom = b.forgetting + dot(&z, &pz);
        let gain = pz.map(|v| v / denom);
        for (t, k) in self.theta.iter_mut().zip(gain) {
            *t += k * error;
        }
        for (row, k) in self.p.iter_mut().zip(gain) {
            for (v, q) in row.iter_mut().zip(pz) {
                *v = (*v - k * q) / b.forgetting;
            }
        }
        self.condition(b);
        self.samples += 1;
        true
    }

    /// Symmetrises `P`, caps its trace, projects `θ` onto the box, and resets to the
    /// seed if anything stopped being finite.
    fn condition(&mut self, b: &Bounds) {
        for i in 0..3 {
            for j in (i + 1)..3 {
                let m = 0.5 * (self.p[i][j] + self.p[j][i]);
                self.p[i][j] = m;
                self.p[j][i] = m;
            }
        }
        let trace = self.covariance_trace();
        if trace > TRACE_CAP {
            let k = TRACE_CAP / trace;
            self.p.iter_mut().flatten().for_each(|v| *v *= k);
        }
        let lo = 1.0 / b.max_factor;
        for t in &mut self.theta {
            *t = t.clamp(lo, b.max_factor);
        }
        let finite = self
            .theta
            .iter()
            .chain(self.p.iter().flatten())
            .all(|v| v.is_finite());
        if !finite || (0..3).any(|i| self.p[i][i] < 0.0) {
            let samples = self.samples;
            *self = Self::default();
            self.samples = samples;
            tracing::warn!("calibration estimator lost precision and was reset to its seed");
        }
    }
}

fn dot(a: &[f64; 3], b: &[f64; 3]) -> f64 {
    a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
}

fn mat_vec(m: &[[f64; 3]; 3], v: &[f64; 3]) -> [f64; 3] {
    [dot(&m[0], v), dot(&m[1], v), dot(&m[2], v)]
}
