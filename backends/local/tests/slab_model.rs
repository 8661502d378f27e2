//! The backend against a naive model (a map of key → page length) over random sequences of
//! sets (of several size classes), reads, deletes and restarts.

#[path = "slab_common/mod.rs"]
mod common;

use std::collections::HashMap;

use common::{test_dir, test_opts};
use hicache_backend_local::slab::UringBackend;
use hicache_storage::pattern::{check_page, namespace, page_bytes, page_key};
use hicache_storage::{LayoutKind, PageBuf, PageKey, PageOutcome, Storage, StorageExt};
use proptest::prelude::*;

const LENS: [usize; 3] = [4096, 10_000, 65_536];

#[derive(Debug, Clone)]
enum Op {
    /// Set keys `k..k+n` with length class `c`.
    Set(u8, u8, usize),
    Get(u8),
    Del(u8),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..12, 1u8..4, 0usize..3).prop_map(|(k, n, c)| Op::Set(k, n, c)),
        3 => (0u8..12).prop_map(Op::Get),
        1 => (0u8..12).prop_map(Op::Del),
        1 => Just(Op::Reopen),
    ]
}

fn key(k: u8) -> PageKey {
    page_key(namespace(4), 77, k as u64)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn matches_a_naive_model(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .unwrap();
        let dir = test_dir();
        let opts = test_opts(dir.path());
        rt.block_on(async {
            let mut s = UringBackend::open(opts.clone()).unwrap();
            let mut model: HashMap<u8, usize> = HashMap::new();
            for op in ops {
                match op {
                    Op::Set(k, n, c) => {
                        let len = LENS[c];
                        let ks: Vec<PageKey> = (k..k + n).map(key).collect();
                        let pages: Vec<Vec<u8>> = ks.iter().map(|k| page_bytes(k, len)).collect();
                        let bufs: Vec<PageBuf<'_>> = pages
                            .iter()
                            .map(|p| PageBuf::contiguous(LayoutKind::PageFirst, p))
                            .collect();
                        let out = s.batch_set(&ks, &bufs).await.unwrap();
                        for (i, o) in out.iter().enumerate() {
                            let k = k + i as u8;
                            let want = if model.get(&k) == Some(&len) {
                                PageOutcome::Present
                            } else {
                                PageOutcome::Stored
                            };
                            prop_assert_eq!(o, &want, "set of key {}", k);
                            model.insert(k, len);
                        }
                    }
                    Op::Get(k) => {
                        for len in LENS {
                            let got = s.get(LayoutKind::PageFirst, len, key(k)).await.unwrap();
                            match got {
                                Some(b) => {
                                    prop_assert_eq!(model.get(&k), Some(&len));
                                    prop_assert!(check_page(&key(k), &b), "wrong bytes");
                                }
                                None => prop_assert_ne!(model.get(&k), Some(&len)),
                            }
                        }
                    }
                    Op::Del(k) => {
                        let n = s.delete(&[key(k)]).await.unwrap();
                        prop_assert_eq!(n, usize::from(model.remove(&k).is_some()));
                    }
                    Op::Reopen => {
                        drop(s);
                        s = UringBackend::open(opts.clone()).unwrap();
                        prop_assert_eq!(s.open_report().discarded_records, 0);
                    }
                }
                let st = s.stats();
                prop_assert_eq!(st.pages, model.len() as u64);
                prop_assert_eq!(st.bytes, model.values().map(|v| *v as u64).sum::<u64>());
                let all: Vec<PageKey> = (0..12).map(key).collect();
                let run = (0..12u8).take_while(|k| model.contains_key(k)).count();
                prop_assert_eq!(s.batch_exists(&all).await.unwrap(), run);
            }
            Ok(())
        })?;
    }
}
