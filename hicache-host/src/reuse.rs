//! [`Shelf`]: dropped mappings kept for the next request of the same shape, in processes that
//! build and drop many pools of the same size one after another (the benches' runs).
//!
//! Populating a fresh multi-GiB mapping is the kernel's slowest path on a machine whose free
//! memory sits in the page cache: it reclaims and compacts for every 2 MiB page (measured on
//! our 2-core VMs at 0.13–0.4 GB/s, against 3.5 GB/s for the same mapping populated again from
//! pages the process had just unmapped). A shelf keeps a dropped mapping, still populated, and
//! hands it to the next request of the same kind that it fits (the request's length at most its
//! own, the smallest such: its unused tail costs nothing the shelf did not hold already); to keep a newly dropped one over the
//! budget, it gives back the ones dropped longest ago.
//!
//! Invariants kept here: the items held never add up to more than the budget; a budget of 0
//! (the default) holds nothing, so a process that never opts in behaves as without a shelf;
//! `items` is in the order the items were offered (oldest first).

use parking_lot::Mutex;

/// The kind of item a request can take (for mappings: the page policy asked for); an item
/// fits a request of its kind whose length is at most its own.
pub(crate) type ShelfKey = u8;

struct Held<T> {
    key: ShelfKey,
    bytes: usize,
    item: T,
}

struct ShelfState<T> {
    budget: usize,
    held_bytes: usize,
    items: Vec<Held<T>>,
}

/// Dropped items (mappings) kept for reuse, within a byte budget (see the module docs).
pub(crate) struct Shelf<T> {
    state: Mutex<ShelfState<T>>,
}

impl<T> Shelf<T> {
    /// An empty shelf with no budget (it keeps nothing).
    pub(crate) const fn new() -> Self {
        Self {
            state: Mutex::new(ShelfState {
                budget: 0,
                held_bytes: 0,
                items: Vec::new(),
            }),
        }
    }

    /// Sets the budget; items over it are returned for the caller to drop (outside the lock).
    pub(crate) fn set_budget(&self, budget: usize) -> Vec<T> {
        let mut s = self.state.lock();
        s.budget = budget;
        let mut evicted = Vec::new();
        while s.held_bytes > s.budget {
            if s.items.is_empty() {
                break;
            }
            let h = s.items.remove(0);
            s.held_bytes -= h.bytes;
            evicted.push(h.item);
        }
        evicted
    }

    /// Bytes held.
    pub(crate) fn held_bytes(&self) -> usize {
        self.state.lock().held_bytes
    }

    /// Keeps `item` (`bytes` long), giving back the items kept longest ago as far as needed to
    /// stay within the budget; an item larger than the whole budget is given back itself.
    pub(crate) fn offer(&self, key: ShelfKey, bytes: usize, item: T) -> Vec<T> {
        let mut s = self.state.lock();
        if bytes > s.budget {
            return vec![item];
        }
        let mut evicted = Vec::new();
        while s.held_bytes + bytes > s.budget && !s.items.is_empty() {
            let h = s.items.remove(0);
            s.held_bytes -= h.bytes;
            evicted.push(h.item);
        }
        s.held_bytes += bytes;
        s.items.push(Held { key, bytes, item });
        evicted
    }

    /// The smallest item kept under `key` whose length is at least `len` (of those,
    /// the one kept most recently), if any.
    pub(crate) fn take(&self, key: ShelfKey, len: usize) -> Option<T> {
        let mut s = self.state.lock();
        let fits = |h: &Held<T>| h.key == key && h.bytes >= len;
        let (i, _) = s
            .items
            .iter()
            .enumerate()
            .rev()
            .filter(|(_, h)| fits(h))
            .min_by_key(|(_, h)| h.bytes)?;
        let h = s.items.remove(i);
        s.held_bytes -= h.bytes;
        Some(h.item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_budget_keeps_nothing() {
        let shelf = Shelf::new();
        assert_eq!(shelf.offer(0, 8, "a"), vec!["a"]);
        assert_eq!(shelf.held_bytes(), 0);
        assert_eq!(shelf.take(0, 8), None);
    }

    #[test]
    fn a_kept_item_goes_to_the_same_key_only() {
        let shelf = Shelf::new();
        assert!(shelf.set_budget(100).is_empty());
        assert!(shelf.offer(0, 40, "a").is_empty());
        assert!(shelf.offer(1, 40, "b").is_empty());
        assert_eq!(shelf.take(0, 64), None, "too small for the request");
        assert_eq!(shelf.held_bytes(), 80);
        assert_eq!(shelf.take(1, 40), Some("b"));
        assert_eq!(shelf.held_bytes(), 40);
        assert_eq!(shelf.take(0, 1), Some("a"), "a smaller request fits");
        assert_eq!(shelf.held_bytes(), 0);
    }

    #[test]
    fn over_the_budget_the_oldest_go_first() {
        let shelf = Shelf::new();
        shelf.set_budget(100);
        assert!(shelf.offer(0, 30, 1).is_empty());
        assert!(shelf.offer(0, 30, 2).is_empty());
        assert!(shelf.offer(1, 30, 3).is_empty());
        assert_eq!(shelf.offer(0, 50, 4), vec![1, 2]);
        assert_eq!(shelf.held_bytes(), 80);
        assert_eq!(shelf.offer(0, 101, 5), vec![5], "larger than the budget");
        assert_eq!(shelf.set_budget(60), vec![3]);
        assert_eq!(shelf.set_budget(0), vec![4]);
        assert_eq!(shelf.held_bytes(), 0);
    }

    #[test]
    fn the_smallest_fit_then_the_most_recent_is_taken() {
        let shelf = Shelf::new();
        shelf.set_budget(100);
        assert!(shelf.offer(0, 10, "old").is_empty());
        assert!(shelf.offer(0, 10, "new").is_empty());
        assert!(shelf.offer(0, 12, "larger").is_empty());
        assert_eq!(shelf.take(0, 8), Some("new"));
        assert_eq!(shelf.take(0, 8), Some("old"));
        assert_eq!(shelf.take(0, 8), Some("larger"));
    }
}
