//! `hicache-bench index --churn-minutes M`: the fleet index's memory over a long churn.
//!
//! One index (bounded with `--capacity`) is fed an event file's operations again and again
//! (stores, removals, clears, attaches and queries, in the file's order) until `M` minutes
//! have passed. Once the index is at its capacity every pass stores chains that evict others,
//! so its allocations turn over; the process RSS is sampled after every pass. The bar
//! is RSS flat within ±5 %: the drift reported is the spread (max − min) of the samples after
//! the warm-up (the first fifth of the passes, at least one), in percent of their mean.

use std::io::Write;
use std::time::{Duration, Instant};

use hicache_index::Answer;

use super::index::{EventFile, FileIndex, rss_bytes};
use crate::error::{BenchError, Result};
use crate::record::Record;

/// What a churn measured.
#[derive(Debug, Clone, Default)]
pub struct Churn {
    /// Whole passes over the file.
    pub passes: usize,
    /// Wall time of the passes, seconds.
    pub seconds: f64,
    /// Block-ops applied in all.
    pub block_ops: u64,
    /// Process RSS after each pass, bytes.
    pub rss: Vec<u64>,
    /// Holder-blocks held after each pass.
    pub holder_blocks: Vec<u64>,
    /// The index's own byte count after the last pass.
    pub bytes: u64,
}

/// Replays `file` through one index of `capacity` holder-blocks for `minutes` (whole passes:
/// the last one started before the time was up ends).
pub fn churn(file: &EventFile, capacity: Option<u64>, minutes: f64) -> Result<Churn> {
    if !(minutes.is_finite() && minutes > 0.0) {
        return Err(BenchError::usage(format!(
            "--churn-minutes {minutes}: want a positive number of minutes"
        )));
    }
    let limit = Duration::from_secs_f64(minutes * 60.0);
    let mut fi = FileIndex::new(file, capacity)?;
    let mut out = Answer::new();
    let mut c = Churn::default();
    let start = Instant::now();
    while c.passes == 0 || start.elapsed() < limit {
        for n in 0..file.op_count() {
            c.block_ops += fi.apply(file, n, &mut out)?;
        }
        c.passes += 1;
        c.rss.push(rss_bytes());
        c.holder_blocks.push(fi.index().stats().holder_blocks);
    }
    c.seconds = start.elapsed().as_secs_f64();
    c.bytes = fi.index().stats().bytes;
    Ok(c)
}

impl Churn {
    /// The samples after the warm-up: the first fifth of the passes (at least one) dropped
    /// where more than one pass ran.
    fn steady(&self) -> &[u64] {
        if self.rss.len() < 2 {
            return &self.rss;
        }
        &self.rss[(self.rss.len() / 5).max(1)..]
    }

    /// The lowest and highest RSS after the warm-up ((0, 0) without samples).
    fn steady_range(&self) -> (u64, u64) {
        let tail = self.steady();
        let lo = tail.iter().min().copied().unwrap_or(0);
        (lo, tail.iter().max().copied().unwrap_or(0))
    }

    /// RSS spread after the warm-up, percent of its mean.
    pub fn drift_pct(&self) -> f64 {
        let tail = self.steady();
        if tail.is_empty() {
            return 0.0;
        }
        let (lo, hi) = self.steady_range();
        let mean = tail.iter().sum::<u64>() as f64 / tail.len() as f64;
        100.0 * (hi - lo) as f64 / mean.max(1.0)
    }

    /// The churn's record (JSON) or a few lines of text to `out`.
    pub fn report(&self, json: bool, mut out: impl Write) -> Result<()> {
        let io = |e| BenchError::check_failed(format!("writing the report: {e}"));
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let tail = self.steady();
        let (lo, hi) = self.steady_range();
        let last_blocks = self.holder_blocks.last().copied().unwrap_or(0);
        if json {
            let rec = Record::new("index", "churn/rss_drift", self.drift_pct(), "%")
                .with("passes", self.passes as u64)
                .with("seconds", self.seconds)
                .with("block_ops", self.block_ops)
                .with("rss_bytes", self.rss.clone())
                .with("holder_blocks", self.holder_blocks.clone())
                .with("bytes", self.bytes);
            return writeln!(out, "{}", rec.to_json_line()).map_err(io);
        }
        writeln!(
            out,
            "index churn: {} passes in {:.0} s, {} block-ops ({:.2}M/s), {} holder-blocks held, \
             index bytes {}",
            self.passes,
            self.seconds,
            self.block_ops,
            self.block_ops as f64 / self.seconds.max(1e-9) / 1e6,
            last_blocks,
            self.bytes
        )
        .map_err(io)?;
        writeln!(
            out,
            "process RSS after the warm-up: {:.1}–{:.1} MiB over {} passes, drift {:.2} % \
             (first pass {:.1} MiB, last {:.1} MiB)",
            mib(lo),
            mib(hi),
            tail.len(),
            self.drift_pct(),
            mib(self.rss.first().copied().unwrap_or(0)),
            mib(self.rss.last().copied().unwrap_or(0)),
        )
        .map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_is_the_spread_after_the_warm_up() {
        let c = Churn {
            rss: vec![50, 100, 104, 96, 100, 100],
            ..Churn::default()
        };
        // Warm-up: the first sample; the rest spread 96..104 around a mean of 100.
        assert!((c.drift_pct() - 8.0).abs() < 1e-9, "{}", c.drift_pct());
        assert_eq!(Churn::default().drift_pct(), 0.0);
    }

    #[test]
    fn a_churn_of_a_small_file_runs_whole_passes_and_stays_within_capacity() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.jsonl");
        let mut lines = String::new();
        for i in 0..200u64 {
            let hashes: Vec<String> = (0..8).map(|k| (i * 8 + k + 1).to_string()).collect();
            lines.push_str(&format!(
                "{{\"op\":\"store\",\"holder\":{},\"tier\":\"l1\",\"parent\":null,\"hashes\":[{}]}}\n",
                i % 4,
                hashes.join(",")
            ));
        }
        lines.push_str("{\"op\":\"query\",\"hashes\":[1,2,3]}\n");
        std::fs::write(&path, lines).unwrap();
        let file = EventFile::read(&path).unwrap();
        let c = churn(&file, Some(500), 1e-6).unwrap();
        assert_eq!(c.passes, 1);
        assert_eq!(c.block_ops, 1600);
        assert!(c.holder_blocks[0] <= 500, "{:?}", c.holder_blocks);
        let mut text = Vec::new();
        c.report(false, &mut text).unwrap();
        assert!(String::from_utf8(text).unwrap().contains("1 passes"));
        assert!(churn(&file, None, 0.0).is_err());
    }
}
