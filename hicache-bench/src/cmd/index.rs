//! `index`: replays a fleet KV-event file through the fleet index (`hicache-index`) in
//! process, next to the reference index (`smg-radix-tree`) replaying the same file in the same
//! run.
//!
//! The file is JSON Lines (optionally gzip-compressed), one operation a line:
//! `{"op":"store","holder":H,"tier":"l1"|"l2"|"l3","parent":P|null,"hashes":[u64,…]}`,
//! `{"op":"remove","holder":H,"tier":T,"hashes":[…]}`, `{"op":"clear","holder":H}`,
//! `{"op":"attach","holder":H,"store":S}` (instance H reads the shared L3 store S, whose pages
//! arrive as `store`/`remove` lines with `"holder":S,"tier":"l3"`), and
//! `{"op":"query","hashes":[…]}` (hashes already chained; a prefix match stops at the first
//! block missing). A holder named as `store` in an `attach` line is a store, every other one an
//! instance. The file is parsed before the clock starts.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use hicache_index::{Answer, HolderId, HolderKind, Index, Tier};
use serde::Deserialize;

use crate::error::{BenchError, Result};
use crate::record::Record;

/// Flags of `hicache-bench index`.
#[derive(Debug, Clone, clap::Args)]
pub struct IndexArgs {
    /// The event file (JSON Lines, `.gz` for gzip); see `index-gen` to write one.
    #[arg(long)]
    pub events: PathBuf,
    /// One JSON object per measured case instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Writes one line per query: `{"q": i, "holders": {H: {"l1": n, "l2": n, "l3": n}}}`.
    #[arg(long)]
    pub answers: Option<PathBuf>,
    /// The index's capacity in holder-blocks (default: unbounded).
    #[arg(long)]
    pub capacity: Option<u64>,
    /// Skip the reference index.
    #[arg(long)]
    pub no_reference: bool,
    /// Also replays the file through Dynamo's `dynamo-kv-router`, by running this binary
    /// (`hicache-bench/refs/dynamo-index`, built apart: see its manifest) after our replay,
    /// and reports its figures as a second reference (`dynamo/…` cases).
    #[arg(long)]
    pub dynamo: Option<PathBuf>,
    /// Churn instead of one replay: replays the file's operations again and again through one
    /// index (bounded with `--capacity`) for this many minutes and reports the process RSS after
    /// each pass and its drift (see `index_churn`). No reference is run.
    #[arg(long)]
    pub churn_minutes: Option<f64>,
}

/// What the Dynamo reference binary reports (its summary line).
#[derive(Debug, Clone, Deserialize)]
pub struct DynamoReplay {
    /// Blocks named by store and remove lines.
    pub block_ops: u64,
    /// Block-ops per second of ingest.
    pub ingest_block_ops_per_s: f64,
    /// Query latency p50, microseconds.
    pub query_p50_us: f64,
    /// Query latency p99, microseconds.
    pub query_p99_us: f64,
    /// Holder-blocks at the end (its `current_size`).
    pub holder_blocks: u64,
    /// Process RSS growth per holder-block over its replay (it keeps no byte count).
    pub rss_growth_per_holder_block: f64,
}

/// Runs the Dynamo reference binary on `events` and reads its summary line.
pub fn replay_dynamo(bin: &Path, events: &Path) -> Result<DynamoReplay> {
    let out = std::process::Command::new(bin)
        .arg(events)
        .output()
        .map_err(BenchError::io(bin))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(BenchError::check_failed(format!(
            "{} failed ({}): {}",
            bin.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|e| {
        BenchError::check_failed(format!("{}: bad summary {line:?}: {e}", bin.display()))
    })
}

/// Our figures against Dynamo's (ratios as in [`records`]: above 1 = ours better).
pub fn dynamo_records(ours: &Replay, d: &DynamoReplay) -> Vec<Record> {
    let lower = |rec: Record, v: f64| {
        let mut rec = rec.with_reference(v);
        rec.ratio = (rec.value > 0.0).then(|| v / rec.value);
        rec
    };
    vec![
        Record::new("index", "dynamo/ingest", ours.ingest_rate(), "block-ops/s")
            .with_reference(d.ingest_block_ops_per_s)
            .with("reference_block_ops", d.block_ops)
            .with("reference_holder_blocks", d.holder_blocks),
        lower(
            Record::new("index", "dynamo/query/p50", ours.quantile(0.5), "us"),
            d.query_p50_us,
        ),
        lower(
            Record::new("index", "dynamo/query/p99", ours.quantile(0.99), "us"),
            d.query_p99_us,
        ),
        lower(
            Record::new(
                "index",
                "dynamo/rss_growth_per_holder_block",
                ours.per_holder_block(ours.rss_growth),
                "B",
            ),
            d.rss_growth_per_holder_block,
        ),
    ]
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum TierName {
    L1,
    L2,
    L3,
}

impl TierName {
    fn tier(&self) -> Tier {
        match self {
            TierName::L1 => Tier::L1,
            TierName::L2 => Tier::L2,
            TierName::L3 => Tier::L3,
        }
    }
}

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Line {
    Store {
        holder: u64,
        tier: TierName,
        #[serde(default)]
        parent: Option<u64>,
        hashes: Vec<u64>,
    },
    Remove {
        holder: u64,
        tier: TierName,
        hashes: Vec<u64>,
    },
    Clear {
        holder: u64,
    },
    Attach {
        holder: u64,
        store: u64,
    },
    Query {
        hashes: Vec<u64>,
    },
}

/// One parsed operation; hashes are a range of [`EventFile::hashes`], holders dense indices.
#[derive(Clone, Copy, Debug)]
enum Op {
    Store {
        holder: u32,
        tier: Tier,
        parent: Option<u64>,
        at: u32,
        len: u32,
    },
    Remove {
        holder: u32,
        tier: Tier,
        at: u32,
        len: u32,
    },
    Clear {
        holder: u32,
    },
    Attach {
        instance: u32,
        store: u32,
    },
    Query {
        at: u32,
        len: u32,
    },
}

/// A parsed event file.
pub struct EventFile {
    ops: Vec<Op>,
    hashes: Vec<u64>,
    /// The file's id of each dense holder, and whether it is a store.
    holders: Vec<(u64, bool)>,
}

impl EventFile {
    /// Operations in the file.
    pub fn op_count(&self) -> usize {
        self.ops.len()
    }

    /// Parses `path` (gzip when its name ends in `.gz`).
    pub fn read(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(BenchError::io(path))?;
        let input: Box<dyn BufRead> = if path.extension().is_some_and(|e| e == "gz") {
            Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(file)))
        } else {
            Box::new(BufReader::with_capacity(1 << 20, file))
        };
        let mut parsed = Self {
            ops: Vec::new(),
            hashes: Vec::new(),
            holders: Vec::new(),
        };
        let mut dense: HashMap<u64, u32> = HashMap::new();
        let mut holder = |id: u64, holders: &mut Vec<(u64, bool)>| {
            *dense.entry(id).or_insert_with(|| {
                holders.push((id, false));
                holders.len() as u32 - 1
            })
        };
        for (n, line) in input.lines().enumerate() {
            let line = line.map_err(BenchError::io(path))?;
            if line.trim().is_empty() {
                continue;
            }
            let bad = |e: serde_json::Error| {
                BenchError::usage(format!("{}:{}: {e}", path.display(), n + 1))
            };
            let hashes = &mut parsed.hashes;
            let mut range = |h: Vec<u64>| {
                let at = hashes.len() as u32;
                hashes.extend_from_slice(&h);
                (at, h.len() as u32)
            };
            let op = match serde_json::from_str::<Line>(&line).map_err(bad)? {
                Line::Store {
                    holder: h,
                    tier,
                    parent,
                    hashes,
                } => {
                    let (at, len) = range(hashes);
                    Op::Store {
                        holder: holder(h, &mut parsed.holders),
                        tier: tier.tier(),
                        parent,
                        at,
                        len,
                    }
                }
                Line::Remove {
                    holder: h,
                    tier,
                    hashes,
                } => {
                    let (at, len) = range(hashes);
                    Op::Remove {
                        holder: holder(h, &mut parsed.holders),
                        tier: tier.tier(),
                        at,
                        len,
                    }
                }
                Line::Clear { holder: h } => Op::Clear {
                    holder: holder(h, &mut parsed.holders),
                },
                Line::Attach { holder: h, store } => {
                    let instance = holder(h, &mut parsed.holders);
                    let store = holder(store, &mut parsed.holders);
                    parsed.holders[store as usize].1 = true;
                    Op::Attach { instance, store }
                }
                Line::Query { hashes } => {
                    let (at, len) = range(hashes);
                    Op::Query { at, len }
                }
            };
            parsed.ops.push(op);
        }
        for op in &parsed.ops {
            if let Op::Store {
                holder,
                tier: Tier::L1 | Tier::L2,
                ..
            } = op
                && parsed.holders[*holder as usize].1
            {
                return Err(BenchError::usage(format!(
                    "{}: store holder {} gets L1/L2 pages",
                    path.display(),
                    parsed.holders[*holder as usize].0
                )));
            }
        }
        Ok(parsed)
    }

    fn slice(&self, at: u32, len: u32) -> &[u64] {
        &self.hashes[at as usize..(at + len) as usize]
    }
}

/// What one replay measured.
#[derive(Clone, Debug, Default)]
pub struct Replay {
    /// Blocks named by store and remove operations.
    pub block_ops: u64,
    /// Seconds spent applying store/remove/clear/attach operations.
    pub ingest_s: f64,
    /// Query latencies, microseconds, sorted.
    pub query_us: Vec<f64>,
    /// Holder-blocks held at the end.
    pub holder_blocks: u64,
    /// The index's own accounting of its bytes at the end.
    pub bytes: u64,
    /// Process RSS at ten checkpoints through the replay, bytes.
    pub rss: Vec<u64>,
    /// Process RSS growth over the replay, bytes.
    pub rss_growth: u64,
}

/// The timing both replays share, so ours and the reference are measured alike: ingest time
/// is the wall time of the runs of non-query operations (queries are timed one by one), and
/// RSS is sampled at ten checkpoints through the file.
struct PhaseClock {
    checkpoint: usize,
    since: Instant,
    ingesting: bool,
}

impl PhaseClock {
    fn new(ops: usize) -> Self {
        Self {
            checkpoint: ops.div_ceil(10).max(1),
            since: Instant::now(),
            ingesting: true,
        }
    }

    /// Called before operation `n` is applied.
    fn step(&mut self, r: &mut Replay, n: usize, op: &Op) {
        if n % self.checkpoint == self.checkpoint - 1 {
            r.rss.push(rss_bytes());
        }
        let is_query = matches!(op, Op::Query { .. });
        if is_query && self.ingesting {
            r.ingest_s += self.since.elapsed().as_secs_f64();
            self.ingesting = false;
        } else if !is_query && !self.ingesting {
            self.since = Instant::now();
            self.ingesting = true;
        }
    }

    /// Called after the last operation.
    fn finish(&self, r: &mut Replay) {
        if self.ingesting {
            r.ingest_s += self.since.elapsed().as_secs_f64();
        }
    }
}

impl Replay {
    fn ingest_rate(&self) -> f64 {
        self.block_ops as f64 / self.ingest_s.max(1e-9)
    }

    fn quantile(&self, q: f64) -> f64 {
        if self.query_us.is_empty() {
            return 0.0;
        }
        let i = ((self.query_us.len() - 1) as f64 * q).round() as usize;
        self.query_us[i]
    }

    fn per_holder_block(&self, bytes: u64) -> f64 {
        bytes as f64 / self.holder_blocks.max(1) as f64
    }

    /// RSS spread over the last 80 % of the checkpoints, in percent of their mean.
    fn rss_drift_pct(&self) -> f64 {
        let tail = &self.rss[self.rss.len() / 5..];
        if tail.is_empty() {
            return 0.0;
        }
        let (lo, hi) = (*tail.iter().min().unwrap(), *tail.iter().max().unwrap());
        let mean = tail.iter().sum::<u64>() as f64 / tail.len() as f64;
        100.0 * (hi - lo) as f64 / mean.max(1.0)
    }
}

/// Resident set size of this process, bytes (0 where /proc is not there).
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// An index fed with an event file's operations: the index and its ids of the file's holders.
pub struct FileIndex {
    idx: Index,
    ids: Vec<HolderId>,
}

impl FileIndex {
    /// An index of `capacity` holder-blocks (unbounded: `None`) with `file`'s holders added.
    pub fn new(file: &EventFile, capacity: Option<u64>) -> Result<Self> {
        let mut idx = Index::new(capacity);
        let ids = file
            .holders
            .iter()
            .map(|&(_, store)| {
                let kind = if store {
                    HolderKind::Store
                } else {
                    HolderKind::Instance
                };
                idx.add_holder(kind)
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| BenchError::usage(e.to_string()))?;
        Ok(Self { idx, ids })
    }

    /// Applies `file`'s operation `n` (a query is answered into `out`); the block-ops it named.
    pub fn apply(&mut self, file: &EventFile, n: usize, out: &mut Answer) -> Result<u64> {
        let fail = |e: hicache_index::IndexError| BenchError::check_failed(e.to_string());
        let id = |h: u32| self.ids[h as usize];
        match file.ops[n] {
            Op::Store {
                holder,
                tier,
                at,
                len,
                ..
            } => {
                self.idx
                    .store(id(holder), tier, file.slice(at, len))
                    .map_err(fail)?;
                Ok(u64::from(len))
            }
            Op::Remove {
                holder,
                tier,
                at,
                len,
            } => {
                self.idx
                    .remove(id(holder), tier, file.slice(at, len))
                    .map_err(fail)?;
                Ok(u64::from(len))
            }
            Op::Clear { holder } => {
                self.idx.clear(id(holder)).map_err(fail)?;
                Ok(0)
            }
            Op::Attach { instance, store } => {
                self.idx.attach(id(instance), id(store)).map_err(fail)?;
                Ok(0)
            }
            Op::Query { at, len } => {
                self.idx.query(file.slice(at, len), out);
                Ok(0)
            }
        }
    }

    /// The index.
    pub fn index(&self) -> &Index {
        &self.idx
    }
}

/// Replays `file` through hicache-index; writes answers to `answers` when given.
pub fn replay_ours(
    file: &EventFile,
    capacity: Option<u64>,
    mut answers: Option<&mut dyn Write>,
) -> Result<Replay> {
    let rss0 = rss_bytes();
    let mut fi = FileIndex::new(file, capacity)?;
    let mut r = Replay::default();
    let mut out = Answer::new();
    let mut line = String::new();
    let mut clock = PhaseClock::new(file.ops.len());
    for (n, op) in file.ops.iter().enumerate() {
        clock.step(&mut r, n, op);
        if !matches!(op, Op::Query { .. }) {
            r.block_ops += fi.apply(file, n, &mut out)?;
            continue;
        }
        let t = Instant::now();
        fi.apply(file, n, &mut out)?;
        r.query_us.push(t.elapsed().as_secs_f64() * 1e6);
        if let Some(w) = answers.as_deref_mut() {
            answer_line(&mut line, r.query_us.len() - 1, &out, file);
            w.write_all(line.as_bytes())
                .map_err(|e| BenchError::check_failed(format!("answers: {e}")))?;
        }
    }
    clock.finish(&mut r);
    let stats = fi.index().stats();
    r.holder_blocks = stats.holder_blocks;
    r.bytes = stats.bytes;
    r.rss_growth = rss_bytes().saturating_sub(rss0);
    r.query_us.sort_by(f64::total_cmp);
    Ok(r)
}

fn answer_line(line: &mut String, q: usize, out: &Answer, file: &EventFile) {
    use std::fmt::Write as _;
    line.clear();
    let _ = write!(line, "{{\"q\":{q},\"holders\":{{");
    for (i, m) in out.iter().enumerate() {
        let id = file.holders[m.holder.0 as usize].0;
        let sep = if i > 0 { "," } else { "" };
        let _ = write!(
            line,
            "{sep}\"{id}\":{{\"l1\":{},\"l2\":{},\"l3\":{}}}",
            m.l1, m.l2, m.l3
        );
    }
    line.push_str("}}\n");
}

/// Replays `file` through the reference, `smg-radix-tree`: one of its holders per (holder,
/// tier) of the file, a chain stored under its parent (re-anchored at the root where the
/// holder lacks the parent, as its contract prescribes), queries answered per holder-tier
/// (it has no notion of an instance reading a store, so `attach` is not applied).
pub fn replay_reference(file: &EventFile) -> Replay {
    use radix_tree::{OverlapScratch, RadixTree, StoreError};
    let rss0 = rss_bytes();
    let mut tree = RadixTree::new(Default::default());
    let mut ids: HashMap<(u32, u8), radix_tree::HolderId> = HashMap::new();
    let mut id_of = |tree: &mut RadixTree, h: u32, t: Tier| {
        *ids.entry((h, t.bit()))
            .or_insert_with(|| tree.create_holder(&format!("{h}/{t:?}")))
    };
    let mut r = Replay::default();
    let mut scratch = OverlapScratch::default();
    let mut out = Vec::new();
    let mut blocks: Vec<(u64, u64)> = Vec::new();
    let mut clock = PhaseClock::new(file.ops.len());
    for (n, op) in file.ops.iter().enumerate() {
        clock.step(&mut r, n, op);
        match *op {
            Op::Store {
                holder,
                tier,
                parent,
                at,
                len,
            } => {
                let id = id_of(&mut tree, holder, tier);
                blocks.clear();
                blocks.extend(file.slice(at, len).iter().map(|&h| (h, h)));
                if let Err(StoreError::ParentNotFound) = tree.store(id, parent, &blocks) {
                    let _ = tree.store(id, None, &blocks);
                }
                r.block_ops += u64::from(len);
            }
            Op::Remove {
                holder,
                tier,
                at,
                len,
            } => {
                let id = id_of(&mut tree, holder, tier);
                tree.remove(id, file.slice(at, len));
                r.block_ops += u64::from(len);
            }
            Op::Clear { holder } => {
                for t in [Tier::L1, Tier::L2, Tier::L3] {
                    let id = id_of(&mut tree, holder, t);
                    tree.clear(id);
                }
            }
            Op::Attach { .. } => {}
            Op::Query { at, len } => {
                let t = Instant::now();
                tree.overlap(file.slice(at, len), &mut scratch, &mut out);
                r.query_us.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    clock.finish(&mut r);
    let stats = tree.stats();
    r.holder_blocks = stats.holder_blocks;
    r.bytes = stats.bytes_estimate;
    r.rss_growth = rss_bytes().saturating_sub(rss0);
    r.query_us.sort_by(f64::total_cmp);
    r
}

/// The bench's records: ours, with the reference and ratios where one ran (for throughput
/// the ratio is ours / reference, for latency and bytes reference / ours: above 1 = better).
pub fn records(ours: &Replay, reference: Option<&Replay>, queries: usize) -> Vec<Record> {
    let rss = rss_bytes();
    let with = |rec: Record, v: Option<f64>, better_lower: bool| match v {
        Some(v) if better_lower => {
            let mut rec = rec.with_reference(v);
            rec.ratio = (rec.value > 0.0).then(|| v / rec.value);
            rec
        }
        Some(v) => rec.with_reference(v),
        None => rec,
    };
    vec![
        with(
            Record::new("index", "ingest", ours.ingest_rate(), "block-ops/s"),
            reference.map(Replay::ingest_rate),
            false,
        ),
        with(
            Record::new("index", "query/p50", ours.quantile(0.5), "us"),
            reference.map(|r| r.quantile(0.5)),
            true,
        ),
        with(
            Record::new("index", "query/p99", ours.quantile(0.99), "us"),
            reference.map(|r| r.quantile(0.99)),
            true,
        ),
        with(
            Record::new(
                "index",
                "bytes_per_holder_block",
                ours.per_holder_block(ours.bytes),
                "B",
            ),
            reference.map(|r| r.per_holder_block(r.bytes)),
            true,
        ),
        with(
            Record::new(
                "index",
                "rss_growth_per_holder_block",
                ours.per_holder_block(ours.rss_growth),
                "B",
            ),
            reference.map(|r| r.per_holder_block(r.rss_growth)),
            true,
        ),
        Record::new("index", "summary", ours.ingest_rate(), "block-ops/s")
            .with("block_ops", ours.block_ops)
            .with("ingest_block_ops_per_s", ours.ingest_rate())
            .with("queries", queries as u64)
            .with("query_p50_us", ours.quantile(0.5))
            .with("query_p99_us", ours.quantile(0.99))
            .with("holder_blocks", ours.holder_blocks)
            .with("bytes", ours.bytes)
            .with("bytes_per_holder_block", ours.per_holder_block(ours.bytes))
            .with("rss_bytes", rss)
            .with("rss_growth_bytes", ours.rss_growth)
            .with("rss_drift_pct", ours.rss_drift_pct()),
    ]
}

/// Runs `hicache-bench index`.
pub fn run(args: &IndexArgs, mut out: impl Write) -> Result<()> {
    let file = EventFile::read(&args.events)?;
    if let Some(minutes) = args.churn_minutes {
        let c = super::index_churn::churn(&file, args.capacity, minutes)?;
        return c.report(args.json, out);
    }
    let queries = file
        .ops
        .iter()
        .filter(|o| matches!(o, Op::Query { .. }))
        .count();
    let ours = match &args.answers {
        Some(path) => {
            let f = std::fs::File::create(path).map_err(BenchError::io(path))?;
            let mut w = BufWriter::new(f);
            let r = replay_ours(&file, args.capacity, Some(&mut w))?;
            w.flush().map_err(BenchError::io(path))?;
            r
        }
        None => replay_ours(&file, args.capacity, None)?,
    };
    let reference = (!args.no_reference).then(|| replay_reference(&file));
    let mut records = records(&ours, reference.as_ref(), queries);
    let summary = records.pop().expect("records end with the summary");
    if let Some(bin) = &args.dynamo {
        records.extend(dynamo_records(&ours, &replay_dynamo(bin, &args.events)?));
    }
    records.push(summary);
    let io = |e| BenchError::check_failed(format!("writing the report: {e}"));
    if args.json {
        for r in &records {
            writeln!(out, "{}", r.to_json_line()).map_err(io)?;
        }
        return Ok(());
    }
    writeln!(
        out,
        "fleet index: {} ops, {} block-ops, {} queries, {} holders; reference smg-radix-tree {}",
        file.ops.len(),
        ours.block_ops,
        queries,
        file.holders.len(),
        if reference.is_some() {
            "measured"
        } else {
            "skipped"
        }
    )
    .map_err(io)?;
    writeln!(
        out,
        "{:<30} {:>14} {:>14} {:>8}",
        "case", "hicache-index", "reference", "ratio"
    )
    .map_err(io)?;
    for r in &records[..records.len() - 1] {
        writeln!(
            out,
            "{:<30} {:>14.3} {:>14} {:>8}",
            format!("{} ({})", r.case, r.unit),
            r.value,
            r.reference.map_or("-".into(), |v| format!("{v:.3}")),
            r.ratio.map_or("-".into(), |v| format!("{v:.2}x")),
        )
        .map_err(io)?;
    }
    writeln!(
        out,
        "holder-blocks {}, index bytes {}, process RSS {} MiB, RSS drift over the replay {:.1} %",
        ours.holder_blocks,
        ours.bytes,
        rss_bytes() >> 20,
        ours.rss_drift_pct()
    )
    .map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_file_replays_with_answers_per_instance() {
        let dir = tempfile::tempdir().unwrap();
        let events = dir.path().join("e.jsonl");
        std::fs::write(
            &events,
            r#"{"op":"attach","holder":1,"store":9}
{"op":"store","holder":1,"tier":"l1","parent":null,"hashes":[10,11]}
{"op":"store","holder":1,"tier":"l2","parent":null,"hashes":[10,11,12]}
{"op":"store","holder":9,"tier":"l3","parent":null,"hashes":[10,11,12,13]}
{"op":"store","holder":2,"tier":"l1","parent":null,"hashes":[10]}
{"op":"query","hashes":[10,11,12,13,14]}
{"op":"remove","holder":9,"tier":"l3","hashes":[13]}
{"op":"clear","holder":2}
{"op":"query","hashes":[10,11,12,13]}
"#,
        )
        .unwrap();
        let answers = dir.path().join("a.jsonl");
        let args = IndexArgs {
            events,
            json: true,
            answers: Some(answers.clone()),
            capacity: None,
            no_reference: false,
            dynamo: None,
            churn_minutes: None,
        };
        let mut out = Vec::new();
        run(&args, &mut out).unwrap();
        let text = std::fs::read_to_string(answers).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                r#"{"q":0,"holders":{"1":{"l1":2,"l2":3,"l3":4},"2":{"l1":1,"l2":1,"l3":1}}}"#,
                r#"{"q":1,"holders":{"1":{"l1":2,"l2":3,"l3":3}}}"#,
            ]
        );
        let report = String::from_utf8(out).unwrap();
        let summary: serde_json::Value =
            serde_json::from_str(report.lines().last().unwrap()).unwrap();
        assert_eq!(summary["case"], "summary");
        assert_eq!(summary["queries"], 2);
        assert_eq!(summary["block_ops"], 11);
        assert_eq!(summary["holder_blocks"], 8);
    }

    #[test]
    fn a_bad_line_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let events = dir.path().join("e.jsonl");
        std::fs::write(
            &events,
            "{\"op\":\"query\",\"hashes\":[1]}\n{\"op\":\"fly\"}\n",
        )
        .unwrap();
        let err = EventFile::read(&events).err().unwrap().to_string();
        assert!(err.contains("e.jsonl:2"), "{err}");
    }
}
