//! Intrusive LRU lists of the auxiliary components (SGLang's `UnifiedLRUList`), threaded
//! through node indices. The most recently used node is next to the head; eviction scans
//! from the tail.
//!
//! Invariant kept here: a node is in a component's list iff that component is present on it
//! (the tree calls [`Lru::insert_mru`] / [`Lru::remove`] wherever presence changes).

use super::node::NIL;

const HEAD: u32 = u32::MAX - 1;
const TAIL: u32 = u32::MAX - 2;

/// One doubly linked list over node indices.
#[derive(Clone, Debug)]
pub(crate) struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    head_next: u32,
    tail_prev: u32,
    len: usize,
}

impl Default for Lru {
    fn default() -> Self {
        Self {
            prev: Vec::new(),
            next: Vec::new(),
            head_next: TAIL,
            tail_prev: HEAD,
            len: 0,
        }
    }
}

impl Lru {
    fn grow(&mut self, i: u32) {
        let need = i as usize + 1;
        if self.prev.len() < need {
            self.prev.resize(need, NIL);
            self.next.resize(need, NIL);
        }
    }

    fn get_next(&self, i: u32) -> u32 {
        if i == HEAD {
            self.head_next
        } else {
            self.next[i as usize]
        }
    }

    fn get_prev(&self, i: u32) -> u32 {
        if i == TAIL {
            self.tail_prev
        } else {
            self.prev[i as usize]
        }
    }

    fn set_next(&mut self, i: u32, v: u32) {
        if i == HEAD {
            self.head_next = v;
        } else {
            self.next[i as usize] = v;
        }
    }

    fn set_prev(&mut self, i: u32, v: u32) {
        if i == TAIL {
            self.tail_prev = v;
        } else {
            self.prev[i as usize] = v;
        }
    }

    /// Whether node `i` is in the list.
    pub(crate) fn contains(&self, i: u32) -> bool {
        (i as usize) < self.prev.len() && self.prev[i as usize] != NIL
    }

    /// Number of nodes in the list.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn link_after(&mut self, at: u32, i: u32) {
        self.grow(i);
        let nx = self.get_next(at);
        self.prev[i as usize] = at;
        self.next[i as usize] = nx;
        self.set_prev(nx, i);
        self.set_next(at, i);
        self.len += 1;
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        self.set_next(p, n);
        self.set_prev(n, p);
        self.prev[i as usize] = NIL;
        self.next[i as usize] = NIL;
        self.len -= 1;
    }

    /// Inserts `i` (not in the list) as most recently used.
    pub(crate) fn insert_mru(&mut self, i: u32) {
        debug_assert!(!self.contains(i));
        self.link_after(HEAD, i);
    }

    /// Inserts `i` (not in the list) right after `at` (which is), i.e. just less recent.
    pub(crate) fn insert_after(&mut self, at: u32, i: u32) {
        debug_assert!(self.contains(at) && !self.contains(i));
        self.link_after(at, i);
    }

    /// Removes `i` if it is in the list.
    pub(crate) fn remove(&mut self, i: u32) {
        if self.contains(i) {
            self.unlink(i);
        }
    }

    /// Moves `i` (in the list) to most recently used.
    pub(crate) fn touch(&mut self, i: u32) {
        self.unlink(i);
        self.link_after(HEAD, i);
    }

    /// Moves `i` (in the list) right after `at` (`None`: the head).
    pub(crate) fn move_after(&mut self, at: Option<u32>, i: u32) {
        self.unlink(i);
        self.link_after(at.unwrap_or(HEAD), i);
    }

    /// The node before `i` (more recent) that `unlocked` accepts, scanning towards the head;
    /// `None` at the head. `i = None` starts at the tail.
    pub(crate) fn prev_unlocked(
        &self,
        i: Option<u32>,
        unlocked: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let mut x = self.get_prev(i.unwrap_or(TAIL));
        while x != HEAD {
            if unlocked(x) {
                return Some(x);
            }
            x = self.get_prev(x);
        }
        None
    }

    /// Nodes from most to least recent (for tests).
    #[cfg(test)]
    pub(crate) fn order(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        let mut x = self.head_next;
        while x != TAIL {
            out.push(x);
            x = self.next[x as usize];
        }
        out
    }
}
