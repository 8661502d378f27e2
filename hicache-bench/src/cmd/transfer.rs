//! `hicache-bench transfer`: L1↔L2 page transfers of scattered pages, next to the bulk pinned
//! copy of the same byte count measured in the same run.
//!
//! For each page count, host layout and io backend it measures
//! - `backup`: all layers of N scattered device pages into N scattered host pages (D2H),
//! - `load`: the same pages back, layer by layer with an event per layer (H2D),
//!
//! and as the reference, one bulk copy of the same bytes between a device buffer and the
//! page-locked host pool (`cuMemcpy{DtoH,HtoD}Async`; on the sim device a plain memcpy, so
//! sim figures are CPU memcpy-bound and say nothing about a GPU). Each figure is the median of
//! `--iters` timed runs after one warm-up run.
//!
//! `--verify` first runs each case once on pools filled with random bytes and compares every
//! byte of both pools with a host-side reference written from the layout definitions (the
//! destination pages hold exactly the source rows, every other byte is untouched); a mismatch
//! fails the run (exit 1). It is on by default under the emulated driver (`hicache-cuda-emu`),
//! whose figures are CPU copies: they are labelled `emulated` and are never GPU speed.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use clap::{Args, ValueEnum};
use hicache_core::{KvShape, LayoutKind};
use hicache_gpu::{
    Device, DevicePool, DeviceSlot, Direction, HostRegistration, IoBackend, TransferConfig,
    TransferEngine,
};
use hicache_host::{HostPool, HostPoolConfig, HostSlot, PoolSize};
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};

use crate::error::{BenchError, Result};
use crate::record::Record;

/// Which device runs the transfers.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// CUDA device 0.
    Cuda,
    /// The sim device (host memory; CPU memcpy-bound figures).
    Sim,
}

/// KV shape.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModelArg {
    /// 32 layers, 8 KV heads of 128, bf16 (MHA).
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// 61 layers, 576-wide latent, bf16 (MLA).
    #[value(name = "deepseek-v3-mla")]
    DeepseekV3Mla,
}

impl ModelArg {
    /// The KV shape of this model at `page_size`.
    pub fn shape(self, page_size: u32) -> KvShape {
        match self {
            ModelArg::Llama3_8b => KvShape::llama3_8b(page_size),
            ModelArg::DeepseekV3Mla => KvShape::deepseek_v3_mla(page_size),
        }
    }

    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            ModelArg::Llama3_8b => "llama3-8b",
            ModelArg::DeepseekV3Mla => "deepseek-v3-mla",
        }
    }
}

/// Io backend.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum IoArg {
    /// Gather/scatter kernels.
    Kernel,
    /// Batched DMA copies.
    Direct,
    /// Kernels, with backups gathered into device staging buffers of `--staged-pages` pages
    /// and moved by DMA (loads as `kernel`).
    Staged,
}

/// Host layout.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum LayoutArg {
    /// `[h][l][p·ps+t][row]`.
    LayerFirst,
    /// `[h][p·ps+t][l][row]`.
    PageFirst,
    /// `[h][p][l][t][row]`.
    PageFirstDirect,
}

impl LayoutArg {
    fn kind(self) -> LayoutKind {
        match self {
            LayoutArg::LayerFirst => LayoutKind::LayerFirst,
            LayoutArg::PageFirst => LayoutKind::PageFirst,
            LayoutArg::PageFirstDirect => LayoutKind::PageFirstDirect,
        }
    }
}

/// Arguments of `transfer`.
#[derive(Debug, Args)]
pub struct TransferArgs {
    /// Device.
    #[arg(long, value_enum, default_value = "sim")]
    pub device: DeviceArg,
    /// KV shape.
    #[arg(long, value_enum, default_value = "llama3-8b")]
    pub model: ModelArg,
    /// Page counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    pub pages: Vec<usize>,
    /// Io backends, comma-separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "kernel,direct"
    )]
    pub io: Vec<IoArg>,
    /// Host layouts, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "page_first")]
    pub layout: Vec<LayoutArg>,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_size: u32,
    /// CTAs per kernel launch (bounds the SMs used).
    #[arg(long, default_value_t = TransferConfig::default().ctas)]
    pub ctas: u32,
    /// Threads per CTA.
    #[arg(long, default_value_t = TransferConfig::default().threads_per_cta)]
    pub threads: u32,
    /// Bytes per warp work item.
    #[arg(long, default_value_t = TransferConfig::default().chunk_bytes)]
    pub chunk_bytes: u32,
    /// Pages per staging buffer of the `staged` io variant.
    #[arg(long, default_value_t = 32)]
    pub staged_pages: u32,
    /// Timed runs per figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Seed of the page scattering.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// One JSON object per case instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Check every byte of every direction against a host-side reference before timing
    /// (`--verify`, `--verify=false`); default: on under the emulated driver, off otherwise.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub verify: Option<bool>,
}

pub use hicache_sim::setup::is_emulated;

/// Both pools' bytes: every device page (flat `[h][l][t][row]`), every host page (flat
/// layout order).
type Snapshot = (Vec<Vec<u8>>, Vec<Vec<u8>>);

fn snapshot(device: &DevicePool, host: &HostPool) -> Result<Snapshot> {
    let pb = host.page_bytes();
    let dev = (0..device.num_pages() as u32)
        .map(|p| {
            let mut b = vec![0u8; pb];
            device.read_page(DeviceSlot(p), &mut b).map_err(gpu_err)?;
            Ok(b)
        })
        .collect::<Result<_>>()?;
    let hst = (0..host.num_pages() as u32)
        .map(|p| {
            let mut b = vec![0u8; pb];
            host.get_page(HostSlot(p), &mut b).map_err(host_err)?;
            Ok(b)
        })
        .collect::<Result<_>>()?;
    Ok((dev, hst))
}

/// Fills every page of both pools with random bytes.
fn randomize(device: &DevicePool, host: &HostPool, seed: u64) -> Result<()> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut page = vec![0u8; host.page_bytes()];
    for p in 0..device.num_pages() as u32 {
        rng.fill_bytes(&mut page);
        device.write_page(DeviceSlot(p), &page).map_err(gpu_err)?;
    }
    for p in 0..host.num_pages() as u32 {
        rng.fill_bytes(&mut page);
        host.set_page(HostSlot(p), &page).map_err(host_err)?;
    }
    Ok(())
}

/// The host-side reference: `before` with every row of the pairs copied in `dir`, computed
/// from the layout definitions alone (device rows at `((h·L + l)·ps + t)·R`, host rows at
/// `HostLayout::flat_offset`).
fn reference(
    before: &Snapshot,
    host: &HostPool,
    dir: Direction,
    dev: &[DeviceSlot],
    hst: &[HostSlot],
) -> Snapshot {
    let (mut d, mut h) = before.clone();
    let shape = host.shape();
    let layout = host.layout();
    let (r, ps, nl) = (
        shape.row_bytes(),
        shape.page_size as usize,
        shape.layers as usize,
    );
    for (dp, hp) in dev.iter().zip(hst) {
        let (dp, hp) = (dp.0 as usize, hp.0 as usize);
        for half in 0..shape.halves() {
            for l in 0..nl {
                for t in 0..ps {
                    let doff = ((half * nl + l) * ps + t) * r;
                    let hoff = layout.flat_offset(half, l, t);
                    match dir {
                        Direction::ToHost => {
                            h[hp][hoff..hoff + r].copy_from_slice(&before.0[dp][doff..doff + r])
                        }
                        Direction::ToDevice => {
                            d[dp][doff..doff + r].copy_from_slice(&before.1[hp][hoff..hoff + r])
                        }
                    }
                }
            }
        }
    }
    (d, h)
}

/// The first difference between `got` and `want`, as `(pool, page, byte)`.
fn first_difference(got: &Snapshot, want: &Snapshot) -> Option<(&'static str, usize, usize)> {
    for (pool, g, w) in [("device", &got.0, &want.0), ("host", &got.1, &want.1)] {
        for (page, (a, b)) in g.iter().zip(w).enumerate() {
            if let Some(byte) = a.iter().zip(b).position(|(x, y)| x != y) {
                return Some((pool, page, byte));
            }
        }
    }
    None
}

/// Runs the transfer of `dir` once on random pools and compares every byte of both pools
/// with [`reference`]; loads also check that every layer's event completes.
fn verify(
    engine: &TransferEngine,
    dir: Direction,
    dev: &[DeviceSlot],
    hst: &[HostSlot],
    seed: u64,
    case: &str,
) -> Result<()> {
    let (dp, hp) = (engine.device_pool(), engine.host_pool());
    randomize(dp, hp, seed)?;
    let before = snapshot(dp, hp)?;
    match dir {
        Direction::ToHost => engine
            .backup(dev, hst, &[])
            .and_then(|c| c.wait())
            .map_err(gpu_err)?,
        Direction::ToDevice => {
            let h = engine.load(hst, dev, &[]).map_err(gpu_err)?;
            for l in 0..h.num_layers() {
                h.wait_layer(l).map_err(gpu_err)?;
            }
        }
    }
    let got = snapshot(dp, hp)?;
    let want = reference(&before, hp, dir, dev, hst);
    match first_difference(&got, &want) {
        None => Ok(()),
        Some((pool, page, byte)) => Err(BenchError::check_failed(format!(
            "transfer {case}: {pool} page {page} differs from the host-side reference at byte \
             {byte}"
        ))),
    }
}

fn gpu_err(e: hicache_gpu::GpuError) -> BenchError {
    BenchError::usage(format!("transfer: {e}"))
}

fn host_err(e: hicache_host::HostError) -> BenchError {
    BenchError::usage(format!("transfer: {e}"))
}

/// Median seconds of `iters` runs of `f` after one warm-up.
fn median_secs(iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t: Vec<f64> = (0..iters.max(1))
        .map(|_| {
            let t0 = Instant::now();
            f().map(|_| t0.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// The header: the device, what the reference is, whether bytes are verified; the columns.
fn header(args: &TransferArgs, device: &Device, emulated: bool, verify_on: bool) -> String {
    format!(
        "transfer on {} ({:?}); reference = one bulk pinned copy of the same bytes{}{}\n\
         {:<16} {:<18} {:<7} {:>6} {:<7} {:>9} {:>9} {:>6} {:>4}",
        device.name(),
        device.kind(),
        if args.device == DeviceArg::Sim {
            " (sim: CPU memcpy, not GPU speed)"
        } else if emulated {
            " (EMULATED driver: CPU copies, not GPU speed)"
        } else {
            ""
        },
        if verify_on {
            "; every byte verified against the host-side reference"
        } else {
            ""
        },
        "model",
        "layout",
        "io",
        "pages",
        "dir",
        "GB/s",
        "ref GB/s",
        "ratio",
        "SMs"
    )
}

/// The transfer engine's configuration for `--io` `io`.
fn engine_config(args: &TransferArgs, io: IoArg) -> TransferConfig {
    TransferConfig {
        io: match io {
            IoArg::Kernel | IoArg::Staged => IoBackend::Kernel,
            IoArg::Direct => IoBackend::Direct,
        },
        ctas: args.ctas,
        threads_per_cta: args.threads,
        chunk_bytes: args.chunk_bytes,
        staged_backup_pages: if io == IoArg::Staged {
            args.staged_pages
        } else {
            0
        },
    }
}

/// One engine's cases (both directions) of `n` scattered pages.
struct EngineCases<'a> {
    args: &'a TransferArgs,
    device: &'a Device,
    engine: TransferEngine,
    config: TransferConfig,
    /// Direct copies the engine plans for these pages (every layer).
    copies: usize,
    layout: LayoutArg,
    io_name: &'static str,
    dev: &'a [DeviceSlot],
    host: &'a [HostSlot],
    scratch: &'a hicache_gpu::DeviceBuffer,
    emulated: bool,
    verify_on: bool,
}

impl EngineCases<'_> {
    /// Measures `dir` (verified first with `--verify`) against the bulk copy: the JSON record
    /// or the table row.
    fn measure(&self, dir: Direction) -> Result<String> {
        let (args, engine, n) = (self.args, &self.engine, self.dev.len());
        let bytes = n * args.model.shape(args.page_size).page_bytes();
        let dir_name = match dir {
            Direction::ToHost => "backup",
            Direction::ToDevice => "load",
        };
        let layout = self.layout.kind().as_str();
        let case = format!(
            "{}/{layout}/{}/{dir_name}/{n}p",
            args.model.name(),
            self.io_name
        );
        if self.verify_on {
            verify(
                engine,
                dir,
                self.dev,
                self.host,
                args.seed ^ n as u64,
                &case,
            )?;
        }
        let t = median_secs(args.iters, || {
            match dir {
                Direction::ToHost => engine
                    .backup(self.dev, self.host, &[])
                    .and_then(|c| c.wait()),
                Direction::ToDevice => engine.load(self.host, self.dev, &[]).and_then(|h| h.wait()),
            }
            .map_err(gpu_err)
        })?;
        let r = median_secs(args.iters, || {
            engine
                .bulk_copy(dir, self.scratch, bytes, &[])
                .and_then(|c| c.wait())
                .map_err(gpu_err)
        })?;
        let gbs = bytes as f64 / t / 1e9;
        let ref_gbs = bytes as f64 / r / 1e9;
        if !args.json {
            return Ok(format!(
                "{:<16} {:<18} {:<7} {:>6} {:<7} {:>9.2} {:>9.2} {:>6.3} {:>4}{}",
                args.model.name(),
                layout,
                self.io_name,
                n,
                dir_name,
                gbs,
                ref_gbs,
                gbs / ref_gbs,
                engine.sms_used(),
                if self.emulated { " emulated" } else { "" }
            ));
        }
        Ok(Record::new("transfer", case, gbs, "GB/s")
            .with_reference(ref_gbs)
            .with("device", self.device.name())
            .with("bytes", bytes as u64)
            .with("pages", n as u64)
            .with("sms", engine.sms_used())
            .with("ctas", self.config.ctas)
            .with("threads", self.config.threads_per_cta)
            .with("word_bytes", engine.word_bytes())
            .with("direct_copies", self.copies as u64)
            .with("staged_pages", self.config.staged_backup_pages)
            .with("iters", args.iters as u64)
            .with("verified", self.verify_on)
            .with("emulated", self.emulated)
            .to_json_line())
    }
}

/// Runs the bench, writing records (or a table) to `out`.
pub fn run(args: &TransferArgs, mut out: impl Write) -> Result<()> {
    if args.pages.is_empty() || args.pages.contains(&0) {
        return Err(BenchError::usage("--pages needs positive page counts"));
    }
    let device = match args.device {
        DeviceArg::Cuda => Device::cuda(0).map_err(gpu_err)?,
        DeviceArg::Sim => Device::sim(),
    };
    let shape = args.model.shape(args.page_size);
    shape.validate()?;
    let emulated = is_emulated(&device);
    let verify_on = args.verify.unwrap_or(emulated);
    let mut w = |s: String| writeln!(out, "{s}").map_err(BenchError::io("<stdout>"));
    if !args.json {
        w(header(args, &device, emulated, verify_on))?;
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    for &n in &args.pages {
        // Pools a quarter larger than the transfer, so scattered pages leave gaps.
        let pool_pages = n + n / 4 + 1;
        let device_pool = Arc::new(DevicePool::new(&device, shape, pool_pages).map_err(gpu_err)?);
        let scratch = device
            .alloc_zeroed(n * shape.page_bytes())
            .map_err(gpu_err)?;
        let mut dev: Vec<u32> = (0..pool_pages as u32).collect();
        dev.shuffle(&mut rng);
        let dev: Vec<DeviceSlot> = dev[..n].iter().map(|&p| DeviceSlot(p)).collect();
        for &layout in &args.layout {
            let host_pool = Arc::new(
                HostPool::new(HostPoolConfig::new(
                    shape,
                    layout.kind(),
                    PoolSize::Pages(pool_pages),
                ))
                .map_err(host_err)?,
            );
            let mut host: Vec<u32> = (0..pool_pages as u32).collect();
            host.shuffle(&mut rng);
            let host: Vec<HostSlot> = host[..n].iter().map(|&p| HostSlot(p)).collect();
            let reg = HostRegistration::new(&device, host_pool.clone()).map_err(gpu_err)?;
            for &io in &args.io {
                let config = engine_config(args, io);
                let engine = TransferEngine::new(device_pool.clone(), reg.clone(), config)
                    .map_err(gpu_err)?;
                let copies = engine
                    .direct_plan(&dev, &host, 0..shape.layers)
                    .map_err(gpu_err)?
                    .len();
                let cases = EngineCases {
                    args,
                    device: &device,
                    engine,
                    config,
                    copies,
                    layout,
                    io_name: match io {
                        IoArg::Staged => "staged",
                        _ => config.io.as_str(),
                    },
                    dev: &dev,
                    host: &host,
                    scratch: &scratch,
                    emulated,
                    verify_on,
                };
                for dir in [Direction::ToHost, Direction::ToDevice] {
                    w(cases.measure(dir)?)?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TransferArgs,
    }

    #[test]
    fn sim_run_writes_one_record_per_case() {
        let cli = Cli::parse_from([
            "t",
            "--device",
            "sim",
            "--model",
            "deepseek-v3-mla",
            "--pages",
            "3",
            "--page-size",
            "4",
            "--layout",
            "layer_first,page_first_direct",
            "--io",
            "kernel,direct,staged",
            "--staged-pages",
            "2",
            "--iters",
            "1",
            "--json",
        ]);
        let mut out = Vec::new();
        run(&cli.args, &mut out).unwrap();
        let lines: Vec<serde_json::Value> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        // 2 layouts × 3 io × 2 directions.
        assert_eq!(lines.len(), 12);
        assert_eq!(
            lines[0]["case"],
            "deepseek-v3-mla/layer_first/kernel/backup/3p"
        );
        for l in &lines {
            assert_eq!(l["bench"], "transfer");
            assert_eq!(l["device"], "sim");
            assert!(l["value"].as_f64().unwrap() > 0.0);
            assert!(l["reference"].as_f64().unwrap() > 0.0);
            assert!(l["ratio"].is_number());
        }
    }

    #[test]
    fn verify_checks_every_case_on_sim() {
        let cli = Cli::parse_from([
            "t",
            "--model",
            "llama3-8b",
            "--pages",
            "3",
            "--page-size",
            "2",
            "--layout",
            "layer_first,page_first,page_first_direct",
            "--io",
            "kernel,direct,staged",
            "--staged-pages",
            "2",
            "--iters",
            "1",
            "--verify",
            "--json",
        ]);
        assert_eq!(cli.args.verify, Some(true));
        let mut out = Vec::new();
        run(&cli.args, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 18);
        for l in text.lines() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["verified"], true);
            assert_eq!(v["emulated"], false);
        }
        let off = Cli::parse_from(["t", "--verify=false"]);
        assert_eq!(off.args.verify, Some(false));
        assert_eq!(Cli::parse_from(["t"]).args.verify, None);
    }

    /// The reference catches a transfer that moved the wrong rows: a plan that copies the
    /// pairs with host pages swapped differs from the reference of the requested pairs.
    #[test]
    fn the_reference_catches_wrong_bytes() {
        let shape = KvShape::deepseek_v3_mla(2);
        let device = Device::sim();
        let dev_pool = Arc::new(DevicePool::new(&device, shape, 3).unwrap());
        let host_pool = Arc::new(
            HostPool::new(HostPoolConfig::new(
                shape,
                LayoutKind::PageFirst,
                PoolSize::Pages(3),
            ))
            .unwrap(),
        );
        let reg = HostRegistration::new(&device, host_pool.clone()).unwrap();
        let engine = TransferEngine::new(dev_pool, reg, TransferConfig::default()).unwrap();
        let (d, h) = ([DeviceSlot(0), DeviceSlot(1)], [HostSlot(2), HostSlot(0)]);
        verify(&engine, Direction::ToHost, &d, &h, 1, "ok").unwrap();
        let (dp, hp) = (engine.device_pool(), engine.host_pool());
        randomize(dp, hp, 2).unwrap();
        let before = snapshot(dp, hp).unwrap();
        engine
            .backup(&d, &[HostSlot(0), HostSlot(2)], &[])
            .unwrap()
            .wait()
            .unwrap();
        let got = snapshot(dp, hp).unwrap();
        let want = reference(&before, hp, Direction::ToHost, &d, &h);
        assert_eq!(first_difference(&got, &want).map(|d| d.0), Some("host"));
    }

    #[test]
    fn bad_page_counts_are_usage_errors() {
        let cli = Cli::parse_from(["t", "--pages", "0"]);
        let e = run(&cli.args, Vec::new()).unwrap_err();
        assert_eq!(e.exit_code(), 2);
    }
}
