use super::*;

fn toks(r: std::ops::Range<u32>) -> Vec<u32> {
    r.collect()
}

#[test]
fn full_only_match_insert_evict() {
    let mut t = UnifiedTree::new(UnifiedConfig::full(4)).unwrap();
    let k = toks(0..16);
    let m = t.match_prefix(&k).unwrap();
    assert_eq!(m.device_prefix_len, 0);
    let r = t.insert(&k, &InsertParams::default()).unwrap();
    assert_eq!(r.prefix_len, 0);
    assert_eq!(t.size(Component::Full), 16);
    let m = t.match_prefix(&k[..10]).unwrap();
    assert_eq!(m.device_prefix_len, 8);
    t.check_invariants().unwrap();
    let e = t.evict(EvictRequest {
        full: 1,
        ..Default::default()
    });
    assert_eq!(e.full, 8, "the split-off tail leaf goes first");
    t.check_invariants().unwrap();
}
