//! [`PageMarks`]: a reusable bitmap for finding the first repeated page of a list, used by
//! the transfer engine's destination check and by the cache's check of the slots an engine
//! hands back. The cost is the list's length, never the pool's size: nothing is allocated,
//! sorted or zeroed per check once the bitmap has grown to the pool.

/// One bit per page of a pool, kept between checks.
///
/// Invariant: between checks every bit is clear ([`PageMarks::first_repeat`] clears exactly
/// the bits it set before it returns), so a check never sees another check's marks.
#[derive(Debug, Default)]
pub struct PageMarks {
    bits: Vec<u64>,
}

impl PageMarks {
    /// The position of the first of `items` whose page (`page` of it) already occurs at an
    /// earlier position, among pages below `capacity`: a page at or above it is not a page
    /// of the pool and is skipped (callers report those themselves).
    pub fn first_repeat<T>(
        &mut self,
        items: &[T],
        page: impl Fn(&T) -> u32,
        capacity: usize,
    ) -> Option<usize> {
        let words = capacity.div_ceil(64);
        if self.bits.len() < words {
            self.bits.resize(words, 0);
        }
        let mut repeat = None;
        let mut marked = items.len();
        for (position, item) in items.iter().enumerate() {
            let p = page(item) as usize;
            if p >= capacity {
                continue;
            }
            let (w, b) = (p / 64, 1u64 << (p % 64));
            if self.bits[w] & b != 0 {
                repeat = Some(position);
                marked = position;
                break;
            }
            self.bits[w] |= b;
        }
        // Keep the invariant: clear exactly the bits this call set (positions before
        // `marked`; a repeat found at `marked` set nothing new, and the pages before it are
        // distinct).
        for item in &items[..marked] {
            let p = page(item) as usize;
            if p < capacity {
                self.bits[p / 64] &= !(1u64 << (p % 64));
            }
        }
        repeat
    }

    /// Whether every bit is clear (the invariant), for tests.
    #[cfg(test)]
    pub(crate) fn is_clear(&self) -> bool {
        self.bits.iter().all(|&w| w == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::PageMarks;

    fn first(m: &mut PageMarks, pages: &[u32], cap: usize) -> Option<usize> {
        m.first_repeat(pages, |&p| p, cap)
    }

    #[test]
    fn the_first_repeat_is_found_and_the_marks_are_left_clear() {
        // One bitmap reused across checks and pool sizes, as its users reuse it.
        let mut m = PageMarks::default();
        for cap in [16, 64, 65, 1000, 4096] {
            assert_eq!(first(&mut m, &[3, 1, 2], cap), None);
            assert_eq!(first(&mut m, &[5, 1, 7, 1, 5], cap), Some(3));
            assert_eq!(first(&mut m, &[5, 6, 5, 6], cap), Some(2));
            assert_eq!(first(&mut m, &[], cap), None);
            assert_eq!(first(&mut m, &[7, 7], cap), Some(1));
            // Out of the pool: not marked (reported by the caller).
            assert_eq!(first(&mut m, &[9999, 9999, 4], cap), None);
            assert!(m.is_clear(), "marks left set (cap {cap})");
            // Marks of an earlier check never count in the next one.
            assert_eq!(first(&mut m, &[1, 2, 3, 5, 6, 7], cap), None);
        }
        assert_eq!(first(&mut m, &[4095, 0, 4095], 4096), Some(2));
        assert!(m.is_clear());
    }
}
