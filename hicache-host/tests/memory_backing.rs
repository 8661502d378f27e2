//! The mapping's backing as the machine provides it (huge pages or the clean fallback).

use hicache_host::{Backing, HostMemory, HugePagePolicy};

#[test]
fn auto_backing_is_reported_and_usable() {
    let m = HostMemory::new(8 << 20, HugePagePolicy::Auto).unwrap();
    println!("backing of an 8 MiB Auto mapping: {:?}", m.backing());
    if let Backing::Transparent { huge_bytes } = m.backing() {
        assert!(huge_bytes <= m.len());
    }
    // SAFETY: inside the mapping, exclusively ours.
    let s = unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), m.len()) };
    s.fill(0xAB);
    assert!(s.iter().all(|&b| b == 0xAB));
}

#[test]
fn require_fails_cleanly_or_gives_huge_pages() {
    match HostMemory::new(2 << 20, HugePagePolicy::Require) {
        Ok(m) => assert_ne!(m.backing(), Backing::Small),
        Err(e) => assert!(e.to_string().contains("huge pages"), "{e}"),
    }
}
