//! L3 lifecycle options shared by the local backends (file, uring): page expiry (`ttl_s`) and
//! background eviction between two watermarks (`high_watermark`, `low_watermark`), parsed
//! strictly from a backend's extra-config fields, and the [`Clock`] expiry is measured with.
//!
//! - `ttl_s` (integer seconds, at least 1; default none): a page older than this since its
//!   write is a miss for `batch_exists` and `batch_get`, and is reclaimed (deleted) by the
//!   backend. `0` is refused: it would expire every page as it is written.
//! - `high_watermark` / `low_watermark` (fractions of the capacity, default none): once stored
//!   bytes pass `high`, a background task evicts (in the backend's eviction order) until they
//!   are at most `low`, without holding up batches. `high` in (0, 1]; `low` in [0, high)
//!   (default `0.9 × high`); `low` without `high`, or `low ≥ high`, is refused naming the field.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Condvar, Mutex};

use crate::config::ConfigFields;
use crate::error::{Result, StorageError};

/// Stored-bytes fractions of the capacity that start and stop background eviction.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Watermarks {
    /// Eviction starts when stored bytes exceed `high × capacity`.
    pub high: f64,
    /// Eviction stops once stored bytes are at most `low × capacity`.
    pub low: f64,
}

impl Watermarks {
    /// Checks `0 < high ≤ 1` and `0 ≤ low < high`; the error names the field at fault.
    pub fn new(high: f64, low: f64) -> std::result::Result<Self, (&'static str, String)> {
        if !(high > 0.0 && high <= 1.0) {
            return Err(("high_watermark", "must be above 0 and at most 1".into()));
        }
        if !(low >= 0.0 && low < high) {
            return Err((
                "low_watermark",
                format!("must be at least 0 and below high_watermark ({high})"),
            ));
        }
        Ok(Self { high, low })
    }

    /// The byte thresholds `(high, low)` for `capacity` bytes.
    pub fn bytes(&self, capacity: u64) -> (u64, u64) {
        let at = |f: f64| (capacity as f64 * f).floor() as u64;
        (at(self.high), at(self.low))
    }
}

/// The lifecycle options of a local backend. See the [module documentation](self).
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct Lifecycle {
    /// Pages expire this long after their write (`ttl_s`); `None`: never.
    pub ttl: Option<Duration>,
    /// Background eviction thresholds; `None`: evict only when a write needs room.
    pub watermarks: Option<Watermarks>,
}

impl Lifecycle {
    /// Takes `ttl_s`, `high_watermark` and `low_watermark` out of a backend's fields (strict:
    /// every refusal names its field).
    pub fn take_from(f: &mut ConfigFields) -> Result<Self> {
        let ttl = match f.opt_u64("ttl_s", 0..=u64::MAX)? {
            Some(0) => {
                return Err(StorageError::config(
                    f.scope(),
                    "ttl_s",
                    "0",
                    "must be at least 1 second (0 would expire every page as it is written; \
                     omit ttl_s for pages that never expire)",
                ));
            }
            t => t.map(Duration::from_secs),
        };
        let high = f.opt_f64("high_watermark", 0.0..=1.0)?;
        let low = f.opt_f64("low_watermark", 0.0..=1.0)?;
        let watermarks = match (high, low) {
            (None, None) => None,
            (None, Some(l)) => {
                return Err(StorageError::config(
                    f.scope(),
                    "low_watermark",
                    l.to_string(),
                    "needs high_watermark (the fill level that starts eviction)",
                ));
            }
            (Some(h), low) => {
                let low = low.unwrap_or(h * 0.9);
                Some(Watermarks::new(h, low).map_err(|(field, reason)| {
                    let value = if field == "high_watermark" { h } else { low };
                    StorageError::config(f.scope(), field, value.to_string(), reason)
                })?)
            }
        };
        Ok(Self { ttl, watermarks })
    }
}

/// Wall-clock time in Unix nanoseconds, as page expiry sees it. [`Clock::system`] in
/// production; [`Clock::manual`] in tests, which advance it by hand instead of sleeping.
#[derive(Clone, Debug)]
pub struct Clock(Option<Arc<AtomicU64>>);

impl Default for Clock {
    fn default() -> Self {
        Self::system()
    }
}

impl Clock {
    /// The system's real-time clock.
    pub fn system() -> Self {
        Self(None)
    }

    /// A clock that stands at `start_unix_nanos` until [`advance`](Self::advance)d.
    pub fn manual(start_unix_nanos: u64) -> Self {
        Self(Some(Arc::new(AtomicU64::new(start_unix_nanos))))
    }

    /// Now, in Unix nanoseconds (0 if the system clock is before 1970).
    pub fn now(&self) -> u64 {
        match &self.0 {
            Some(t) => t.load(Ordering::Acquire),
            None => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
        }
    }

    /// Moves a manual clock forward (a system clock ignores it).
    pub fn advance(&self, by: Duration) {
        if let Some(t) = &self.0 {
            t.fetch_add(by.as_nanos() as u64, Ordering::AcqRel);
        }
    }

    /// Whether a page written at `written` (Unix nanoseconds) is expired under `ttl` now.
    pub fn expired(&self, written: u64, ttl: Option<Duration>) -> bool {
        ttl.is_some_and(|ttl| self.now().saturating_sub(written) >= ttl.as_nanos() as u64)
    }
}

/// A backend's background reclaim thread: runs the backend's reclaim pass (evict down to the
/// low watermark, drop expired pages) when woken, and every `period` if one is given, never
/// on a caller's thread, so batches do not wait for it.
///
/// Invariants: at most one pass runs at a time (one thread); a [`wake`](Self::wake) during a
/// pass causes another pass after it, so no wake is lost; dropping the reclaimer stops the
/// thread and joins it (a pass in progress finishes first), so a backend that drops its
/// reclaimer before its directory lock never deletes after giving up the directory.
pub struct Reclaimer {
    shared: Arc<ReclaimShared>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct ReclaimState {
    wake: bool,
    stop: bool,
    running: bool,
    passes: u64,
}

#[derive(Default)]
struct ReclaimShared {
    state: Mutex<ReclaimState>,
    cv: Condvar,
}

impl std::fmt::Debug for Reclaimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reclaimer")
            .field("passes", &self.passes())
            .finish_non_exhaustive()
    }
}

impl Reclaimer {
    /// Starts the thread (named `name`) that runs `pass` when woken and every `period`.
    pub fn spawn(
        name: &str,
        period: Option<Duration>,
        mut pass: impl FnMut() + Send + 'static,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(ReclaimShared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                loop {
                    {
                        let mut st = s.state.lock();
                        let deadline = period.map(|p| Instant::now() + p);
                        while !st.wake && !st.stop {
                            match deadline {
                                Some(d) => {
                                    if s.cv.wait_until(&mut st, d).timed_out() {
                                        break;
                                    }
                                }
                                None => s.cv.wait(&mut st),
                            }
                        }
                        if st.stop {
                            return;
                        }
                        st.wake = false;
                        st.running = true;
                    }
                    pass();
                    let mut st = s.state.lock();
                    st.running = false;
                    st.passes += 1;
                    s.cv.notify_all();
                }
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Asks for a pass (returns at once).
    pub fn wake(&self) {
        let mut st = self.shared.state.lock();
        st.wake = true;
        self.shared.cv.notify_all();
    }

    /// Passes completed so far.
    pub fn passes(&self) -> u64 {
        self.shared.state.lock().passes
    }

    /// Waits, at most `timeout`, until no pass is asked for or running; returns whether that
    /// state was reached (for tools and tests: a bounded wait, not a sleep).
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.state.lock();
        while st.wake || st.running {
            if self.shared.cv.wait_until(&mut st, deadline).timed_out() {
                return !(st.wake || st.running);
            }
        }
        true
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        {
            let mut st = self.shared.state.lock();
            st.stop = true;
            self.shared.cv.notify_all();
        }
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("storage reclaim thread panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StorageConfig;

    fn parse(extra: &str) -> Result<Lifecycle> {
        let mut c = StorageConfig::parse(Some("file"), Some(extra))?;
        let l = Lifecycle::take_from(&mut c.backend_fields)?;
        c.backend_fields.finish()?;
        Ok(l)
    }

    #[test]
    fn parses_and_defaults() {
        assert_eq!(parse("{}").unwrap(), Lifecycle::default());
        let l = parse(r#"{"ttl_s": 3600, "high_watermark": 0.8, "low_watermark": 0.5}"#).unwrap();
        assert_eq!(l.ttl, Some(Duration::from_secs(3600)));
        assert_eq!(
            l.watermarks,
            Some(Watermarks {
                high: 0.8,
                low: 0.5
            })
        );
        let l = parse(r#"{"high_watermark": 1}"#).unwrap();
        assert_eq!(
            l.watermarks,
            Some(Watermarks {
                high: 1.0,
                low: 0.9
            })
        );
        assert_eq!(Watermarks::new(0.8, 0.5).unwrap().bytes(1000), (800, 500));
    }

    #[test]
    fn every_refusal_names_its_field() {
        for (extra, field) in [
            (r#"{"ttl_s": 0}"#, "ttl_s"),
            (r#"{"ttl_s": -1}"#, "ttl_s"),
            (r#"{"ttl_s": "1h"}"#, "ttl_s"),
            (r#"{"high_watermark": 0}"#, "high_watermark"),
            (r#"{"high_watermark": 1.5}"#, "high_watermark"),
            (r#"{"high_watermark": "x"}"#, "high_watermark"),
            (r#"{"low_watermark": 0.5}"#, "low_watermark"),
            (
                r#"{"high_watermark": 0.5, "low_watermark": 0.5}"#,
                "low_watermark",
            ),
            (
                r#"{"high_watermark": 0.5, "low_watermark": 0.9}"#,
                "low_watermark",
            ),
            (
                r#"{"high_watermark": 0.5, "low_watermark": -0.1}"#,
                "low_watermark",
            ),
        ] {
            let e = parse(extra).unwrap_err().to_string();
            assert!(e.contains(&format!("`{field}`")), "{extra}: {e}");
        }
        let e = parse(r#"{"ttl_s": 0}"#).unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
    }

    #[test]
    fn manual_clock_and_expiry() {
        let c = Clock::manual(1_000);
        let ttl = Some(Duration::from_nanos(500));
        assert!(!c.expired(1_000, ttl));
        c.advance(Duration::from_nanos(499));
        assert!(!c.expired(1_000, ttl));
        c.advance(Duration::from_nanos(1));
        assert!(c.expired(1_000, ttl));
        assert!(!c.expired(0, None), "no ttl: never expires");
        assert!(Clock::system().now() > 1_600_000_000_000_000_000);
    }

    #[test]
    fn reclaimer_runs_on_wake_and_stops_on_drop() {
        let count = Arc::new(AtomicU64::new(0));
        let c = count.clone();
        let r = Reclaimer::spawn("test-reclaim", None, move || {
            c.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        assert!(r.wait_idle(Duration::from_secs(30)));
        assert_eq!(r.passes(), 0, "no pass without a wake");
        r.wake();
        assert!(r.wait_idle(Duration::from_secs(30)));
        assert_eq!((r.passes(), count.load(Ordering::SeqCst)), (1, 1));
        r.wake();
        r.wake();
        assert!(r.wait_idle(Duration::from_secs(30)));
        assert!(
            (2..=3).contains(&r.passes()),
            "wakes are never lost, may merge"
        );
        drop(r);
        let n = count.load(Ordering::SeqCst);
        assert!((2..=3).contains(&n));
    }
}
