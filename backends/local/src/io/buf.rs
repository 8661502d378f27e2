//! 4096-aligned heap buffers (O_DIRECT staging and bounce buffers for pages whose memory is
//! not aligned) and a small pool that reuses them.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use parking_lot::Mutex;

/// The alignment (address and length) of every [`AlignedBuf`]: the page size, which covers
/// every logical block size O_DIRECT asks for.
pub const ALIGN: usize = 4096;

/// A zero-initialised heap buffer whose address and length are multiples of 4096.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned heap memory (like a `Box<[u8]>`); shared access only
// hands out `&[u8]`.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; `&AlignedBuf` gives read-only access.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (rounded up to a multiple of 4096, at least 4096).
    pub fn zeroed(len: usize) -> Self {
        let len = len.div_ceil(ALIGN).max(1) * ALIGN;
        let layout = Layout::from_size_align(len, ALIGN).expect("4096-aligned layout");
        // SAFETY: `layout` has a non-zero size.
        let p = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        Self { ptr, len }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: at least [`ALIGN`] bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start address (for I/O requests).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self`, alive while `self`
        // is borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

impl std::fmt::Debug for BufPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufPool")
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, ALIGN).expect("as allocated");
        // SAFETY: allocated in `zeroed` with this very layout, freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// Reuses aligned buffers of equal length, keeping at most `max_bytes` idle.
#[derive(Default)]
pub struct BufPool {
    idle: Mutex<Vec<AlignedBuf>>,
    max_bytes: usize,
}

impl BufPool {
    /// A pool keeping up to `max_bytes` of idle buffers.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
            max_bytes,
        }
    }

    /// A buffer of `len` bytes rounded up to a multiple of [`ALIGN`]; contents unspecified.
    pub fn get(&self, len: usize) -> AlignedBuf {
        let len = len.div_ceil(ALIGN).max(1) * ALIGN;
        let mut idle = self.idle.lock();
        match idle.iter().position(|b| b.len() == len) {
            Some(i) => idle.swap_remove(i),
            None => AlignedBuf::zeroed(len),
        }
    }

    /// Returns a buffer for reuse.
    pub fn put(&self, buf: AlignedBuf) {
        let mut idle = self.idle.lock();
        let held: usize = idle.iter().map(|b| b.len()).sum();
        if held + buf.len() <= self.max_bytes {
            idle.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_reused() {
        let mut b = AlignedBuf::zeroed(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_mut_ptr() as usize % ALIGN, 0);
        assert!(b.iter().all(|x| *x == 0));
        b[8191] = 7;
        let pool = BufPool::new(16384);
        let p = b.as_mut_ptr();
        pool.put(b);
        let mut again = pool.get(8192);
        assert_eq!(again.as_mut_ptr(), p);
        assert_eq!(pool.get(4096).len(), 4096);
    }
}
