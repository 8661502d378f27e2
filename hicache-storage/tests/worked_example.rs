//! The worked example of `docs/backend-authors.md`: a complete backend written only against
//! the public API of `hicache-storage`, as an out-of-tree crate would, registered in a
//! registry and passing the conformance suite. Keep the two in step.

use std::collections::HashMap;
use std::sync::Arc;

use hicache_storage::backend::bump;
use hicache_storage::checksum::checksum;
use hicache_storage::conformance::Harness;
use hicache_storage::{
    BackendContext, BackendFactory, BackendInfo, CommonConfig, ConfigFields, EvictionPolicy,
    Evictor, PageBuf, PageBufMut, PageError, PageKey, PageMeta, PageOutcome, Registry, Result,
    StatsCounters, Storage, StorageConfig, StorageStats, async_trait, check_batch,
};
use parking_lot::Mutex;

/// One stored page: its metadata, its checksum, its bytes.
struct Page {
    meta: PageMeta,
    sum: u64,
    data: Vec<u8>,
}

struct State {
    pages: HashMap<PageKey, Page>,
    order: Box<dyn Evictor<PageKey>>,
    bytes: u64,
}

/// "Tiny": an in-process key-value backend with a capacity.
pub struct Tiny {
    capacity: u64,
    state: Mutex<State>,
    counters: StatsCounters,
}

impl Tiny {
    /// An empty store of `capacity` bytes.
    pub fn new(capacity: u64, eviction: EvictionPolicy) -> Self {
        Self {
            capacity,
            state: Mutex::new(State {
                pages: HashMap::new(),
                order: eviction.build(),
                bytes: 0,
            }),
            counters: StatsCounters::default(),
        }
    }

    /// Test hook: damage a stored page the way a bad disk would.
    pub fn flip_a_byte(&self, key: &PageKey) -> bool {
        let mut st = self.state.lock();
        match st.pages.get_mut(key) {
            Some(p) => {
                p.data[0] ^= 1;
                true
            }
            None => false,
        }
    }

    fn set_one(&self, key: &PageKey, src: &PageBuf<'_>) -> PageOutcome {
        if src.is_empty() {
            return PageOutcome::Failed(PageError::EmptyPage);
        }
        if src.len() as u64 > self.capacity {
            let max = self.capacity as usize;
            return PageOutcome::Failed(PageError::TooLarge {
                len: src.len(),
                max,
            });
        }
        let data = src.to_vec();
        let page = Page {
            meta: src.meta(),
            sum: checksum(&data),
            data,
        };
        let mut st = self.state.lock();
        if st.pages.get(key).is_some_and(|p| p.meta == page.meta) {
            st.order.touch(key);
            return PageOutcome::Present; // keys name contents: nothing to rewrite
        }
        if let Some(old) = st.pages.remove(key) {
            st.bytes -= old.data.len() as u64;
            st.order.remove(key);
        }
        while st.bytes + page.data.len() as u64 > self.capacity {
            let Some(victim) = st.order.pop_victim() else {
                break;
            };
            if let Some(v) = st.pages.remove(&victim) {
                st.bytes -= v.data.len() as u64;
                bump(&self.counters.evicted_pages, 1);
                bump(&self.counters.evicted_bytes, v.data.len() as u64);
            }
        }
        st.bytes += page.data.len() as u64;
        st.pages.insert(*key, page);
        st.order.insert(*key);
        PageOutcome::Stored
    }

    fn get_one(&self, key: &PageKey, dst: &mut PageBufMut<'_>) -> PageOutcome {
        let mut st = self.state.lock();
        let Some(page) = st.pages.get(key) else {
            return PageOutcome::Miss;
        };
        if page.meta != dst.meta() {
            bump(&self.counters.meta_mismatches, 1);
            return PageOutcome::Miss;
        }
        if checksum(&page.data) != page.sum {
            let bad = st.pages.remove(key).expect("just found");
            st.bytes -= bad.data.len() as u64;
            st.order.remove(key);
            return PageOutcome::Corrupt; // never hand out bad bytes
        }
        dst.copy_from(&page.data);
        st.order.touch(key);
        PageOutcome::Hit
    }
}

#[async_trait]
impl Storage for Tiny {
    fn info(&self) -> BackendInfo {
        let mut info = BackendInfo::new("tiny", 256);
        info.capacity_bytes = Some(self.capacity);
        info.max_page_bytes = self.capacity as usize;
        info
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize> {
        check_batch("batch_exists", 256, keys.len(), keys.len())?;
        let st = self.state.lock();
        let hits = keys.iter().take_while(|k| st.pages.contains_key(k)).count();
        self.counters
            .record_exists((hits + 1).min(keys.len()), hits);
        Ok(hits)
    }

    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Vec<PageOutcome>> {
        check_batch("batch_get", 256, keys.len(), dst.len())?;
        let out: Vec<_> = keys
            .iter()
            .zip(dst.iter_mut())
            .map(|(k, d)| self.get_one(k, d))
            .collect();
        self.counters.record_get(&out, dst.iter().map(|d| d.len()));
        Ok(out)
    }

    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        check_batch("batch_set", 256, keys.len(), src.len())?;
        let out: Vec<_> = keys
            .iter()
            .zip(src)
            .map(|(k, p)| self.set_one(k, p))
            .collect();
        self.counters.record_set(&out, src.iter().map(|p| p.len()));
        Ok(out)
    }

    async fn delete(&self, keys: &[PageKey]) -> Result<usize> {
        let mut st = self.state.lock();
        let mut n = 0;
        for k in keys {
            if let Some(p) = st.pages.remove(k) {
                st.bytes -= p.data.len() as u64;
                st.order.remove(k);
                n += 1;
            }
        }
        bump(&self.counters.deleted_pages, n as u64);
        Ok(n)
    }

    fn stats(&self) -> StorageStats {
        let st = self.state.lock();
        self.counters
            .snapshot(st.pages.len() as u64, st.bytes, Some(self.capacity))
    }
}

/// Opens `tiny` from a storage config: `{"backend": "tiny", "capacity": "1gib", "eviction": "lru"}`.
pub struct TinyFactory;

#[async_trait]
impl BackendFactory for TinyFactory {
    fn name(&self) -> &str {
        "tiny"
    }

    async fn open(
        &self,
        common: &CommonConfig,
        mut fields: ConfigFields,
        _ctx: &BackendContext,
    ) -> Result<Arc<dyn Storage>> {
        let eviction = fields.choice("eviction", "lru", &EvictionPolicy::NAMES)?;
        fields.finish()?; // unknown fields are errors
        let capacity = common.capacity_bytes.unwrap_or(1 << 30);
        let eviction = EvictionPolicy::parse(eviction).unwrap_or_default();
        Ok(Arc::new(Tiny::new(capacity, eviction)))
    }
}

// ---- the backend crate's tests ---------------------------------------------------------------

struct TinyHarness;

#[async_trait]
impl Harness for TinyHarness {
    type Backend = Tiny;

    async fn open(&self, capacity_bytes: Option<u64>) -> Result<Arc<Tiny>> {
        let capacity = capacity_bytes.unwrap_or(256 << 20);
        Ok(Arc::new(Tiny::new(capacity, EvictionPolicy::Lru)))
    }

    async fn corrupt(&self, backend: &Tiny, key: &PageKey) -> Result<bool> {
        Ok(backend.flip_a_byte(key))
    }
}

hicache_storage::conformance_tests!(TinyHarness, not_persistent);

#[tokio::test]
async fn registers_and_opens_from_a_config() {
    let registry = Registry::with_builtins();
    registry.register(TinyFactory).unwrap();
    let config = StorageConfig::parse(Some("tiny"), Some(r#"{"capacity": "64MiB"}"#)).unwrap();
    let storage = registry
        .open(&config, &BackendContext::default())
        .await
        .unwrap();
    assert_eq!(storage.info().capacity_bytes, Some(64 << 20));
    let bad = StorageConfig::parse(Some("tiny"), Some(r#"{"colour": 1}"#)).unwrap();
    let e = registry
        .open(&bad, &BackendContext::default())
        .await
        .err()
        .unwrap();
    assert!(e.to_string().contains("colour"));
}
