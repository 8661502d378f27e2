//! How long a wait in wall time (copies, L3 operations, a prefetch) pauses between polls.

use std::time::Duration;

/// The pause of a short wait, and the first pauses of every wait.
pub const MIN_PAUSE: Duration = Duration::from_micros(50);

/// The longest pause.
pub const MAX_PAUSE: Duration = Duration::from_micros(250);

/// The pause before the next poll of a wait that has lasted `waited`: an eighth of it, between
/// [`MIN_PAUSE`] and [`MAX_PAUSE`]. A short wait (a write-through copy of a few pages) polls
/// every 50 µs, as every wait did before; a long one (an L3 batch of 8 MiB pages takes tens of
/// milliseconds) wakes at most a fifth as often, which on a 2-core machine leaves the copies
/// and checksums the polling thread's switches took (8.5 % of the main job's CPU samples), and
/// ends at most 250 µs, and an eighth of its length, after what it waits for.
pub fn pause(waited: Duration) -> Duration {
    (waited / 8).clamp(MIN_PAUSE, MAX_PAUSE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_grow_with_the_wait_within_bounds() {
        assert_eq!(pause(Duration::ZERO), MIN_PAUSE);
        assert_eq!(pause(Duration::from_micros(400)), MIN_PAUSE);
        assert_eq!(
            pause(Duration::from_micros(1200)),
            Duration::from_micros(150)
        );
        assert_eq!(pause(Duration::from_secs(3)), MAX_PAUSE);
    }
}
