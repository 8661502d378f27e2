//! `hicache-bench plugin`: the cost of the plugin ABI. The in-memory reference backend is
//! called natively (`MemoryBackend` linked into this binary) and through the plugin ABI (the
//! same backend exported by the example plugin `libhicache_plugin_example.so` and loaded with
//! the loader), with the same batches, in the same run:
//!
//! - `get`: `--pages` pages of `--page-bytes` each, present, read into the same destination
//!   buffers again and again (copy + checksum per page: the backend's real work);
//! - `set`: fresh keys every batch, into a store kept full, so every batch also evicts;
//! - `exists`: a `--pages`-key leading-run lookup, a call with almost no work, which shows the
//!   per-call cost of the boundary itself.
//!
//! Every case reports the plugin's figure with the native figure as its reference, and the
//! per-batch-call overhead (plugin minus native time per call). Calls are made from a task on
//! a multi-threaded tokio runtime, as an engine's controller makes them (so the plugin path
//! includes the loader's `block_in_place`). Native and plugin batches alternate in rounds (the
//! order flipping every round) and each figure is the median over rounds, so drift of a shared
//! machine hits both sides alike. Targets (issue 7): throughput ≥ 97% of native, overhead
//! ≤ 5 µs per batch call.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use hicache_backend_plugin::{HostParams, PluginStorage};
use hicache_storage::pattern::{fill_page, namespace, page_key};
use hicache_storage::{
    LayoutKind, MemoryBackend, MemoryOptions, PageBuf, PageBufMut, PageKey, PageOutcome, Storage,
};

use crate::error::{BenchError, Result};
use crate::record::Record;

/// The example plugin's file name (a cdylib of the workspace).
const EXAMPLE: &str = "libhicache_plugin_example.so";

/// Arguments of `plugin`.
#[derive(Debug, Args)]
pub struct PluginArgs {
    /// The plugin to measure: a build of the example plugin (the memory backend). Default:
    /// `libhicache_plugin_example.so` next to this executable (build it with
    /// `cargo build --release -p hicache-plugin-example`).
    #[arg(long)]
    pub plugin: Option<PathBuf>,
    /// Pages per batch call.
    #[arg(long, default_value_t = 128)]
    pub pages: usize,
    /// Bytes per page.
    #[arg(long, default_value_t = 256 << 10)]
    pub page_bytes: usize,
    /// Batch calls per side and round (`exists` makes 50 times as many).
    #[arg(long, default_value_t = 16)]
    pub batches: usize,
    /// Rounds (each figure is the median over rounds).
    #[arg(long, default_value_t = 15)]
    pub rounds: usize,
    /// One JSON object per case instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One side of the comparison.
struct Side {
    name: &'static str,
    storage: Arc<dyn Storage>,
}

/// Per-call seconds of both sides, one sample per round.
#[derive(Default)]
struct Samples {
    native: Vec<f64>,
    plugin: Vec<f64>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn storage_err(what: &str) -> impl FnOnce(hicache_storage::StorageError) -> BenchError + '_ {
    move |e| BenchError::check_failed(format!("plugin bench: {what}: {e}"))
}

fn default_plugin() -> Result<PathBuf> {
    let exe = std::env::current_exe().map_err(BenchError::io("<current executable>"))?;
    let p = exe.with_file_name(EXAMPLE);
    if !p.exists() {
        return Err(BenchError::usage(format!(
            "{} not found: build the example plugin with the same profile first \
             (`cargo build --release -p hicache-plugin-example`), or pass --plugin PATH",
            p.display()
        )));
    }
    Ok(p)
}

/// The measurement state shared by the cases.
struct Bench {
    sides: [Side; 2],
    keys: Vec<PageKey>,
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
    next_key: u64,
}

impl Bench {
    async fn get(&mut self, side: usize) -> Result<()> {
        let s = &self.sides[side];
        let mut dst: Vec<PageBufMut<'_>> = self
            .dst
            .iter_mut()
            .map(|b| PageBufMut::contiguous(LayoutKind::PageFirst, b))
            .collect();
        let out = s
            .storage
            .batch_get(&self.keys, &mut dst)
            .await
            .map_err(storage_err(s.name))?;
        if !out.iter().all(PageOutcome::is_hit) {
            return Err(BenchError::check_failed(format!(
                "plugin bench: {} get missed: {:?}",
                s.name,
                out.iter().find(|o| !o.is_hit())
            )));
        }
        Ok(())
    }

    async fn set(&mut self, side: usize) -> Result<()> {
        let s = &self.sides[side];
        let n = self.keys.len() as u64;
        let keys: Vec<PageKey> = (self.next_key..self.next_key + n)
            .map(|i| page_key(namespace(2), 2, i))
            .collect();
        self.next_key += n;
        let src: Vec<PageBuf<'_>> = self
            .src
            .iter()
            .map(|b| PageBuf::contiguous(LayoutKind::PageFirst, b))
            .collect();
        let out = s
            .storage
            .batch_set(&keys, &src)
            .await
            .map_err(storage_err(s.name))?;
        if !out.iter().all(|o| *o == PageOutcome::Stored) {
            return Err(BenchError::check_failed(format!(
                "plugin bench: {} set failed: {:?}",
                s.name,
                out.iter().find(|o| **o != PageOutcome::Stored)
            )));
        }
        Ok(())
    }

    async fn exists(&mut self, side: usize) -> Result<()> {
        let s = &self.sides[side];
        let n = s
            .storage
            .batch_exists(&self.keys)
            .await
            .map_err(storage_err(s.name))?;
        if n != self.keys.len() {
            return Err(BenchError::check_failed(format!(
                "plugin bench: {} exists found {n} of {}",
                s.name,
                self.keys.len()
            )));
        }
        Ok(())
    }

    async fn op(&mut self, case: &str, side: usize) -> Result<()> {
        match case {
            "get" => self.get(side).await,
            "set" => self.set(side).await,
            _ => self.exists(side).await,
        }
    }

    /// Per-call seconds of `case` on both sides over `rounds` rounds of `calls` calls each,
    /// after one warm-up round.
    async fn measure(&mut self, case: &str, calls: usize, rounds: usize) -> Result<Samples> {
        let mut s = Samples::default();
        for round in 0..=rounds {
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for side in order {
                let t0 = Instant::now();
                for _ in 0..calls {
                    self.op(case, side).await?;
                }
                let per_call = t0.elapsed().as_secs_f64() / calls as f64;
                if round > 0 {
                    if side == 0 {
                        s.native.push(per_call);
                    } else {
                        s.plugin.push(per_call);
                    }
                }
            }
        }
        Ok(s)
    }
}

/// Opens the two sides: the memory backend natively and through the plugin at `path`, both
/// with room for four batches (`set` evicts one batch per batch once full). Returns the
/// plugin's name with them.
fn open_sides(args: &PluginArgs, path: &std::path::Path) -> Result<([Side; 2], String)> {
    let capacity = 4 * (args.pages * args.page_bytes) as u64;
    let max_batch = args.pages.max(128);
    let native: Arc<dyn Storage> = Arc::new(MemoryBackend::new(MemoryOptions {
        capacity_bytes: capacity,
        max_batch,
        ..MemoryOptions::default()
    }));
    let plugin = PluginStorage::open(
        path,
        &format!(r#"{{"max_batch": {max_batch}}}"#),
        &HostParams::default().with_capacity(Some(capacity)),
    )
    .map_err(|e| BenchError::usage(format!("plugin: {e}")))?;
    let plugin_name = format!(
        "{} {} ({})",
        plugin.library().name(),
        plugin.library().version(),
        path.display()
    );
    let sides = [
        Side {
            name: "native",
            storage: native,
        },
        Side {
            name: "plugin",
            storage: Arc::new(plugin),
        },
    ];
    Ok((sides, plugin_name))
}

impl Bench {
    /// The bench over `sides` with one batch of `--pages` pattern pages.
    fn new(args: &PluginArgs, sides: [Side; 2]) -> Self {
        let keys: Vec<PageKey> = (0..args.pages as u64)
            .map(|i| page_key(namespace(1), 1, i))
            .collect();
        let src: Vec<Vec<u8>> = keys
            .iter()
            .map(|k| {
                let mut b = vec![0u8; args.page_bytes];
                fill_page(k, &mut b);
                b
            })
            .collect();
        Bench {
            sides,
            dst: vec![vec![0u8; args.page_bytes]; args.pages],
            keys,
            src,
            next_key: 1 << 40,
        }
    }

    /// Every case in order: `get` and `exists` of the resident batch, then `set` with every
    /// store full (each timed set evicts).
    async fn measure_all(
        &mut self,
        batches: usize,
        rounds: usize,
    ) -> Result<Vec<(&'static str, Samples)>> {
        let mut results = Vec::new();
        // The resident batch both sides read and look up.
        for s in &self.sides {
            let bufs: Vec<PageBuf<'_>> = self
                .src
                .iter()
                .map(|b| PageBuf::contiguous(LayoutKind::PageFirst, b))
                .collect();
            s.storage
                .batch_set(&self.keys, &bufs)
                .await
                .map_err(storage_err(s.name))?;
        }
        results.push(("get", self.measure("get", batches, rounds).await?));
        // `exists` looks up the resident batch, so it runs before `set` fills the stores
        // with fresh keys (evicting it).
        results.push((
            "exists",
            self.measure("exists", batches * 50, rounds).await?,
        ));
        // Fill both stores so that every timed set evicts.
        for _ in 0..4 {
            self.set(0).await?;
            self.set(1).await?;
        }
        results.push(("set", self.measure("set", batches, rounds).await?));
        Ok(results)
    }
}

/// One case's record and its two table columns (native, plugin).
fn case_record(
    args: &PluginArgs,
    case: &str,
    s: &mut Samples,
    plugin_name: &str,
) -> (Record, (String, String)) {
    let native = median(&mut s.native);
    let plugin = median(&mut s.plugin);
    let (rec, cols) = if case == "exists" {
        let r = Record::new(
            "plugin",
            format!("memory/exists/{}", args.pages),
            plugin * 1e6,
            "us",
        )
        .with_reference(native * 1e6);
        let cols = (
            format!("{:.2} us", native * 1e6),
            format!("{:.2} us", plugin * 1e6),
        );
        (r, cols)
    } else {
        let batch_bytes = (args.pages * args.page_bytes) as f64;
        let gbs = |t: f64| batch_bytes / t / 1e9;
        let r = Record::new(
            "plugin",
            format!("memory/{case}/{}x{}KiB", args.pages, args.page_bytes >> 10),
            gbs(plugin),
            "GB/s",
        )
        .with_reference(gbs(native));
        let cols = (
            format!("{:.2} GB/s", gbs(native)),
            format!("{:.2} GB/s", gbs(plugin)),
        );
        (r, cols)
    };
    let rec = rec
        .with("overhead_us_per_call", (plugin - native) * 1e6)
        .with("native_us_per_call", native * 1e6)
        .with("plugin_us_per_call", plugin * 1e6)
        .with("plugin", plugin_name);
    (rec, cols)
}

/// A case's table row. For `exists` a lower time is better: the ratio is native/plugin.
fn case_row(rec: &Record, cols: &(String, String)) -> String {
    let native = rec.extra["native_us_per_call"].as_f64().unwrap_or(0.0);
    let plugin = rec.extra["plugin_us_per_call"].as_f64().unwrap_or(0.0);
    let ratio = if rec.case.starts_with("memory/exists/") {
        native / plugin
    } else {
        rec.ratio.unwrap_or(0.0)
    };
    format!(
        "{:<28} {:>12} {:>12} {:>8.3} {:>11.2} us",
        rec.case,
        cols.0,
        cols.1,
        ratio,
        plugin - native
    )
}

/// Runs the bench, writing records (or a table) to `out`.
pub fn run(args: &PluginArgs, mut out: impl Write) -> Result<()> {
    if args.pages == 0 || args.page_bytes == 0 || args.batches == 0 || args.rounds == 0 {
        return Err(BenchError::usage(
            "plugin: --pages, --page-bytes, --batches and --rounds must be positive",
        ));
    }
    let path = match &args.plugin {
        Some(p) => p.clone(),
        None => default_plugin()?,
    };
    let (sides, plugin_name) = open_sides(args, &path)?;
    let mut bench = Bench::new(args, sides);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| BenchError::usage(format!("plugin: tokio runtime: {e}")))?;
    let (batches, rounds) = (args.batches, args.rounds);
    // Run on a worker, as an engine's controller task would.
    let results = rt
        .block_on(rt.spawn(async move { bench.measure_all(batches, rounds).await }))
        .map_err(|e| BenchError::check_failed(format!("plugin bench task failed: {e}")))??;
    let mut w = |s: String| writeln!(out, "{s}").map_err(BenchError::io("<stdout>"));
    if !args.json {
        w(format!(
            "plugin ABI overhead: memory backend native vs through {plugin_name}; {} pages of {} KiB per batch, median of {rounds} rounds",
            args.pages,
            args.page_bytes >> 10
        ))?;
        w(format!(
            "{:<28} {:>12} {:>12} {:>8} {:>14}   targets: get/set ratio >= 0.97; overhead <= 5 us per call (exists: the boundary alone)",
            "case", "native", "plugin", "ratio", "overhead/call"
        ))?;
    }
    for (case, mut s) in results {
        let (rec, cols) = case_record(args, case, &mut s, &plugin_name);
        w(if args.json {
            rec.to_json_line()
        } else {
            case_row(&rec, &cols)
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(plugin: Option<PathBuf>) -> PluginArgs {
        PluginArgs {
            plugin,
            pages: 3,
            page_bytes: 4096,
            batches: 1,
            rounds: 1,
            json: true,
        }
    }

    /// The example plugin, built with cargo on first use (`cargo test` does not build cdylibs
    /// by itself; see `hicache_plugin_tests::rust_plugin`).
    fn example() -> PathBuf {
        hicache_plugin_tests::rust_plugin("hicache-plugin-example")
    }

    #[test]
    fn records_every_case_with_its_native_reference() {
        let mut out = Vec::new();
        run(&args(Some(example())), &mut out).unwrap();
        let lines: Vec<serde_json::Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let cases: Vec<&str> = lines.iter().map(|v| v["case"].as_str().unwrap()).collect();
        assert_eq!(
            cases,
            ["memory/get/3x4KiB", "memory/exists/3", "memory/set/3x4KiB"]
        );
        for v in &lines {
            assert_eq!(v["bench"], "plugin");
            assert!(v["reference"].as_f64().unwrap() > 0.0, "{v}");
            assert!(v["overhead_us_per_call"].is_f64(), "{v}");
        }
    }

    #[test]
    fn bad_input_is_a_usage_error() {
        let mut a = args(Some(PathBuf::from("/nonexistent/libx.so")));
        let e = run(&a, Vec::new()).unwrap_err();
        assert_eq!(e.exit_code(), 2, "{e}");
        assert!(e.to_string().contains("/nonexistent/libx.so"), "{e}");
        a.pages = 0;
        assert_eq!(run(&a, Vec::new()).unwrap_err().exit_code(), 2);
    }
}
