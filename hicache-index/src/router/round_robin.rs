//! `round-robin`: instances in turn, blind to cache and load (the baseline every gain is
//! measured against).

/// The next instance in turn.
#[derive(Clone, Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl RoundRobin {
    /// A turn that gives `next` (modulo the instances) first.
    pub fn starting_at(next: usize) -> Self {
        Self { next }
    }

    /// The position given next (before the modulo of the instance count).
    pub fn next(&self) -> usize {
        self.next
    }

    /// The instance for the next request out of `n` (≥ 1).
    pub fn pick(&mut self, n: usize) -> usize {
        let i = self.next % n.max(1);
        self.next = i + 1;
        i
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn turns_cycle_over_every_instance() {
        let mut rr = super::RoundRobin::default();
        let picks: Vec<usize> = (0..7).map(|_| rr.pick(3)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0]);
    }
}
