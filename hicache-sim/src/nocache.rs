//! The baseline without prefix caching (SGLang with `--disable-radix-cache`): every prompt is
//! computed in full and device pages are returned when a request finishes. The "no cache"
//! column of the report is this cache run through the same engine and workload.

use crate::cache::{
    Admission, CacheError, CacheResult, CacheStats, CacheUnderTest, DeviceSlot, PrefetchStatus,
    RequestId,
};

/// A device page allocator and nothing else.
#[derive(Debug)]
pub struct NoCache {
    page_size: usize,
    device_pages: usize,
    free: Vec<DeviceSlot>,
    stats: CacheStats,
}

impl NoCache {
    /// `device_pages` pages of `page_size` tokens, `page_bytes` bytes each.
    pub fn new(page_size: usize, device_pages: usize, page_bytes: u64) -> Self {
        Self {
            page_size,
            device_pages,
            // Popped from the back: slot 0 first.
            free: (0..device_pages as u32).rev().map(DeviceSlot).collect(),
            stats: CacheStats {
                page_bytes,
                ..CacheStats::default()
            },
        }
    }

    /// Pages not held by a running request.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }
}

impl CacheUnderTest for NoCache {
    fn page_size(&self) -> usize {
        self.page_size
    }

    fn device_pages(&self) -> usize {
        self.device_pages
    }

    fn arrive(&mut self, _req: RequestId, _tokens: &[u32]) -> CacheResult<()> {
        Ok(())
    }

    fn poll(&mut self) -> CacheResult<()> {
        Ok(())
    }

    fn prefetch_status(&mut self, _req: RequestId) -> CacheResult<PrefetchStatus> {
        Ok(PrefetchStatus::Ready { l3_pages: 0 })
    }

    fn admit(
        &mut self,
        _req: RequestId,
        tokens: &[u32],
        new_tokens: usize,
    ) -> CacheResult<Option<Admission>> {
        let pages = (tokens.len() + new_tokens).div_ceil(self.page_size);
        if pages > self.free.len() {
            return Ok(None);
        }
        let new_slots = self.free.split_off(self.free.len() - pages);
        self.stats.metrics.request_tokens += tokens.len() as u64;
        Ok(Some(Admission {
            new_slots,
            ..Admission::default()
        }))
    }

    fn start_loading(&mut self) -> CacheResult<Option<usize>> {
        Ok(None)
    }

    fn wait_layer(&mut self, idx: usize, _layer: usize) -> CacheResult<()> {
        Err(CacheError(format!(
            "wait_layer({idx}): the no-cache baseline never loads"
        )))
    }

    fn cache_finished(
        &mut self,
        req: RequestId,
        tokens: &[u32],
        slots: &[DeviceSlot],
    ) -> CacheResult<()> {
        if slots.len() != tokens.len().div_ceil(self.page_size) {
            return Err(CacheError(format!(
                "request {req}: {} slots for {} tokens",
                slots.len(),
                tokens.len()
            )));
        }
        if self.free.len() + slots.len() > self.device_pages {
            return Err(CacheError(format!(
                "request {req}: more pages returned than were taken"
            )));
        }
        self.free.extend(slots.iter().rev());
        Ok(())
    }

    fn shutdown(&mut self) -> CacheResult<()> {
        Ok(())
    }

    fn stats(&self) -> CacheStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_come_back_when_requests_finish() {
        let mut c = NoCache::new(4, 10, 100);
        let a = c.admit(1, &[1; 9], 3).unwrap().unwrap();
        assert_eq!(a.new_slots.len(), 3);
        assert_eq!(a.prefix_pages(), 0);
        assert_eq!(c.free_pages(), 7);
        assert!(
            c.admit(2, &[1; 30], 0).unwrap().is_none(),
            "8 pages > 7 free"
        );
        c.cache_finished(1, &[1; 12], &a.new_slots).unwrap();
        assert_eq!(c.free_pages(), 10);
        assert!(c.cache_finished(1, &[1; 12], &a.new_slots).is_err());
        assert!(c.cache_finished(1, &[1; 5], &a.new_slots).is_err());
        assert_eq!(c.stats().metrics.request_tokens, 9);
        assert_eq!(c.stats().page_bytes, 100);
    }
}
