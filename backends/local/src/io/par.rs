//! Spreading a batch's page I/O over threads.
//!
//! The async methods of the backend borrow the caller's page buffers, so the I/O must finish
//! before the method returns. [`blocking`] runs the work on the calling thread while telling a
//! multi-threaded tokio runtime to move its other tasks elsewhere (`block_in_place`), and
//! [`par_map`] fans the pages of a batch out over scoped threads, so a 128-page batch keeps
//! many requests in flight instead of one serial loop. Scoped threads end before the call
//! returns, so no thread outlives the borrowed buffers.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs blocking work from async code: via `block_in_place` on a multi-threaded runtime,
/// directly otherwise (current-thread runtime, or no runtime).
pub fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Applies `f` to every item on up to `threads` threads; results in item order.
pub fn par_map<T: Send, R: Send>(
    threads: usize,
    items: Vec<T>,
    f: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    let n = items.len();
    let workers = threads.min(n);
    if workers <= 1 {
        return items.into_iter().map(f).collect();
    }
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    let results: Vec<Mutex<Option<R>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let item = slots[i].lock().take().expect("each slot taken once");
                    *results[i].lock() = Some(f(item));
                }
            });
        }
    });
    results
        .into_iter()
        .map(|r| r.into_inner().expect("every slot produced a result"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_order() {
        let out = par_map(4, (0..100).collect(), |i: u32| i * 2);
        assert_eq!(out, (0..100).map(|i| i * 2).collect::<Vec<_>>());
        assert_eq!(par_map(8, vec![5], |i: u32| i), vec![5]);
        assert!(par_map(8, Vec::<u32>::new(), |i| i).is_empty());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn blocking_works_on_both_runtimes() {
        assert_eq!(blocking(|| 3), 3);
    }
}
