//! Page hash vectors computed independently with Python's `hashlib` by
//! `tests/vectors/make_hash_vectors.py` (run it to regenerate; it implements the format from
//! its description, not from this crate's code). The SGLang vectors pin bit-exactness with
//! SGLang's `get_hash_str` chain; the namespaced ones pin our seed framing so stored L3 data
//! stays readable across releases.

use hicache_core::{DType, HashMode, KvKind, LayoutKind, Namespace, PageHash, PageHasher};

fn hex(h: &PageHash) -> String {
    h.to_hex()
}

#[test]
fn sglang_single_pages() {
    assert_eq!(
        hex(&PageHasher::hash_page(None, &[])),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    assert_eq!(
        hex(&PageHasher::hash_page(None, &[1, 2, 3, 4])),
        "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
    );
    assert_eq!(
        hex(&PageHasher::hash_page(None, &[u32::MAX, 0, 7])),
        "ef6bd321ac3b09a02f38cf9b78c0da6727cc3e4f4ed7d539de2ab8d49eb9eb7c"
    );
}

#[test]
fn sglang_chains() {
    let h = PageHasher::sglang(4).unwrap();
    let prior = PageHash::from_hex(&format!("{}01", "00".repeat(31))).unwrap();
    let toks: Vec<u32> = (0..10).collect();
    let got: Vec<String> = h.hash_pages(Some(prior), &toks).iter().map(hex).collect();
    assert_eq!(
        got,
        [
            "cf6d6615857c2b8f6975ec06325774369374128782a79f83f7e504d3acab2bc0",
            "53dbcac97167840f87d3d6c27551231089db34ba1a5a90240ef767cda4077e4e"
        ]
    );
    let h2 = PageHasher::sglang(2).unwrap();
    let start = h2.chain_start(None, None);
    let got: Vec<String> = h2
        .hash_pages(start.prior, &[5, 6, 7, 8, 9])
        .iter()
        .map(hex)
        .collect();
    assert_eq!(
        got,
        [
            "f1833c11f88585608c320b53224d2642b97af5fdb9cae59c13fcab53f37c4b06",
            "9898f51dbbcfa948be0cb772cf116a969cc014f58a4c89ad8120d0374d6eccb3"
        ]
    );
}

fn llama_ns() -> Namespace {
    Namespace::single_rank(
        "llama-3-8b@abc",
        DType::Bf16,
        LayoutKind::PageFirst,
        KvKind::Mha {
            heads: 8,
            head_dim: 128,
        },
        32,
        4,
    )
}

#[test]
fn namespace_digest_and_seeds() {
    let ns = llama_ns();
    assert_eq!(
        hex::encode(ns.digest()),
        "4fea29b6eab6111f8a3bf91db2859fea4e81895ba4669d33ac2a438100c4fa07"
    );
    let h = PageHasher::new(HashMode::Namespaced, &ns).unwrap();
    let plain = h.chain_start(None, None);
    assert_eq!(
        hex(&plain.prior.unwrap()),
        "752902b54522bcd4f1fb78154f35f9787b03f397866db3117d03577074c465b4"
    );
    assert_eq!(
        plain.namespace_id.to_hex(),
        "752902b54522bcd4f1fb78154f35f978"
    );
    let tenant = h.chain_start(Some("lora-a"), Some("tenant-7"));
    assert_eq!(
        hex(&tenant.prior.unwrap()),
        "a21b167ea10116566d04edb3f9d58c7b85866870e24eb5a3c8ae3c27f70cd0a0"
    );
    let toks: Vec<u32> = (0..8).collect();
    let got: Vec<String> = h.hash_pages(plain.prior, &toks).iter().map(hex).collect();
    assert_eq!(
        got,
        [
            "99e5243074eee3864f9a819b9d401a612c0ff5b607d1d3f8b31fff9651ac6200",
            "a02973b2337fdf7c0f9d9fef9fa037af6e6479a95ac1833c31afa97b0c5fa4ee"
        ]
    );
}
