//! `hicache-bench storage-write`: writes deterministic pages forever (or `--pages K`) and prints
//! `acked <last index>` after each batch the backend acknowledged, for durability checks: kill
//! it at any moment, then `storage-check --upto <last acked>`.

use std::io::Write;

use clap::Args;
use hicache_storage::{PageBuf, PageKey, PageOutcome, pattern};

use crate::cmd::storage_common::{BackendArgs, LAYOUT, aligned_region, runtime, seed_key};
use crate::error::{BenchError, Result};

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
}

/// Runs `storage-write`, printing `acked <i>` lines to `out`.
pub fn run(args: &StorageWriteArgs, mut out: impl Write) -> Result<()> {
    if args.page_bytes == 0 || args.batch == 0 {
        return Err(BenchError::Usage(
            "--page-bytes and --batch must be at least 1".into(),
        ));
    }
    let rt = runtime()?;
    rt.block_on(async {
        let storage = args.backend.open(&[], args.page_bytes).await?;
        let batch = args.batch.min(storage.info().max_batch);
        let mut region = aligned_region(batch, args.page_bytes)?;
        let mut next: u64 = 0;
        loop {
            let remaining = args.pages.map_or(u64::MAX, |p| p.saturating_sub(next));
            if remaining == 0 {
                break;
            }
            let n = (batch as u64).min(remaining) as usize;
            let keys: Vec<PageKey> = (0..n as u64)
                .map(|j| seed_key(args.seed, next + j))
                .collect();
            for (k, chunk) in keys.iter().zip(region.chunks_mut(args.page_bytes)) {
                pattern::fill_page(k, chunk);
            }
            let bufs: Vec<PageBuf<'_>> = region
                .chunks(args.page_bytes)
                .take(n)
                .map(|c| PageBuf::contiguous(LAYOUT, c))
                .collect();
            let outcomes = storage.batch_set(&keys, &bufs).await?;
            if let Some((j, o)) = outcomes
                .iter()
                .enumerate()
                .find(|(_, o)| !matches!(o, PageOutcome::Stored | PageOutcome::Present))
            {
                return Err(BenchError::CheckFailed(format!(
                    "page {} ({}) was not stored: {o:?}",
                    next + j as u64,
                    keys[j]
                )));
            }
            next += n as u64;
            writeln!(out, "acked {}", next - 1)
                .and_then(|()| out.flush())
                .map_err(BenchError::io("<stdout>"))?;
        }
        Ok(())
    })
}
