//! `hicache storage-write`: writes deterministic pages forever (or `--pages K`) and prints
//! `acked <last index>` after each batch the backend acknowledged, for durability checks: kill
//! it at any moment, then `storage-check --upto <last acked>`. With `--inflight N`, N batches
//! run at once (as the controller drives L3; their durability barriers merge) and the printed
//! index is the watermark: every page up to it is acknowledged.

use std::io::Write;

use clap::Args;
use futures_util::StreamExt;
use hicache_storage::{PageBuf, PageKey, PageOutcome, Storage, pattern};

use crate::backend::{BackendArgs, LAYOUT, aligned_region, runtime, seed_key};
use crate::error::{CliError, Result};

/// Arguments of `storage-write`.
#[derive(Debug, Args)]
pub struct StorageWriteArgs {
    /// Backend selection.
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Bytes per page.
    #[arg(long)]
    pub page_bytes: usize,
    /// Seed of keys and contents.
    #[arg(long)]
    pub seed: u64,
    /// Pages per batch.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Stop after this many pages (default: run until killed).
    #[arg(long)]
    pub pages: Option<u64>,
    /// Batches in flight at once.
    #[arg(long, default_value_t = 1)]
    pub inflight: usize,
}

/// Runs `storage-write`, printing `acked <i>` lines to `out`.
pub fn run(args: &StorageWriteArgs, mut out: impl Write) -> Result<()> {
    if args.page_bytes == 0 || args.batch == 0 || args.inflight == 0 {
        return Err(CliError::Usage(
            "--page-bytes, --batch and --inflight must be at least 1".into(),
        ));
    }
    let rt = runtime()?;
    rt.block_on(async {
        let storage = args.backend.open(&[], args.page_bytes).await?;
        let batch = args.batch.min(storage.info().max_batch) as u64;
        let mut region = aligned_region(batch as usize * args.inflight, args.page_bytes)?;
        let slots = std::sync::Mutex::new(
            region
                .chunks_mut(batch as usize * args.page_bytes)
                .collect::<Vec<_>>(),
        );
        let total = args.pages.unwrap_or(u64::MAX);
        let storage = &*storage;
        let slots = &slots;
        let page_bytes = args.page_bytes;
        let seed = args.seed;
        // Batch `b` writes pages `b * batch ..`; at most `inflight` batches run at once.
        let mut batches = futures_util::stream::iter((0..total.div_ceil(batch)).map(|b| {
            let first = b * batch;
            (b, first, batch.min(total - first) as usize)
        }))
        .map(|(b, first, n)| async move {
            let slot = slots
                .lock()
                .expect("no panic while held")
                .pop()
                .expect("a slot per batch in flight");
            let r = write_batch(storage, slot, page_bytes, seed, first, n).await;
            slots.lock().expect("no panic while held").push(slot);
            r.map(|()| (b, first + n as u64 - 1))
        })
        .buffer_unordered(args.inflight);
        let mut done = std::collections::BTreeMap::new();
        let mut next_batch = 0u64;
        while let Some(r) = batches.next().await {
            let (b, last) = r?;
            done.insert(b, last);
            let mut watermark = None;
            while let Some(last) = done.remove(&next_batch) {
                watermark = Some(last);
                next_batch += 1;
            }
            if let Some(w) = watermark {
                writeln!(out, "acked {w}")
                    .and_then(|()| out.flush())
                    .map_err(CliError::io("<stdout>"))?;
            }
        }
        Ok(())
    })
}

/// Writes pages `first .. first + n` of `seed` from `slot` and checks every one was stored.
async fn write_batch(
    storage: &dyn Storage,
    slot: &mut [u8],
    page_bytes: usize,
    seed: u64,
    first: u64,
    n: usize,
) -> Result<()> {
    let keys: Vec<PageKey> = (0..n as u64).map(|j| seed_key(seed, first + j)).collect();
    for (k, chunk) in keys.iter().zip(slot.chunks_mut(page_bytes)) {
        pattern::fill_page(k, chunk);
    }
    let bufs: Vec<PageBuf<'_>> = slot
        .chunks(page_bytes)
        .take(n)
        .map(|c| PageBuf::contiguous(LAYOUT, c))
        .collect();
    let outcomes = storage.batch_set(&keys, &bufs).await?;
    if let Some((j, o)) = outcomes
        .iter()
        .enumerate()
        .find(|(_, o)| !matches!(o, PageOutcome::Stored | PageOutcome::Present))
    {
        return Err(CliError::CheckFailed(format!(
            "page {} ({}) was not stored: {o:?}",
            first + j as u64,
            keys[j]
        )));
    }
    Ok(())
}
