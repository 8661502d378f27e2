//! `hicache storage-check`: opens a backend's storage as a restart would (but read-only
//! where the backend has a read-only mode) and checks the
//! pages `storage-write` acknowledged: pages `0..=upto` must all read back bit-exact, and no page
//! of the seed (including ones written after the last acknowledgement) may read back wrong.
//! Prints a JSON summary; exits 1 on a missing acknowledged page or any wrong bytes. The file
//! and uring backends are opened read-only: the check never changes the store it checks.

use std::io::Write;

use clap::Args;
use hicache_storage::{PageBufMut, PageKey, PageOutcome, pattern};
use serde::Serialize;

use crate::backend::{BackendArgs, LAYOUT, aligned_region, runtime, seed_key};
use crate::error::{CliError, Result};

/// Backends with a `read_only` open mode, which the check uses.
const READ_ONLY_BACKENDS: [&str; 2] = ["file", "uring"];

/// Arguments of `storage-check`.
#[derive(Debug, Args)]
pub struct StorageCheckArgs {
    /// Backend selection.
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Bytes per page.
    #[arg(long)]
    pub page_bytes: usize,
    /// Seed of keys and contents.
    #[arg(long)]
    pub seed: u64,
    /// Last acknowledged page index (omit if none was acknowledged).
    #[arg(long)]
    pub upto: Option<u64>,
    /// Pages past `upto` to probe for wrong bytes (writes in flight at the kill).
    #[arg(long, default_value_t = 1024)]
    pub beyond: u64,
}

/// The JSON summary.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct CheckSummary {
    /// Acknowledged pages checked (`upto + 1`).
    pub checked: u64,
    /// Acknowledged pages present and bit-exact.
    pub present: u64,
    /// Acknowledged pages absent (or dropped as corrupt).
    pub missing: u64,
    /// Pages (acknowledged or not) that read back as hits with wrong bytes.
    pub wrong: u64,
    /// Pages the backend detected as corrupt and refused (never served).
    pub corrupt_detected: u64,
    /// Unacknowledged pages past `upto` found present and bit-exact.
    pub beyond_present: u64,
    /// Files or records the backend discarded when opening (torn writes, temp files); for a
    /// read-only open (file, uring), what a read-write open would discard.
    pub discarded_on_open: u64,
    /// First missing acknowledged index, if any.
    pub first_missing: Option<u64>,
}

/// Runs `storage-check`, printing the JSON summary to `out`.
pub fn run(args: &StorageCheckArgs, mut out: impl Write) -> Result<CheckSummary> {
    if args.page_bytes == 0 {
        return Err(CliError::Usage("--page-bytes must be at least 1".into()));
    }
    let rt = runtime()?;
    let summary = rt.block_on(async {
        // The check is read-only: the local-disk backends open in their read-only mode
        // (nothing created, modified or deleted; `discarded_on_open` then counts what a
        // read-write open would discard).
        let read_only = [("read_only", serde_json::Value::Bool(true))];
        let overrides: &[(&str, serde_json::Value)] =
            if READ_ONLY_BACKENDS.contains(&args.backend.backend.as_str()) {
                &read_only
            } else {
                &[]
            };
        let storage = args.backend.open(overrides, args.page_bytes).await?;
        let batch = storage.info().max_batch.min(128);
        let mut region = aligned_region(batch, args.page_bytes)?;
        let acked = args.upto.map_or(0, |u| u + 1);
        let end = acked + args.beyond;
        let mut s = CheckSummary {
            checked: acked,
            discarded_on_open: storage.stats().discarded_on_open,
            ..CheckSummary::default()
        };
        let mut i = 0u64;
        while i < end {
            let n = (batch as u64).min(end - i) as usize;
            let keys: Vec<PageKey> = (0..n as u64).map(|j| seed_key(args.seed, i + j)).collect();
            let outcomes = {
                let mut dst: Vec<PageBufMut<'_>> = region
                    .chunks_mut(args.page_bytes)
                    .take(n)
                    .map(|c| PageBufMut::contiguous(LAYOUT, c))
                    .collect();
                storage.batch_get(&keys, &mut dst).await?
            };
            for (j, (o, chunk)) in outcomes
                .iter()
                .zip(region.chunks(args.page_bytes))
                .enumerate()
            {
                let idx = i + j as u64;
                let acked_page = idx < acked;
                let good = *o == PageOutcome::Hit && pattern::check_page(&keys[j], chunk);
                if *o == PageOutcome::Hit && !good {
                    s.wrong += 1;
                }
                if *o == PageOutcome::Corrupt {
                    s.corrupt_detected += 1;
                }
                match (acked_page, good) {
                    (true, true) => s.present += 1,
                    (true, false) => {
                        s.missing += 1;
                        s.first_missing.get_or_insert(idx);
                    }
                    (false, true) => s.beyond_present += 1,
                    (false, false) => {}
                }
            }
            i += n as u64;
        }
        Ok::<_, CliError>(s)
    })?;
    writeln!(
        out,
        "{}",
        serde_json::to_string(&summary).expect("a summary of numbers serialises")
    )
    .map_err(CliError::io("<stdout>"))?;
    if summary.missing > 0 || summary.wrong > 0 {
        return Err(CliError::CheckFailed(format!(
            "{} acknowledged pages missing (first: {:?}), {} pages with wrong bytes",
            summary.missing, summary.first_missing, summary.wrong
        )));
    }
    Ok(summary)
}
