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

/// Runs the bench.
pub fn run(args: &LoadbackArgs, mut out: impl Write) -> Result<()> {
    let tokens = args.tokens.unwrap_or(match args.device {
        DeviceArg::Cuda => 32768,
        DeviceArg::Sim => 4096,
    });
    let ps = args.page_size as usize;
    if ps == 0 || tokens < ps || args.iters == 0 {
        return Err(BenchError::Usage(format!(
            "--tokens ({tokens}) must hold at least one page of --page-size ({ps}); --iters ≥ 1"
        )));
    }
    let shape: KvShape = args.model.shape(args.page_size);
    let pages = tokens / ps;
    let device = match args.device {
        DeviceArg::Sim => Device::sim(),
        DeviceArg::Cuda => {
            Device::cuda(0).map_err(|e| BenchError::Usage(format!("no CUDA device: {e}")))?
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
    let fail =
        |e: hicache::HiCacheError| BenchError::CheckFailed(format!("cache call failed: {e}"));
    let mut cache = HiCache::builder(cfg)
        .shape(shape)
        .device(device.clone())
        .device_pages(pages + 2)
        .build()
        .map_err(|e| BenchError::Usage(format!("cannot build the cache: {e}")))?;
    let prompt: Vec<u32> = (0..pages * ps)
        .map(|i| (i as u32 * 2654435761) % 128_000)
        .collect();
    // Cache the prefix, back it up to host, then evict it from device.
    cache.arrive(0, &prompt).map_err(fail)?;
    cache.admit(0, &prompt).map_err(fail)?;
    let slots = cache
        .alloc_device(pages)
        .map_err(fail)?
        .ok_or_else(|| BenchError::CheckFailed("device pool too small".into()))?;
    cache.cache_finished(0, &prompt, &slots).map_err(fail)?;
    cache.drain().map_err(fail)?;
    let bytes = (pages * shape.page_bytes()) as f64;
    let layers = shape.layers as usize;
    let counter = cache.layer_done_counter().clone();
    let mut load_gbps = Vec::new();
    let mut forward_ms = Vec::new();
    for it in 0..args.iters {
        cache.evict(pages).map_err(fail)?;
        let id = 1 + it as u64;
        cache.arrive(id, &prompt).map_err(fail)?;
        let adm = cache.admit(id, &prompt).map_err(fail)?;
        if adm.host_pages != pages {
            return Err(BenchError::CheckFailed(format!(
                "expected a load-back of {pages} pages, got {:?}",
                (adm.device_pages, adm.host_pages)
            )));
        }
        let t0 = Instant::now();
        let producer = cache
            .start_loading()
            .map_err(fail)?
            .ok_or_else(|| BenchError::CheckFailed("nothing to load".into()))?;
        counter
            .set_consumer(producer)
            .map_err(|e| BenchError::CheckFailed(e.to_string()))?;
        let mut ready_last = Duration::ZERO;
        for layer in 0..layers {
            counter
                .wait_until(layer)
                .map_err(|e| BenchError::CheckFailed(e.to_string()))?;
            ready_last = t0.elapsed();
            let c0 = Instant::now();
            while c0.elapsed() < Duration::from_micros(args.compute_us_per_layer) {
                std::hint::spin_loop();
            }
        }
        forward_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        load_gbps.push(bytes / ready_last.as_secs_f64() / 1e9);
        cache.abort(id).map_err(fail)?;
        cache.drain().map_err(fail)?;
    }
    // Reference: one bulk copy of the same bytes from the pinned host pool, same run.
    let scratch = device
        .alloc_zeroed(pages * shape.page_bytes())
        .map_err(|e| BenchError::CheckFailed(e.to_string()))?;
    let mut bulk = Vec::new();
    for _ in 0..args.iters {
        let t0 = Instant::now();
        cache
            .transfer_engine()
            .bulk_copy(
                Direction::ToDevice,
                &scratch,
                pages * shape.page_bytes(),
                &[],
            )
            .and_then(|c| c.wait())
            .map_err(|e| BenchError::CheckFailed(e.to_string()))?;
        bulk.push(bytes / t0.elapsed().as_secs_f64() / 1e9);
    }
    cache.shutdown().map_err(fail)?;
    let (load, reference, fwd) = (median(load_gbps), median(bulk), median(forward_ms));
    let compute_ms = (layers as u64 * args.compute_us_per_layer) as f64 / 1e3;
    let case = format!(
        "{}/{}/{}tok/overlapped-load",
        args.model.name(),
        device.name(),
        pages * ps
    );
    let rec = Record::new("loadback", case, load, "GB/s")
        .with_reference(reference)
        .with("forward_ms", fwd)
        .with("compute_ms", compute_ms)
        .with("bytes", bytes as u64)
        .with("pages", pages)
        .with("iters", args.iters);
    let wr = BenchError::io("<stdout>");
    if args.json {
        writeln!(out, "{}", rec.to_json_line()).map_err(wr)?;
    } else {
        writeln!(
            out,
            "load-back of {} tokens ({:.2} GB) overlapped with a {}-layer forward on {}: load {:.2} GB/s, bulk pinned copy {:.2} GB/s (ratio {:.2}); forward {:.2} ms vs {:.2} ms of pure compute",
            pages * ps,
            bytes / 1e9,
            layers,
            device.name(),
            load,
            reference,
            load / reference,
            fwd,
            compute_ms
        )
        .map_err(wr)?;
    }
    Ok(())
}
