//! Poisson arrivals: exponential gaps between intended submission times, from a seeded RNG so
//! a run can be repeated. The sum of independent Poisson streams is a Poisson stream, so each
//! connection runs its own at its share of the step's rate.
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

pub struct PoissonArrivals {
    rng: SmallRng,
    mean_gap_ns: f64,
    next_ns: f64,
}

impl PoissonArrivals {
    /// Arrivals at `rate_per_s` on average, the first one gap after `start_ns`.
    pub fn new(rate_per_s: f64, start_ns: u64, seed: u64) -> PoissonArrivals {
        let mut a = PoissonArrivals {
            rng: SmallRng::seed_from_u64(seed),
            mean_gap_ns: 1e9 / rate_per_s.max(1e-9),
            next_ns: start_ns as f64,
        };
        a.next_ns += a.gap_ns();
        a
    }

    fn gap_ns(&mut self) -> f64 {
        // 1 - U lies in (0, 1], so the logarithm is finite.
        let u: f64 = 1.0 - self.rng.gen::<f64>();
        -u.ln() * self.mean_gap_ns
    }

    /// The intended time of the next arrival, without consuming it.
    pub fn peek_ns(&self) -> u64 {
        self.next_ns as u64
    }

    /// Consumes the next arrival and returns its intended time.
    pub fn take_ns(&mut self) -> u64 {
        let t = self.next_ns as u64;
        self.next_ns += self.gap_ns();
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exponential gaps: mean 1/rate, and standard deviation equal to the mean (coefficient of
    /// variation 1); counts per window have variance equal to their mean (dispersion index 1).
    #[test]
    fn gaps_are_exponential_and_counts_are_poisson() {
        let rate_per_s = 10_000.0;
        let mut a = PoissonArrivals::new(rate_per_s, 0, 42);
        let n = 200_000;
        let mut prev = 0u64;
        let mut gaps = Vec::with_capacity(n);
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            let t = a.take_ns();
            gaps.push((t - prev) as f64);
            times.push(t);
            prev = t;
        }
        let mean = gaps.iter().sum::<f64>() / n as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        let cv = var.sqrt() / mean;
        assert!((mean / 100_000.0 - 1.0).abs() < 0.01, "mean gap {mean} ns");
        assert!((cv - 1.0).abs() < 0.02, "coefficient of variation {cv}");

        // Arrivals per 1 ms window: mean 10, variance 10.
        let window_ns = 1_000_000u64;
        let windows = (times[n - 1] / window_ns) as usize;
        let mut counts = vec![0f64; windows];
        for t in &times {
            if let Some(c) = counts.get_mut((t / window_ns) as usize) {
                *c += 1.0;
            }
        }
        let m = counts.iter().sum::<f64>() / windows as f64;
        let v = counts.iter().map(|c| (c - m).powi(2)).sum::<f64>() / (windows - 1) as f64;
        assert!((m - 10.0).abs() < 0.2, "mean count {m}");
        assert!((v / m - 1.0).abs() < 0.06, "dispersion index {}", v / m);
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let mut a = PoissonArrivals::new(500.0, 7, 1);
        let mut b = PoissonArrivals::new(500.0, 7, 1);
        let mut c = PoissonArrivals::new(500.0, 7, 2);
        let xs: Vec<u64> = (0..100).map(|_| a.take_ns()).collect();
        let ys: Vec<u64> = (0..100).map(|_| b.take_ns()).collect();
        let zs: Vec<u64> = (0..100).map(|_| c.take_ns()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
        assert!(xs[0] > 7 && xs.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(a.peek_ns(), b.peek_ns());
    }
}
