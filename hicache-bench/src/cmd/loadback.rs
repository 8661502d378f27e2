//! `hicache-bench loadback`: a load-back of a long prefix from L2 overlapped with a simulated
//! forward pass, through the whole controller.
//!
//! A prefix of `--tokens` tokens is cached, backed up to host, evicted from device, then
//! admitted again: `admit` plans the load-back, `start_loading` launches it layer by layer, and
//! a simulated forward walks the layers, waiting on the `LayerDoneCounter` for each layer and
//! then spending `--compute-us-per-layer` on it. Reported: the load's achieved bandwidth (bytes
//! over the time until the last layer was ready), next to one bulk pinned copy of the same bytes
//! measured in the same run, and the forward's total time against the pure compute time.
//! On the sim device figures are CPU memcpy-bound and say nothing about a GPU.

use std::io::Write;
use std::time::{Duration, Instant};

use clap::Args;
use hicache::{Device, HiCache, HiCacheConfig, KvShape};
use hicache_gpu::Direction;

use crate::cmd::transfer::{DeviceArg, ModelArg};
use crate::error::{BenchError, Result};
use crate::record::Record;

/// Arguments of `loadback`.
#[derive(Debug, Args)]
pub struct LoadbackArgs {
    /// Device.
    #[arg(long, value_enum, default_value = "sim")]
    pub device: DeviceArg,
    /// KV shape.
    #[arg(long, value_enum, default_value = "llama3-8b")]
    pub model: ModelArg,
    /// Prefix length in tokens (32768 on a GPU; the sim default is smaller to fit in RAM).
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_size: u32,
    /// Simulated compute time per layer, in microseconds.
    #[arg(long, default_value_t = 200)]
    pub compute_us_per_layer: u64,
    /// Io backend of the transfer engine.
    #[arg(long, value_enum, default_value = "kernel")]
    pub io: IoArg,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// One JSON line per figure instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Io backend.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IoArg {
    /// Gather/scatter kernels.
    Kernel,
    /// DMA copies.
    Direct,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The load-back under measurement: a cache holding the prompt's pages on host only, and the
/// device it loads them to.
struct Loadback {
    cache: HiCache,
    device: Device,
    prompt: Vec<u32>,
    pages: usize,
    shape: KvShape,
}

fn fail(e: hicache::HiCacheError) -> BenchError {
    BenchError::check_failed(format!("cache call failed: {e}"))
}

impl Loadback {
    /// Builds the cache and caches a prompt of `pages` pages, backed up to host.
    fn new(args: &LoadbackArgs, pages: usize) -> Result<Self> {
        let shape: KvShape = args.model.shape(args.page_size);
        let device = match args.device {
            DeviceArg::Sim => Device::sim(),
            DeviceArg::Cuda => {
                Device::cuda(0).map_err(|e| BenchError::usage(format!("no CUDA device: {e}")))?
            }
        };
        let cfg = HiCacheConfig {
            page_size: args.page_size,
            io_backend: match args.io {
                IoArg::Kernel => hicache::IoBackendKind::Kernel,
                IoArg::Direct => hicache::IoBackendKind::Direct,
            },
            hicache_ratio: 1.5,
            host_reserve_bytes: Some(0),
            ..Default::default()
        };
        let mut cache = HiCache::builder(cfg)
            .shape(shape)
            .device(device.clone())
            .device_pages(pages + 2)
            .build()
            .map_err(|e| BenchError::usage(format!("cannot build the cache: {e}")))?;
        let prompt: Vec<u32> = (0..pages * args.page_size as usize)
            .map(|i| (i as u32 * 2654435761) % 128_000)
            .collect();
        // Cache the prefix and back it up to host.
        cache.arrive(0, &prompt).map_err(fail)?;
        cache.admit(0, &prompt).map_err(fail)?;
        let slots = cache
            .alloc_device(pages)
            .map_err(fail)?
            .ok_or_else(|| BenchError::check_failed("device pool too small"))?;
        cache.cache_finished(0, &prompt, &slots).map_err(fail)?;
        cache.drain().map_err(fail)?;
        Ok(Loadback {
            cache,
            device,
            prompt,
            pages,
            shape,
        })
    }

    fn bytes(&self) -> f64 {
        (self.pages * self.shape.page_bytes()) as f64
    }

    /// Iteration `it`: evicts the prefix from device, admits it again and loads it back
    /// layer by layer under a simulated forward of `compute_us` per layer. Returns the load's
    /// GB/s (until the last layer was ready) and the forward's milliseconds.
    fn iteration(&mut self, it: usize, compute_us: u64) -> Result<(f64, f64)> {
        let (cache, pages) = (&mut self.cache, self.pages);
        cache.evict(pages).map_err(fail)?;
        let id = 1 + it as u64;
        cache.arrive(id, &self.prompt).map_err(fail)?;
        let adm = cache.admit(id, &self.prompt).map_err(fail)?;
        if adm.host_pages != pages {
            return Err(BenchError::check_failed(format!(
                "expected a load-back of {pages} pages, got {:?}",
                (adm.device_pages, adm.host_pages)
            )));
        }
        let counter = cache.layer_done_counter().clone();
        let t0 = Instant::now();
        let producer = cache
            .start_loading()
            .map_err(fail)?
            .ok_or_else(|| BenchError::check_failed("nothing to load"))?;
        counter
            .set_consumer(producer)
            .map_err(|e| BenchError::check_failed(e.to_string()))?;
        let mut ready_last = Duration::ZERO;
        for layer in 0..self.shape.layers as usize {
            counter
                .wait_until(layer)
                .map_err(|e| BenchError::check_failed(e.to_string()))?;
            ready_last = t0.elapsed();
            let c0 = Instant::now();
            while c0.elapsed() < Duration::from_micros(compute_us) {
                std::hint::spin_loop();
            }
        }
        let forward_ms = t0.elapsed().as_secs_f64() * 1e3;
        cache.abort(id).map_err(fail)?;
        cache.drain().map_err(fail)?;
        Ok((self.bytes() / ready_last.as_secs_f64() / 1e9, forward_ms))
    }

    /// The reference: GB/s of one bulk copy of the same bytes from the pinned host pool.
    fn bulk(&self) -> Result<f64> {
        let len = self.pages * self.shape.page_bytes();
        let scratch = self
            .device
            .alloc_zeroed(len)
            .map_err(|e| BenchError::check_failed(e.to_string()))?;
        let t0 = Instant::now();
        self.cache
            .bulk_copy(Direction::ToDevice, &scratch, len)
            .map_err(|e| BenchError::check_failed(e.to_string()))?;
        Ok(self.bytes() / t0.elapsed().as_secs_f64() / 1e9)
    }
}

/// Runs the bench.
pub fn run(args: &LoadbackArgs, mut out: impl Write) -> Result<()> {
    let tokens = args.tokens.unwrap_or(match args.device {
        DeviceArg::Cuda => 32768,
        DeviceArg::Sim => 4096,
    });
    let ps = args.page_size as usize;
    if ps == 0 || tokens < ps || args.iters == 0 {
        return Err(BenchError::usage(format!(
            "--tokens ({tokens}) must hold at least one page of --page-size ({ps}); --iters ≥ 1"
        )));
    }
    let pages = tokens / ps;
    let mut lb = Loadback::new(args, pages)?;
    let (mut load_gbps, mut forward_ms) = (Vec::new(), Vec::new());
    for it in 0..args.iters {
        let (gbps, ms) = lb.iteration(it, args.compute_us_per_layer)?;
        load_gbps.push(gbps);
        forward_ms.push(ms);
    }
    // Reference: one bulk copy of the same bytes from the pinned host pool, same run.
    let bulk = (0..args.iters)
        .map(|_| lb.bulk())
        .collect::<Result<Vec<_>>>()?;
    lb.cache.shutdown().map_err(fail)?;
    let (load, reference, fwd) = (median(load_gbps), median(bulk), median(forward_ms));
    let layers = lb.shape.layers as usize;
    let compute_ms = (layers as u64 * args.compute_us_per_layer) as f64 / 1e3;
    let (bytes, device) = (lb.bytes(), lb.device.name());
    let case = format!(
        "{}/{device}/{}tok/overlapped-load",
        args.model.name(),
        pages * ps
    );
    let rec = Record::new("loadback", case, load, "GB/s")
        .with_reference(reference)
        .with("forward_ms", fwd)
        .with("compute_ms", compute_ms)
        .with("bytes", bytes as u64)
        .with("pages", pages)
        .with("iters", args.iters);
    let line = if args.json {
        rec.to_json_line()
    } else {
        format!(
            "load-back of {} tokens ({:.2} GB) overlapped with a {layers}-layer forward on {device}: load {load:.2} GB/s, bulk pinned copy {reference:.2} GB/s (ratio {:.2}); forward {fwd:.2} ms vs {compute_ms:.2} ms of pure compute",
            pages * ps,
            bytes / 1e9,
            load / reference,
        )
    };
    writeln!(out, "{line}").map_err(BenchError::io("<stdout>"))
}
