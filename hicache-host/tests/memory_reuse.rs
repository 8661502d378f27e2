//! `reuse_dropped_mappings`: a dropped mapping goes to the next request of the same shape, a
//! request of another shape unmaps what is kept, and the budget bounds what is kept. Its own
//! test binary: the shelf is process-wide state.

use hicache_host::memory::mem_available;
use hicache_host::{HostMemory, HugePagePolicy, reuse_dropped_mappings};

#[test]
fn dropped_mappings_are_reused_by_shape_within_the_budget() {
    reuse_dropped_mappings(8 << 20);
    let a = HostMemory::new(4 << 20, HugePagePolicy::Auto).unwrap();
    let addr = a.as_ptr() as usize;
    // SAFETY: inside the mapping, exclusively ours.
    unsafe { std::ptr::write_volatile(a.as_ptr(), 7) };
    drop(a);
    assert!(mem_available().unwrap() >= 4 << 20);

    // Same shape: the kept mapping, as its owner left it.
    let b = HostMemory::new(4 << 20, HugePagePolicy::Auto).unwrap();
    assert_eq!(b.as_ptr() as usize, addr);
    // SAFETY: inside the mapping, exclusively ours.
    assert_eq!(unsafe { std::ptr::read_volatile(b.as_ptr()) }, 7);

    // Another policy is another shape: a fresh, zero-filled mapping.
    let c = HostMemory::new(4 << 20, HugePagePolicy::Off).unwrap();
    assert_ne!(c.as_ptr() as usize, addr);
    // SAFETY: inside the mapping, exclusively ours.
    let bytes = unsafe { std::slice::from_raw_parts(c.as_ptr(), c.len()) };
    assert!(bytes.iter().all(|&x| x == 0));

    // Over the budget (4 + 4 + 4 MiB > 8 MiB): the first dropped (b, Auto) is unmapped.
    let d = HostMemory::new(4 << 20, HugePagePolicy::Off).unwrap();
    let (c_addr, d_addr) = (c.as_ptr() as usize, d.as_ptr() as usize);
    drop((b, c, d));
    let e = HostMemory::new(4 << 20, HugePagePolicy::Off).unwrap();
    let f = HostMemory::new(4 << 20, HugePagePolicy::Off).unwrap();
    let mut reused = [e.as_ptr() as usize, f.as_ptr() as usize];
    reused.sort();
    let mut kept = [c_addr, d_addr];
    kept.sort();
    assert_eq!(reused, kept);
    let a2 = HostMemory::new(4 << 20, HugePagePolicy::Auto).unwrap();
    // SAFETY: inside the mapping, exclusively ours.
    let bytes = unsafe { std::slice::from_raw_parts(a2.as_ptr(), a2.len()) };
    assert!(
        bytes.iter().all(|&x| x == 0),
        "b was unmapped: a fresh mapping"
    );
    drop(a2);

    // Off again: nothing is kept.
    reuse_dropped_mappings(0);
    let e_addr = e.as_ptr() as usize;
    drop(e);
    let g = HostMemory::new(4 << 20, HugePagePolicy::Off).unwrap();
    // SAFETY: inside the mapping, exclusively ours.
    let bytes = unsafe { std::slice::from_raw_parts(g.as_ptr(), g.len()) };
    assert!(
        bytes.iter().all(|&x| x == 0),
        "a fresh mapping at {e_addr:#x} or elsewhere"
    );
    drop((f, g));
}
