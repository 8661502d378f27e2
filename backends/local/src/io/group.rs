//! [`GroupCommit`]: merging the durability barriers of concurrent batches.
//!
//! Each batch, once its data is written, hands its commit work (what to sync, which records
//! to append) to [`GroupCommit::run`]. If no commit is running, it leads: it takes every item
//! queued so far (its own and those of batches that arrived meanwhile) and runs them as one
//! group, one set of syncs for all; otherwise it waits for a leader to run its item. A batch
//! arriving while a group runs is queued for the next group. So with several batches in
//! flight, one `fdatasync` (and one index-log sync) serves several of them.
//!
//! # Invariants
//! 1. **Acknowledged means durable.** [`run`](GroupCommit::run) returns an item's result only
//!    after the group that held it ran to the end (its syncs returned); a caller acknowledges
//!    its pages only from that result.
//! 2. **Every item runs once.** An item is taken from the queue by exactly one leader and its
//!    result delivered to exactly its caller.
//! 3. **No lost wake-ups.** Leadership is handed back under the lock and every waiter is woken
//!    when a group ends, so a queued item always finds a leader (its own caller at worst).
//!    A leader that panics poisons the group commit: its waiters panic too rather than wait
//!    forever.

use std::collections::HashMap;

use parking_lot::{Condvar, Mutex};

struct State<T, R> {
    queue: Vec<(u64, T)>,
    done: HashMap<u64, R>,
    next: u64,
    leading: bool,
    poisoned: bool,
    groups: u64,
    items: u64,
}

/// Merges concurrent commits into groups. See the [module docs](self).
pub struct GroupCommit<T, R> {
    state: Mutex<State<T, R>>,
    cv: Condvar,
}

impl<T, R> Default for GroupCommit<T, R> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                queue: Vec::new(),
                done: HashMap::new(),
                next: 0,
                leading: false,
                poisoned: false,
                groups: 0,
                items: 0,
            }),
            cv: Condvar::new(),
        }
    }
}

impl<T, R> std::fmt::Debug for GroupCommit<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (groups, items) = self.stats();
        f.debug_struct("GroupCommit")
            .field("groups", &groups)
            .field("items", &items)
            .finish()
    }
}

/// Hands leadership back (and poisons on unwind) however the leader leaves.
struct Lead<'a, T, R> {
    gc: &'a GroupCommit<T, R>,
    finished: bool,
}

impl<T, R> Drop for Lead<'_, T, R> {
    fn drop(&mut self) {
        let mut st = self.gc.state.lock();
        st.leading = false;
        if !self.finished {
            st.poisoned = true;
        }
        drop(st);
        self.gc.cv.notify_all();
    }
}

impl<T, R> GroupCommit<T, R> {
    /// Runs `item` in a group: as its leader with `commit` (which gets the group's items, in
    /// arrival order, and returns one result per item, in that order), or by waiting for
    /// another caller's leader. Returns this item's result (invariant 1). Blocks.
    pub fn run(&self, item: T, commit: impl FnOnce(Vec<T>) -> Vec<R>) -> R {
        let mut st = self.state.lock();
        let id = st.next;
        st.next += 1;
        st.queue.push((id, item));
        loop {
            assert!(!st.poisoned, "group commit: a leader panicked");
            if let Some(r) = st.done.remove(&id) {
                return r;
            }
            if !st.leading {
                break;
            }
            self.cv.wait(&mut st);
        }
        // Lead one group: every item queued now, this one among them.
        st.leading = true;
        let group = std::mem::take(&mut st.queue);
        drop(st);
        let mut lead = Lead {
            gc: self,
            finished: false,
        };
        let (ids, items): (Vec<u64>, Vec<T>) = group.into_iter().unzip();
        let n = ids.len();
        let results = commit(items);
        assert_eq!(results.len(), n, "group commit: one result per item");
        let mut st = self.state.lock();
        st.groups += 1;
        st.items += n as u64;
        let mut mine = None;
        for (i, r) in ids.into_iter().zip(results) {
            if i == id {
                mine = Some(r);
            } else {
                st.done.insert(i, r);
            }
        }
        drop(st);
        lead.finished = true;
        drop(lead);
        mine.expect("the leader's own item is in its group")
    }

    /// Groups run and items committed so far: `items / groups` is the mean group size.
    pub fn stats(&self) -> (u64, u64) {
        let st = self.state.lock();
        (st.groups, st.items)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn a_lone_item_is_its_own_group() {
        let gc = GroupCommit::<u32, u32>::default();
        assert_eq!(gc.run(5, |v| v.into_iter().map(|x| x * 2).collect()), 10);
        assert_eq!(gc.stats(), (1, 1));
    }

    /// Many threads: every caller gets its own item's result, each item is committed once,
    /// and (with a leader held inside its commit while the others queue) items are merged.
    #[test]
    fn concurrent_items_are_merged_and_each_gets_its_result() {
        let gc = Arc::new(GroupCommit::<usize, usize>::default());
        let committed = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(std::sync::Barrier::new(9));
        let first = {
            let (gc, committed, gate) = (gc.clone(), committed.clone(), gate.clone());
            std::thread::spawn(move || {
                gc.run(100, |v| {
                    // Hold the group open until the 8 others are queued behind it.
                    gate.wait();
                    while gc_queued(&gc) < 8 {
                        std::thread::yield_now();
                    }
                    committed.fetch_add(v.len(), Ordering::SeqCst);
                    v.into_iter().map(|x| x + 1).collect()
                })
            })
        };
        let others: Vec<_> = (0..8)
            .map(|i| {
                let (gc, committed, gate) = (gc.clone(), committed.clone(), gate.clone());
                std::thread::spawn(move || {
                    gate.wait();
                    gc.run(i, |v| {
                        committed.fetch_add(v.len(), Ordering::SeqCst);
                        v.into_iter().map(|x| x + 1).collect()
                    })
                })
            })
            .collect();
        assert_eq!(first.join().unwrap(), 101);
        for (i, t) in others.into_iter().enumerate() {
            assert_eq!(t.join().unwrap(), i + 1);
        }
        assert_eq!(committed.load(Ordering::SeqCst), 9, "each item once");
        let (groups, items) = gc.stats();
        assert_eq!(
            (groups, items),
            (2, 9),
            "the 8 waiting items ran as one group"
        );
    }

    fn gc_queued<T, R>(gc: &GroupCommit<T, R>) -> usize {
        gc.state.lock().queue.len()
    }
}
