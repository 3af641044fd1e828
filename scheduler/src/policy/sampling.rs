//! Turning per-candidate costs into one choice: argmin with uniformly random
//! tie-breaking, or softmax sampling at a temperature.
//!
//! Shared by every cost-based policy. O(candidates), no allocation; the RNG is the
//! scheduler's seeded `StdRng`, so choices are reproducible.
//!
//! Temperature `T > 0`: costs are min-max normalized to `[0, 1]`
//! (`n = (cost − min) / (max − min)`) and a candidate is drawn with probability
//! `softmax(−n / T)`. Normalizing makes `T` independent of prompt length and load: at
//! `T = 1` the worst candidate is `e` times less likely than the best; as `T → ∞` the
//! choice approaches uniform. NVIDIA Dynamo's KV router samples the same way
//! (`--router-temperature`).

use rand::Rng;
use rand::rngs::StdRng;

/// Index of the lowest `(primary, secondary)` key, comparing lexicographically; exact
/// ties are broken uniformly at random. `keys` must not be empty.
pub fn pick_min(rng: &mut StdRng, keys: &[(f64, f64)]) -> usize {
    let best = keys
        .iter()
        .copied()
        .fold((f64::INFINITY, f64::INFINITY), |acc, k| {
            if k.0 < acc.0 || (k.0 == acc.0 && k.1 < acc.1) {
                k
            } else {
                acc
            }
        });
    let tied = keys.iter().filter(|&&k| k == best).count();
    let nth = if tied > 1 {
        rng.random_range(0..tied)
    } else {
        0
    };
    keys.iter()
        .enumerate()
        .filter(|&(_, &k)| k == best)
        .nth(nth)
        .map_or(0, |(i, _)| i)
}

/// Picks by `costs` at `temperature`: argmin (random among exact ties) at 0 or when
/// every cost is equal, softmax sampling of normalized costs above 0. `costs` must
/// not be empty.
pub fn pick_by_cost(rng: &mut StdRng, costs: &[f64], temperature: f64) -> usize {
    let (min, max) = costs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &c| {
            (lo.min(c), hi.max(c))
        });
    if temperature > 0.0 && max > min {
        softmax_sample(rng, costs, min, max, temperature)
    } else {
        let tied = costs.iter().filter(|&&c| c == min).count();
        let nth = if tied > 1 {
            rng.random_range(0..tied)
        } else {
            0
        };
        costs
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c == min)
            .nth(nth)
            .map_or(0, |(i, _)| i)
    }
}

/// Samples with probability `softmax(−(cost − min) / (max − min) / t)`. Requires
/// `max > min` and `t > 0`. Exponents lie in `[−1/t, 0]`, so the weights cannot
/// overflow and the best candidate always has weight 1.
fn softmax_sample(rng: &mut StdRng, costs: &[f64], min: f64, max: f64, t: f64) -> usize {
    let weight = |c: f64| (-((c - min) / (max - min)) / t).exp();
    let total: f64 = costs.iter().map(|&c| weight(c)).sum();
    let mut draw = rng.random::<f64>() * total;
    let mut best = 0;
    for (i, &c) in costs.iter().enumerate() {
        if c == min {
            best = i;
        }
        let w = weight(c);
        if draw < w {
            return i;
        }
        draw -= w;
    }
    // Only reachable through floating-point rounding of `total`.
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn histogram(costs: &[f64], t: f64, trials: usize) -> Vec<usize> {
        let mut rng = StdRng::seed_from_u64(7);
        let mut counts = vec![0; costs.len()];
        for _ in 0..trials {
            counts[pick_by_cost(&mut rng, costs, t)] += 1;
        }
        counts
    }

    #[test]
    fn zero_temperature_is_argmin_with_random_ties() {
        assert_eq!(histogram(&[9.0, 3.0, 4.0], 0.0, 500), vec![0, 500, 0]);
        let counts = histogram(&[5.0, 5.0, 6.0], 0.0, 2000);
        assert_eq!(counts[2], 0);
        assert!(counts[0] > 800 && counts[1] > 800, "{counts:?}");
    }

    #[test]
    fn positive_temperature_follows_the_softmax_of_normalized_costs() {
        // Costs 9, 3, 4 normalize to 1, 0, 1/6; at T=0.5 the weights are
        // e^-2 ≈ 0.135, 1, e^-1/3 ≈ 0.717: probabilities ≈ 0.073, 0.540, 0.387.
        let counts = histogram(&[9.0, 3.0, 4.0], 0.5, 4000);
        assert!((140..450).contains(&counts[0]), "{counts:?}");
        assert!((1950..2400).contains(&counts[1]), "{counts:?}");
        assert!((1350..1750).contains(&counts[2]), "{counts:?}");
        // Very high temperature: roughly uniform.
        for c in histogram(&[30.0, 1.0, 0.0, 7.0], 1e6, 8000) {
            assert!((1600..2400).contains(&c), "{c}");
        }
        // Equal costs at any temperature: uniform over all.
        let counts = histogram(&[2.0, 2.0], 3.0, 1000);
        assert!(counts[0] > 350 && counts[1] > 350, "{counts:?}");
    }

    #[test]
    fn same_seed_same_choices() {
        let run = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..50)
                .map(|_| pick_by_cost(&mut rng, &[9.0, 3.0, 4.0], 0.7))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
    }

    #[test]
    fn pick_min_orders_by_primary_then_secondary() {
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(pick_min(&mut rng, &[(2.0, 0.0), (1.0, 5.0), (1.0, 3.0)]), 2);
        let mut counts = [0; 3];
        for _ in 0..900 {
            counts[pick_min(&mut rng, &[(1.0, 1.0), (1.0, 1.0), (1.0, 2.0)])] += 1;
        }
        assert_eq!(counts[2], 0);
        assert!(counts[0] > 350 && counts[1] > 350, "{counts:?}");
    }
}
