//! SNIA PTS steady-state test: over the last `WINDOW_ROUNDS` rounds, the tracked metric's
//! range (max - min) is at most 20% of its mean, and the least-squares line's rise across the
//! window is at most 10% of the mean.

use serde::Serialize;

pub const WINDOW_ROUNDS: usize = 5;
const MAX_RANGE_FRACTION: f64 = 0.20;
const MAX_SLOPE_RISE_FRACTION: f64 = 0.10;

/// The measurement window the criterion was evaluated on.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Window {
    /// 1-based round number of the last round in the window.
    pub last_round: usize,
    pub mean: f64,
    pub min: f64,
    pub max: f64,
    /// (max - min) / mean.
    pub range_fraction: f64,
    /// |least-squares slope| * (rounds - 1) / mean.
    pub slope_rise_fraction: f64,
    pub steady: bool,
}

/// Evaluates the window ending at the last value of `rounds` (None until there are enough).
pub fn evaluate(rounds: &[f64]) -> Option<Window> {
    if rounds.len() < WINDOW_ROUNDS {
        return None;
    }
    let w = &rounds[rounds.len() - WINDOW_ROUNDS..];
    let n = w.len() as f64;
    let mean = w.iter().sum::<f64>() / n;
    let min = w.iter().copied().fold(f64::INFINITY, f64::min);
    let max = w.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let x_mean = (n - 1.0) / 2.0;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (i, y) in w.iter().enumerate() {
        let dx = i as f64 - x_mean;
        sxy += dx * (y - mean);
        sxx += dx * dx;
    }
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    // A zero mean (nothing moved) can never be called steady.
    let (range_fraction, slope_rise_fraction) =
        if mean > 0.0 { ((max - min) / mean, slope.abs() * (n - 1.0) / mean) } else { (f64::INFINITY, f64::INFINITY) };
    Some(Window {
        last_round: rounds.len(),
        mean,
        min,
        max,
        range_fraction,
        slope_rise_fraction,
        steady: range_fraction <= MAX_RANGE_FRACTION && slope_rise_fraction <= MAX_SLOPE_RISE_FRACTION,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_is_steady() {
        let w = evaluate(&[50.0, 100.0, 101.0, 99.0, 100.0, 100.5]).unwrap();
        assert!(w.steady, "{w:?}");
        assert_eq!(w.last_round, 6);
    }

    #[test]
    fn descent_is_not_steady() {
        // Range 16% (passes) but a steady decline: rise over the window 16% (fails).
        let w = evaluate(&[108.0, 104.0, 100.0, 96.0, 92.0]).unwrap();
        assert!(w.range_fraction <= 0.2);
        assert!(!w.steady, "{w:?}");
    }

    #[test]
    fn noisy_is_not_steady() {
        assert!(!evaluate(&[100.0, 60.0, 100.0, 60.0, 100.0]).unwrap().steady);
        assert!(evaluate(&[1.0, 2.0, 3.0, 4.0]).is_none());
        assert!(!evaluate(&[0.0; 5]).unwrap().steady);
    }
}
