//! The estimator of one rank: recursive least squares with exponential forgetting
//! over two multipliers of the configured step-time model, bounded four ways.
//!
//! Model: an observed TTFT `y` (routed → `prefill_done`, in ms) is the configured
//! model's two parts `z = [prefill, per step]` (ms, see
//! [`crate::policy::predicted_ttft::TtftFeatures::parts`]) weighted by the unknown
//! multipliers `θ`: `y ≈ zᵀθ`.
//!
//! Why two and not one per constant: a step's fixed cost and its decode cost are paid
//! together, once per step, so their parts differ only through the rank's decode load
//! (`R`, `D`), which moves slowly. A filter given both splits their sum arbitrarily
//! along that near-collinear direction and drifts there under forgetting (measured in
//! the lab: with the engines' step base 4× the router's, the step-base multiplier stayed
//! near 1 and the decode one absorbed the difference). The
//! prefill part, which grows with the prompt while the per-step part does not (most
//! requests fit in one step), is well separated from it. Each sample is divided by the seed's prediction
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
//! Cost: 2×2 arithmetic per sample, 64 bytes of state per rank.

/// Number of learned multipliers: prefill and per step.
pub const DIM: usize = 2;

/// Initial covariance of every multiplier: `P₀ = I`. With normalised samples (their
/// parts sum to 1) the seed weighs about as much as one observation.
const P0: f64 = 1.0;

/// Cap of `trace(P)`: 10 × the initial `DIM`, so an unexcited multiplier's variance stays
/// bounded while an excited one converges.
pub const TRACE_CAP: f64 = 10.0 * P0 * DIM as f64;

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

/// Multipliers of the seed's prefill and per-step parts, and their covariance.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rls {
    theta: [f64; DIM],
    p: [[f64; DIM]; DIM],
    /// Running scale of the (relative) innovations.
    scale: f64,
    samples: u64,
}

impl Default for Rls {
    /// The seed: every multiplier 1, `P = P₀ I`, no samples.
    fn default() -> Self {
        Self {
            theta: [1.0; DIM],
            p: std::array::from_fn(|i| std::array::from_fn(|j| if i == j { P0 } else { 0.0 })),
            scale: SCALE_INIT,
            samples: 0,
        }
    }
}

impl Rls {
    /// The multipliers `[prefill, per step]`.
    pub fn theta(&self) -> [f64; DIM] {
        self.theta
    }

    /// Samples taken (skipped ones not counted).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// `trace(P)`, the total variance left (at most [`TRACE_CAP`]).
    pub fn covariance_trace(&self) -> f64 {
        (0..DIM).map(|i| self.p[i][i]).sum()
    }

    /// Takes one observation: the seed model's parts `z` (ms) and the observed TTFT
    /// `y` (ms). Returns whether it was used (see the module docs for when not).
    pub fn update(&mut self, z: [f64; DIM], y: f64, b: &Bounds) -> bool {
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
        for i in 0..DIM {
            for j in (i + 1)..DIM {
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
        if !finite || (0..DIM).any(|i| self.p[i][i] < 0.0) {
            let samples = self.samples;
            *self = Self::default();
            self.samples = samples;
            tracing::warn!("calibration estimator lost precision and was reset to its seed");
        }
    }
}

fn dot(a: &[f64; DIM], b: &[f64; DIM]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn mat_vec(m: &[[f64; DIM]; DIM], v: &[f64; DIM]) -> [f64; DIM] {
    std::array::from_fn(|i| dot(&m[i], v))
}
