//! The report of the main job: a side-by-side table (no cache and each cache configuration),
//! JSON records in the bench convention, `report.json` and SVG plots in a report directory.
//!
//! TTFT and throughput are simulated (the compute model of [`hicache_sim::model`]); bytes moved
//! and GB/s are what the cache measured on this machine (on the sim device, CPU memcpy and the
//! local disk: they say nothing about a GPU).

pub mod plot;
pub mod summary;
pub mod timing;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{BenchError, Result};
use crate::record::Record;
use hicache_sim::engine::EngineConfig;
use hicache_sim::links::CopyTime;
use hicache_sim::model::{ComputeModel, HybridModel, ModelShape};
use hicache_sim::setup::PayloadUsed;
pub use summary::{Hits, Percentiles, RoundSummary, Summary, percentile};
pub use timing::{Span, TableSeconds, Timing};

/// Everything one invocation measured, as written to `report.json`.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// One line describing the workload.
    pub title: String,
    /// The workload's parameters.
    pub workload: serde_json::Value,
    /// The cache configuration (without tiers; each run names its own).
    pub setup: serde_json::Value,
    /// The simulated model.
    pub model: ModelShape,
    /// Its costs.
    pub compute: ComputeModel,
    /// Scheduler settings.
    pub engine: EngineConfig,
    /// Tokens per page.
    pub page_size: usize,
    /// The same workload without prefix caching.
    pub baseline: Summary,
    /// The cache configurations run.
    pub runs: Vec<Summary>,
    /// The hybrid models run beside the dense one on the same workload (empty without them).
    pub hybrid: Vec<HybridColumn>,
    /// How long the job took on this machine, per table.
    pub timing: Timing,
}

/// A hybrid model's columns: the same workload without prefix caching and through
/// `hicache::HybridCache`, on the model's own compute model.
#[derive(Clone, Debug, Serialize)]
pub struct HybridColumn {
    /// The model (its components' shapes).
    pub model: HybridModel,
    /// Its costs (the dense run's link figures).
    pub compute: ComputeModel,
    /// Bytes of a page of its Full and SWA KV (what the engine charges a page hit).
    pub page_bytes: u64,
    /// Without prefix caching.
    pub baseline: Summary,
    /// Through the hybrid cache, one per configuration of the ladder (L1, L1+L2, L1+L2+L3;
    /// Full KV, SWA KV, Mamba states moved per component), with their copies-free figures
    /// where they copy and the job ran the counterfactual.
    pub runs: Vec<Summary>,
}

impl HybridColumn {
    /// The baseline followed by every configuration.
    pub fn all(&self) -> impl Iterator<Item = &Summary> {
        std::iter::once(&self.baseline).chain(&self.runs)
    }
}

fn slug(label: &str) -> String {
    label
        .chars()
        .map(|c| match c {
            ' ' => '_',
            c => c.to_ascii_lowercase(),
        })
        .collect()
}

fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

/// The line saying which of `runs` (a name and what its cache did with bytes) ran without
/// payload, and whether their L3 recorded presence only; `None` when every run moved bytes.
fn payload_line(runs: &[(String, PayloadUsed)]) -> Option<String> {
    let counted: Vec<&(String, PayloadUsed)> =
        runs.iter().filter(|(_, p)| p.counted_only).collect();
    if counted.is_empty() {
        return None;
    }
    let names: Vec<&str> = counted.iter().map(|(n, _)| n.as_str()).collect();
    let presence: Vec<&str> = counted
        .iter()
        .filter(|(_, p)| p.l3_presence_only)
        .map(|(n, _)| n.as_str())
        .collect();
    let l3 = match presence.len() {
        0 => String::new(),
        n if n == counted.len() => "; their L3 recorded which pages it held, no bytes".into(),
        _ => format!(
            "; the L3 of {} recorded which pages it held, no bytes",
            presence.join(", ")
        ),
    };
    Some(format!(
        "without payload (pages counted at the model's page bytes, never populated or copied; \
         hits, TTFT and bytes moved as with bytes{l3}): {}.",
        names.join(", ")
    ))
}

/// A row of the table: its name and how a configuration's cell reads.
type Row = (String, Box<dyn Fn(&Summary) -> String>);

fn row(name: &str, cell: impl Fn(&Summary) -> String + 'static) -> Row {
    (name.to_string(), Box::new(cell))
}

/// Requests, tokens and where the hits came from.
fn hit_rows() -> Vec<Row> {
    let pct = |s: &Summary, t: u64| format!("{t} {:>5.1}%", s.share(t) * 100.0);
    vec![
        row("requests", |s| s.requests.to_string()),
        row("prompt tokens", |s| s.prompt_tokens.to_string()),
        row("hit tokens L1", move |s| pct(s, s.hits.l1)),
        row("hit tokens L2", move |s| pct(s, s.hits.l2)),
        row("hit tokens L3", move |s| pct(s, s.hits.l3)),
        row("hit ratio", |s| format!("{:.1}%", s.hit_ratio() * 100.0)),
        row("recomputed tokens", |s| s.computed_tokens.to_string()),
    ]
}

/// Bytes moved between tiers, with their measured rate.
fn transfer_rows() -> Vec<Row> {
    [
        "moved L1→L2 (D2H)",
        "moved L2→L1 (H2D)",
        "moved L2→L3",
        "moved L3→L2",
    ]
    .iter()
    .enumerate()
    .map(|(i, name)| {
        row(name, move |s| {
            let t = s.transfers()[i].1;
            if t.pages == 0 {
                "-".to_string()
            } else {
                format!("{:.2} GB {:.1} GB/s", gb(t.bytes), t.gbps())
            }
        })
    })
    .collect()
}

/// Bytes a hybrid model moved per component (Full / SWA / Mamba) and direction; `-` for a
/// dense model or a column that moved nothing.
fn component_rows() -> Vec<Row> {
    [
        "moved D2H F/S/M (GB)",
        "moved H2D F/S/M (GB)",
        "moved L2→L3 F/S/M (GB)",
        "moved L3→L2 F/S/M (GB)",
    ]
    .iter()
    .enumerate()
    .map(|(i, name)| {
        row(name, move |s| match &s.cache.components {
            Some(c)
                if c.components()
                    .iter()
                    .any(|(_, m)| m.directions()[i].1.pages > 0) =>
            {
                c.components()
                    .iter()
                    .map(|(_, m)| format!("{:.2}", gb(m.directions()[i].1.bytes)))
                    .collect::<Vec<_>>()
                    .join("/")
            }
            _ => "-".to_string(),
        })
    })
    .collect()
}

/// Simulated TTFT, stalls and throughput, and evictions.
fn timing_rows() -> Vec<Row> {
    let ms = |x: f64| format!("{:.1}", x * 1e3);
    vec![
        row("TTFT p50 (ms)", move |s| ms(s.ttft.p50)),
        row("TTFT p90 (ms)", move |s| ms(s.ttft.p90)),
        row("TTFT p99 (ms)", move |s| ms(s.ttft.p99)),
        row("TTFT mean (ms)", move |s| ms(s.ttft.mean)),
        row("load stall (ms)", move |s| ms(s.load_stall_seconds)),
        row("throughput (req/s)", |s| {
            format!("{:.2}", s.request_throughput)
        }),
        row("input (tok/s)", |s| format!("{:.0}", s.input_throughput)),
        row("evicted pages L1/L2", |s| {
            format!(
                "{}/{}",
                s.cache.metrics.evicted_pages_l1, s.cache.metrics.evicted_pages_l2
            )
        }),
    ]
}

/// What copy time cost: hits lost per tier and TTFT with copies free (`-` where the
/// configuration did not run copies free).
fn copy_cost_rows() -> Vec<Row> {
    let lost = |s: &Summary, tier: usize| match s.free_copy_hits {
        Some(f) => {
            let (free, got) = [(f.l1, s.hits.l1), (f.l2, s.hits.l2), (f.l3, s.hits.l3)][tier];
            format!("{:+}", free as i64 - got as i64)
        }
        None => "-".to_string(),
    };
    let free_ttft = |s: &Summary, f: fn(&Percentiles) -> f64| match &s.free_copy_ttft {
        Some(t) => format!("{:.1}", f(t) * 1e3),
        None => "-".to_string(),
    };
    vec![
        row("hits lost to copies L1", move |s| lost(s, 0)),
        row("hits lost to copies L2", move |s| lost(s, 1)),
        row("hits lost to copies L3", move |s| lost(s, 2)),
        row("TTFT p50, copies free", move |s| free_ttft(s, |t| t.p50)),
        row("TTFT p90, copies free", move |s| free_ttft(s, |t| t.p90)),
        row("TTFT mean, copies free", move |s| free_ttft(s, |t| t.mean)),
    ]
}

/// L3 errors, refusals while copies ran, link occupancy and wall time.
fn health_rows() -> Vec<Row> {
    vec![
        row("L3 errors (write/read pages)", |s| {
            format!(
                "{}/{}",
                s.cache.metrics.l3_write_failures, s.cache.metrics.l3_read_failures
            )
        }),
        row("refused: D2H in flight", |s| {
            s.cache.refused_during_copies.to_string()
        }),
        row("D2H / L3 link busy (s)", |s| {
            format!(
                "{:.2} / {:.2}",
                s.links.d2h.busy_seconds, s.links.l3.busy_seconds
            )
        }),
        row("wall time (s)", |s| format!("{:.2}", s.wall_seconds)),
    ]
}

/// Writes a header row and one row per figure, a column per summary.
fn write_columns(
    out: &mut String,
    header: &[String],
    cols: &[&Summary],
    rows: impl Iterator<Item = Row>,
) {
    let mut line = |name: &str, cells: Vec<String>| {
        let _ = write!(out, "{name:<24}");
        for c in cells {
            let _ = write!(out, " {c:>19}");
        }
        out.push('\n');
    };
    line("", header.to_vec());
    for (name, cell) in rows {
        line(&name, cols.iter().map(|s| cell(s)).collect());
    }
}

/// A figure of a column.
type Figure = fn(&Summary) -> f64;

/// The records of one column `s` named `label`: TTFT and throughput (against `reference`,
/// its no-cache column, if it is not one), hit ratio, and bytes moved per direction (per
/// component for a hybrid model).
fn summary_records(out: &mut Vec<Record>, label: &str, s: &Summary, reference: Option<&Summary>) {
    let with_ref = |r: Record, f: Figure| match reference {
        Some(b) => r.with_reference(f(b)),
        None => r,
    };
    let ttft: [(&str, Figure); 3] = [
        ("ttft_p50", |s| s.ttft.p50 * 1e3),
        ("ttft_p90", |s| s.ttft.p90 * 1e3),
        ("ttft_p99", |s| s.ttft.p99 * 1e3),
    ];
    for (name, f) in ttft {
        let r = Record::new("multiturn", format!("{label}/{name}"), f(s), "ms");
        out.push(with_ref(r, f));
    }
    let r = Record::new(
        "multiturn",
        format!("{label}/throughput"),
        s.request_throughput,
        "req/s",
    );
    out.push(with_ref(r, |s| s.request_throughput));
    out.push(
        Record::new(
            "multiturn",
            format!("{label}/hit_ratio"),
            s.hit_ratio() * 100.0,
            "%",
        )
        .with("requests", s.requests)
        .with("prompt_tokens", s.prompt_tokens)
        .with("hit_tokens_l1", s.hits.l1)
        .with("hit_tokens_l2", s.hits.l2)
        .with("hit_tokens_l3", s.hits.l3)
        .with("recomputed_tokens", s.computed_tokens),
    );
    if let Some(c) = &s.cache.components {
        for (component, m) in c.components() {
            for (dir, t) in m.directions().into_iter().filter(|(_, t)| t.pages > 0) {
                let case = format!("{label}/{component}_{dir}");
                out.push(
                    Record::new("multiturn", case, gb(t.bytes), "GB")
                        .with("pages", t.pages)
                        .with("bytes", t.bytes),
                );
            }
        }
        return;
    }
    for (dir, t) in s.transfers() {
        if t.pages > 0 {
            out.push(
                Record::new("multiturn", format!("{label}/{dir}"), t.gbps(), "GB/s")
                    .with("pages", t.pages)
                    .with("bytes", t.bytes)
                    .with("seconds", t.seconds),
            );
        }
    }
}

impl Report {
    /// The baseline followed by every run.
    pub fn all(&self) -> impl Iterator<Item = &Summary> {
        std::iter::once(&self.baseline).chain(&self.runs)
    }

    /// Every consistency violation of every configuration, the hybrid models' included
    /// (empty when consistent).
    pub fn check(&self) -> Vec<String> {
        let hybrid = self.hybrid.iter().flat_map(|h| h.all());
        self.all()
            .chain(hybrid)
            .flat_map(|s| s.check(self.page_size))
            .collect()
    }

    /// The human table: one column per configuration (the baseline first), one row per
    /// figure; then the hybrid models' table, if any.
    pub fn table(&self) -> String {
        let cols: Vec<&Summary> = self.all().collect();
        let mut out = String::new();
        let _ = writeln!(out, "{}", self.title);
        let header: Vec<String> = cols.iter().map(|s| s.label.clone()).collect();
        let rows = [
            hit_rows(),
            transfer_rows(),
            timing_rows(),
            copy_cost_rows(),
            health_rows(),
        ];
        write_columns(&mut out, &header, &cols, rows.into_iter().flatten());
        let _ = writeln!(out, "{}", self.link_model());
        let _ = writeln!(
            out,
            "TTFT and throughput: simulated ({} on the compute model); bytes and GB/s: measured \
             on this machine.",
            self.model.name
        );
        if let Some(line) = self.dense_payload_line() {
            let _ = writeln!(out, "{line}");
        }
        if let Some(line) = self.timing.table_line("dense") {
            let _ = writeln!(out, "{line}");
        }
        if !self.hybrid.is_empty() {
            out.push_str(&self.hybrid_table());
            if let Some(line) = self.hybrid_payload_line() {
                let _ = writeln!(out, "{line}");
            }
            if let Some(line) = self.timing.table_line("hybrid") {
                let _ = writeln!(out, "{line}");
            }
        }
        if self.timing.total_seconds > 0.0 {
            let _ = writeln!(out, "\n{}", self.timing.total_line());
        }
        out
    }

    /// The line naming the dense table's runs that moved no bytes (columns, and copies-free
    /// reruns), if any.
    fn dense_payload_line(&self) -> Option<String> {
        let mut runs: Vec<(String, PayloadUsed)> = self
            .runs
            .iter()
            .map(|s| (s.label.clone(), s.cache.payload))
            .collect();
        let free = self.runs.iter().filter_map(|s| {
            let p = s.free_copy_payload?;
            Some((format!("{} copies free", s.label), p))
        });
        runs.extend(free);
        payload_line(&runs)
    }

    /// The line naming the hybrid table's columns (and copies-free reruns) that moved no
    /// bytes, if any.
    fn hybrid_payload_line(&self) -> Option<String> {
        let mut runs: Vec<(String, PayloadUsed)> = Vec::new();
        for h in &self.hybrid {
            for s in &h.runs {
                let name = format!("{} {}", h.model.name, s.label);
                if let Some(p) = s.free_copy_payload {
                    runs.push((format!("{name} copies free"), p));
                }
                runs.push((name, s.cache.payload));
            }
        }
        payload_line(&runs)
    }

    /// One table per hybrid model: without prefix caching and through the hybrid cache at
    /// each configuration of the ladder, on the same workload.
    fn hybrid_table(&self) -> String {
        let mut out = String::new();
        for h in &self.hybrid {
            let _ = writeln!(
                out,
                "\nhybrid model {}, same workload (its own compute model; F/S/M: Full KV / \
                 sliding-window KV / Mamba states):",
                h.model.name
            );
            let cols: Vec<&Summary> = h.all().collect();
            let header: Vec<String> = cols.iter().map(|s| s.label.clone()).collect();
            let mut timing = timing_rows();
            timing.truncate(7);
            let wall = health_rows().pop();
            let rows = [
                hit_rows(),
                component_rows(),
                timing,
                copy_cost_rows(),
                wall.into_iter().collect(),
            ];
            write_columns(&mut out, &header, &cols, rows.into_iter().flatten());
        }
        out
    }

    /// A warning naming every configuration whose L3 lost pages to storage errors (`None`
    /// when none did): its L3 figures are not what the tier can do, and its bytes moved to
    /// L3 count only the pages stored.
    pub fn l3_error_warning(&self) -> Option<String> {
        let bad: Vec<String> = self
            .all()
            .filter(|s| s.cache.metrics.l3_write_failures + s.cache.metrics.l3_read_failures > 0)
            .map(|s| {
                format!(
                    "{} ({} pages not written, {} not read)",
                    s.label, s.cache.metrics.l3_write_failures, s.cache.metrics.l3_read_failures
                )
            })
            .collect();
        (!bad.is_empty()).then(|| {
            format!(
                "WARNING: L3 storage errors lost pages in {}: their L3 hits and hit ratio are \
                 lower than the tier gives (bytes moved to L3 count only pages stored); check \
                 the backend (open-file limit, disk space, its server) and rerun.",
                bad.join(", ")
            )
        })
    }

    /// One line stating how copies were timed.
    pub fn link_model(&self) -> String {
        let c = &self.compute;
        match self.engine.copy_time {
            CopyTime::Charged => format!(
                "copy time charged: D2H write-through {:.1} GB/s (own link), L3 {:.1} GB/s shared \
                 by prefetch reads and backup writes, H2D {:.1} GB/s overlapped with prefill; a \
                 page counts in L2/L3 only once its copy completed in simulated time. Hits lost \
                 to copies: hit tokens of the same run with copies free minus these (negative: \
                 gained).",
                c.d2h_bytes_per_s / 1e9,
                c.l3_bytes_per_s / 1e9,
                c.h2d_bytes_per_s / 1e9
            ),
            CopyTime::Free => "copy time free: write-through copies and L3 backups cost no \
                 simulated time (L2/L3 hits and TTFT are upper bounds)."
                .to_string(),
        }
    }

    /// One record per figure, in the bench output convention of [`Record`]. TTFT and throughput carry the no-cache figure as
    /// their reference.
    pub fn records(&self) -> Vec<Record> {
        let base = &self.baseline;
        let mut out = Vec::new();
        for s in self.all() {
            let reference = (!std::ptr::eq(s, base)).then_some(base);
            summary_records(&mut out, &slug(&s.label), s, reference);
        }
        for h in &self.hybrid {
            let model = slug(&h.model.name);
            summary_records(&mut out, &format!("{model}/no_cache"), &h.baseline, None);
            for run in &h.runs {
                let label = format!("{model}/{}", slug(&run.label));
                summary_records(&mut out, &label, run, Some(&h.baseline));
            }
        }
        out
    }

    /// Writes `report.json` and the plots into `dir` (which must exist); returns the paths.
    pub fn write_to(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        let json = dir.join("report.json");
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| BenchError::usage(format!("report.json: {e}")))?;
        std::fs::write(&json, text).map_err(BenchError::io(&json))?;
        let hits = dir.join("hit_ratio_per_round.svg");
        let cdf = dir.join("ttft_cdf.svg");
        let bw = dir.join("bandwidth.svg");
        // The baseline has no hits and moves nothing: plotted only in the TTFT CDF.
        let plot_err = |e: String| BenchError::usage(format!("writing a plot: {e}"));
        plot::hit_ratio_per_round(&hits, &self.runs, 1).map_err(plot_err)?;
        plot::ttft_cdf(&cdf, &self.all().cloned().collect::<Vec<_>>()).map_err(plot_err)?;
        plot::bandwidth(&bw, &self.runs, 1).map_err(plot_err)?;
        Ok(vec![json, hits, cdf, bw])
    }
}

/// Creates `dir` if needed and checks that a file can be written in it (so that a bad report
/// directory fails before the run, not after).
pub fn prepare_dir(dir: &Path) -> Result<()> {
    let unusable = |what: &str, e: std::io::Error| {
        BenchError::usage(format!(
            "report directory {}: cannot {what} it: {e}",
            dir.display()
        ))
    };
    std::fs::create_dir_all(dir).map_err(|e| unusable("create", e))?;
    let probe = dir.join(".hicache-bench-write-test");
    std::fs::write(&probe, b"").map_err(|e| unusable("write in", e))?;
    std::fs::remove_file(&probe).map_err(BenchError::io(&probe))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hicache::metrics::MetricsSnapshot;
    use hicache_sim::cache::{CacheStats, TransferStats};
    use hicache_sim::engine::{RequestRecord, RunResult};
    use std::time::Duration;

    fn run(hit: usize, ttft: f64, h2d_pages: u64) -> RunResult {
        let requests = (0..4)
            .map(|i| RequestRecord {
                id: i,
                conversation: format!("c{i}"),
                round: i as usize / 2,
                prompt_tokens: 128,
                answer_tokens: 8,
                arrival: i as f64,
                admitted: i as f64,
                first_token: i as f64 + ttft * (1.0 + i as f64 / 10.0),
                finished: i as f64 + 1.0,
                hit_l2: hit,
                computed: 128 - hit,
                ..RequestRecord::default()
            })
            .collect();
        RunResult {
            requests,
            steps: Vec::new(),
            cache: CacheStats {
                page_bytes: 100,
                metrics: MetricsSnapshot {
                    h2d: TransferStats {
                        pages: h2d_pages,
                        bytes: h2d_pages * 100,
                        seconds: 1e-6,
                        batches: 1,
                    },
                    hit_tokens_l2: 4 * hit as u64,
                    request_tokens: 512,
                    ..MetricsSnapshot::default()
                },
                ..CacheStats::default()
            },
            sim_seconds: 5.0,
            wall_seconds: 0.01,
            links: Default::default(),
        }
    }

    fn report() -> Report {
        let model = ModelShape::llama3_8b();
        Report {
            title: "test workload".into(),
            workload: serde_json::json!({"clients": 2}),
            setup: serde_json::json!({"page_size": 64}),
            compute: ComputeModel::h100(&model),
            model,
            engine: EngineConfig {
                max_prefill_tokens: 100,
                copy_time: Default::default(),
                layers: 32,
                page_bytes: 100,
                wall_wait_limit: Duration::from_secs(1),
            },
            page_size: 64,
            baseline: Summary::new("no cache", &run(0, 0.2, 0)),
            runs: vec![Summary::new("L1+L2", &run(64, 0.1, 4))],
            hybrid: Vec::new(),
            timing: Timing::default(),
        }
    }

    #[test]
    fn table_lists_every_configuration_side_by_side() {
        let r = report();
        assert!(r.check().is_empty(), "{:?}", r.check());
        let t = r.table();
        let header = t.lines().nth(1).unwrap();
        assert!(
            header.contains("no cache") && header.contains("L1+L2"),
            "{t}"
        );
        let p50 = t.lines().find(|l| l.starts_with("TTFT p50")).unwrap();
        assert!(p50.contains("220.0") && p50.contains("110.0"), "{p50}");
        let h2d = t.lines().find(|l| l.starts_with("moved L2→L1")).unwrap();
        assert!(h2d.contains('-') && h2d.contains("GB/s"), "{h2d}");
        assert!(t.contains("hit ratio") && t.contains("50.0%"), "{t}");
        let errors = t
            .lines()
            .find(|l| l.starts_with("L3 errors (write/read pages)"))
            .unwrap();
        assert!(errors.contains("0/0"), "{errors}");
        assert!(r.l3_error_warning().is_none());
    }

    #[test]
    fn l3_errors_are_a_row_a_json_field_and_a_warning() {
        let mut r = report();
        r.runs[0].cache.metrics.l3_write_failures = 7;
        r.runs[0].cache.metrics.l3_read_failures = 3;
        let t = r.table();
        let errors = t
            .lines()
            .find(|l| l.starts_with("L3 errors (write/read pages)"))
            .unwrap();
        assert!(errors.contains("7/3"), "{errors}");
        let w = r.l3_error_warning().unwrap();
        assert!(
            w.starts_with("WARNING") && w.contains("L1+L2 (7 pages not written, 3 not read)"),
            "{w}"
        );
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["runs"][0]["cache"]["l3_write_failures"], 7);
        assert_eq!(v["runs"][0]["cache"]["l3_read_failures"], 3);
    }

    #[test]
    fn records_carry_the_no_cache_reference() {
        let recs = report().records();
        let p50 = recs.iter().find(|r| r.case == "l1+l2/ttft_p50").unwrap();
        assert_eq!(p50.unit, "ms");
        assert!((p50.reference.unwrap() - 220.0).abs() < 1e-9);
        assert!((p50.ratio.unwrap() - 0.5).abs() < 1e-9);
        let base = recs.iter().find(|r| r.case == "no_cache/ttft_p50").unwrap();
        assert!(base.reference.is_none());
        let h2d = recs.iter().find(|r| r.case == "l1+l2/h2d").unwrap();
        assert_eq!(h2d.extra["pages"], 4);
        assert!(
            !recs.iter().any(|r| r.case == "no_cache/h2d"),
            "idle directions omitted"
        );
        let hr = recs.iter().find(|r| r.case == "l1+l2/hit_ratio").unwrap();
        assert_eq!(hr.value, 50.0);
        for r in &recs {
            serde_json::from_str::<serde_json::Value>(&r.to_json_line()).unwrap();
        }
    }

    #[test]
    fn writes_json_and_plots() {
        let dir = tempfile::tempdir().unwrap();
        let paths = report().write_to(dir.path()).unwrap();
        assert_eq!(paths.len(), 4);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&paths[0]).unwrap()).unwrap();
        assert_eq!(v["runs"][0]["label"], "L1+L2");
        assert_eq!(v["baseline"]["hits"]["l2"], 0);
        assert_eq!(v["runs"][0]["rounds"].as_array().unwrap().len(), 2);
        for p in &paths[1..] {
            let svg = std::fs::read_to_string(p).unwrap();
            assert!(
                svg.starts_with("<svg") && svg.contains("L1+L2"),
                "{}",
                p.display()
            );
        }
    }

    #[test]
    fn an_unwritable_directory_is_bad_input() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = prepare_dir(&file.join("sub")).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("sub"), "{e}");
        prepare_dir(&dir.path().join("a/b")).unwrap();
    }

    fn with_hybrid() -> Report {
        let mut r = report();
        let model = HybridModel::qwen35_9b();
        let mut run_h = Summary::new("L1+L2+L3", &run(64, 0.1, 4));
        let t = |pages: u64, bytes: u64| TransferStats {
            pages,
            bytes,
            ..TransferStats::default()
        };
        let mut moves = hicache_sim::HybridMoves::default();
        moves.full.h2d = t(4, 400);
        moves.mamba.d2h = t(2, 3_000_000_000);
        run_h.cache.components = Some(moves);
        r.hybrid.push(HybridColumn {
            compute: model.compute_h100(),
            model,
            page_bytes: 100,
            baseline: Summary::new("no cache", &run(0, 0.4, 0)),
            runs: vec![run_h],
        });
        r
    }

    #[test]
    fn hybrid_models_get_their_own_table_records_and_checks() {
        let r = with_hybrid();
        assert!(r.check().is_empty(), "{:?}", r.check());
        let t = r.table();
        let (_, hybrid) = t.split_once("hybrid model qwen3.5-9b").unwrap();
        let header = hybrid.lines().nth(1).unwrap();
        assert!(
            header.contains("no cache") && header.contains("L1+L2+L3"),
            "{hybrid}"
        );
        let d2h = hybrid
            .lines()
            .find(|l| l.starts_with("moved D2H F/S/M"))
            .unwrap();
        assert!(d2h.contains("0.00/0.00/3.00") && d2h.contains('-'), "{d2h}");
        let p50 = hybrid.lines().find(|l| l.starts_with("TTFT p50")).unwrap();
        assert!(p50.contains("440.0") && p50.contains("110.0"), "{p50}");
        let recs = r.records();
        let mamba = recs
            .iter()
            .find(|x| x.case == "qwen3.5-9b/l1+l2+l3/mamba_d2h")
            .unwrap();
        assert_eq!((mamba.value, mamba.unit.as_str()), (3.0, "GB"));
        assert_eq!(mamba.extra["pages"], 2);
        let p50 = recs
            .iter()
            .find(|x| x.case == "qwen3.5-9b/l1+l2+l3/ttft_p50")
            .unwrap();
        assert!(
            (p50.reference.unwrap() - 440.0).abs() < 1e-9,
            "its own no-cache run"
        );
        assert!(
            recs.iter()
                .any(|x| x.case == "qwen3.5-9b/no_cache/ttft_p50")
        );
        assert!(
            !recs.iter().any(|x| x.case == "qwen3.5-9b/l1+l2+l3/h2d"),
            "per component instead"
        );
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["hybrid"][0]["model"]["linear_layers"], 24);
        assert_eq!(
            v["hybrid"][0]["runs"][0]["cache"]["components"]["mamba"]["d2h"]["pages"],
            2
        );
        // A hybrid column that breaks the report's rules is reported.
        let mut bad = with_hybrid();
        bad.hybrid[0].runs[0].hits.l1 += 1;
        assert!(
            bad.check().iter().any(|e| e.contains("L1+L2+L3")),
            "{:?}",
            bad.check()
        );
    }
}
