//! [`StorageExt`]: an owned-bytes convenience layer over [`Storage`] for simple callers (tools,
//! tests, engines without a pinned pool). It splits any number of pages into batches of the
//! backend's `max_batch`, so callers need not know the limit.

use async_trait::async_trait;
use bytes::Bytes;
use hicache_core::{LayoutKind, PageKey};

use crate::backend::Storage;
use crate::error::Result;
use crate::page::{PageBuf, PageBufMut, PageOutcome};

/// Convenience methods on every [`Storage`], with owned buffers and automatic batching.
#[async_trait]
pub trait StorageExt: Storage {
    /// Length of the leading run of `keys` present, over any number of keys (stops at the
    /// first short batch).
    async fn exists_prefix(&self, keys: &[PageKey]) -> Result<usize> {
        let max = self.info().max_batch.max(1);
        let mut total = 0;
        for chunk in keys.chunks(max) {
            let n = self.batch_exists(chunk).await?;
            total += n;
            if n < chunk.len() {
                break;
            }
        }
        Ok(total)
    }

    /// Stores `pages` (key, contiguous bytes) with `layout`; one outcome per page.
    async fn put_pages(
        &self,
        layout: LayoutKind,
        pages: &[(PageKey, Bytes)],
    ) -> Result<Vec<PageOutcome>> {
        let max = self.info().max_batch.max(1);
        let mut out = Vec::with_capacity(pages.len());
        for chunk in pages.chunks(max) {
            let keys: Vec<PageKey> = chunk.iter().map(|(k, _)| *k).collect();
            let bufs: Vec<PageBuf<'_>> = chunk
                .iter()
                .map(|(_, b)| PageBuf::contiguous(layout, b))
                .collect();
            out.extend(self.batch_set(&keys, &bufs).await?);
        }
        Ok(out)
    }

    /// Reads `keys`, each expected to be `len` bytes of `layout`; `Some(bytes)` for hits.
    async fn get_pages(
        &self,
        layout: LayoutKind,
        len: usize,
        keys: &[PageKey],
    ) -> Result<Vec<Option<Bytes>>> {
        let max = self.info().max_batch.max(1);
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(max) {
            let mut bufs: Vec<Vec<u8>> = chunk.iter().map(|_| vec![0u8; len]).collect();
            let outcomes = {
                let mut dst: Vec<PageBufMut<'_>> = bufs
                    .iter_mut()
                    .map(|b| PageBufMut::contiguous(layout, b))
                    .collect();
                self.batch_get(chunk, &mut dst).await?
            };
            out.extend(
                outcomes
                    .into_iter()
                    .zip(bufs)
                    .map(|(o, b)| o.is_hit().then(|| Bytes::from(b))),
            );
        }
        Ok(out)
    }

    /// Stores one page.
    async fn put(&self, layout: LayoutKind, key: PageKey, data: &[u8]) -> Result<PageOutcome> {
        let mut v = self
            .batch_set(&[key], &[PageBuf::contiguous(layout, data)])
            .await?;
        Ok(v.pop().expect("one outcome per key"))
    }

    /// Reads one page of `len` bytes; `None` unless it is a hit.
    async fn get(&self, layout: LayoutKind, len: usize, key: PageKey) -> Result<Option<Bytes>> {
        Ok(self.get_pages(layout, len, &[key]).await?.pop().flatten())
    }
}

impl<S: Storage + ?Sized> StorageExt for S {}
