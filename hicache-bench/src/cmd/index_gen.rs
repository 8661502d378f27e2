//! `index-gen`: writes a fleet KV-event file for `hicache-bench index` from a request trace,
//! by simulating a fleet of instances serving it.
//!
//! Sources: the Mooncake FAST'25 trace format (`hash_ids` of 512-token blocks; equal ids are
//! equal prefixes), replayed `--passes` times with the ids of each pass salted apart (a larger
//! user population), or our multi-turn workload (hicache-sim's generator, its flags), whose
//! tokens are chained into page hashes with the index's own chain.
//!
//! The fleet: `--holders` instances, each reading one of `--stores` shared L3 stores
//! (instance `i` reads store `holders + i % stores`, announced by `attach` lines first). Each
//! request is first queried, then routed (to the instance its second block hashes to, a
//! conversation sticking to one instance, or with `--random-routing` probability to any), and
//! served: the instance's L1 stores the blocks it lacks and evicts its least recently used
//! blocks beyond `--l1-blocks` (a chain's tail first), its L2 backs the same blocks up (LRU,
//! `--l2-blocks`), its store writes them back (LRU, `--l3-blocks` per store). With
//! `--restart-every N`, one request in N first restarts its instance (a `clear`, its L1 and L2
//! emptied).

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::PathBuf;

use hicache_index::ChainHasher;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{BenchError, Result};

/// Where the requests come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Source {
    /// A Mooncake FAST'25 trace (`--trace`).
    Mooncake,
    /// hicache-sim's multi-turn workload.
    Multiturn,
}

/// Flags of `hicache-bench index-gen`.
#[derive(Debug, Clone, clap::Args)]
pub struct IndexGenArgs {
    /// The request source.
    #[arg(long, value_enum)]
    pub from: Source,
    /// The Mooncake trace (JSON Lines with `hash_ids`, `.gz` for gzip).
    #[arg(
        long,
        default_value = "../shared/traces/mooncake_conversation_trace.jsonl.gz"
    )]
    pub trace: PathBuf,
    /// The event file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Instances.
    #[arg(long, default_value_t = 64)]
    pub holders: u64,
    /// Shared L3 stores (default: one per 8 instances).
    #[arg(long)]
    pub stores: Option<u64>,
    /// Each instance's L1 capacity in blocks.
    #[arg(long, default_value_t = 1024)]
    pub l1_blocks: usize,
    /// Each instance's L2 capacity in blocks.
    #[arg(long, default_value_t = 4096)]
    pub l2_blocks: usize,
    /// Each store's capacity in blocks.
    #[arg(long, default_value_t = 65_536)]
    pub l3_blocks: usize,
    /// Mooncake: replays of the trace, each pass's ids salted apart.
    #[arg(long, default_value_t = 1)]
    pub passes: u64,
    /// Probability that a request goes to a random instance instead of its conversation's.
    #[arg(long, default_value_t = 0.1)]
    pub random_routing: f64,
    /// One request in N first restarts its instance (0: never).
    #[arg(long, default_value_t = 0)]
    pub restart_every: u64,
    /// Seed of the routing and restarts (and of the multi-turn tokens).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Multi-turn: concurrent conversations.
    #[arg(long, default_value_t = 256)]
    pub clients: usize,
    /// Multi-turn: turns per conversation.
    #[arg(long, default_value_t = 8)]
    pub rounds: usize,
    /// Multi-turn: tokens of the shared system prompt.
    #[arg(long, default_value_t = 1024)]
    pub system_tokens: usize,
    /// Multi-turn: tokens of each user turn.
    #[arg(long, default_value_t = 512)]
    pub user_tokens: usize,
    /// Multi-turn: tokens of each answer.
    #[arg(long, default_value_t = 256)]
    pub answer_tokens: usize,
    /// Multi-turn: tokens per page.
    #[arg(long, default_value_t = 64)]
    pub page_size: usize,
}

/// An LRU set of blocks: the least recently used first, a request's deeper blocks before its
/// shallower ones.
#[derive(Default)]
struct Lru {
    last: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl Lru {
    fn contains(&self, b: u64) -> bool {
        self.last.contains_key(&b)
    }

    fn touch(&mut self, b: u64, stamp: u64) {
        if let Some(old) = self.last.insert(b, stamp) {
            self.order.remove(&old);
        }
        self.order.insert(stamp, b);
    }

    fn evict_beyond(&mut self, cap: usize, out: &mut Vec<u64>) {
        while self.last.len() > cap {
            let (_, b) = self.order.pop_first().expect("non-empty");
            self.last.remove(&b);
            out.push(b);
        }
    }

    fn clear(&mut self) {
        self.last.clear();
        self.order.clear();
    }
}

struct Fleet<W: Write> {
    out: W,
    holders: u64,
    stores: u64,
    l1: Vec<Lru>,
    l2: Vec<Lru>,
    l3: Vec<Lru>,
    caps: [usize; 3],
    request: u64,
    rng: ChaCha8Rng,
    random_routing: f64,
    restart_every: u64,
    lines: u64,
}

fn list(hashes: &[u64]) -> String {
    let mut s = String::with_capacity(hashes.len() * 12);
    for (i, h) in hashes.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&h.to_string());
    }
    s
}

impl<W: Write> Fleet<W> {
    fn line(&mut self, text: std::fmt::Arguments<'_>) -> Result<()> {
        self.lines += 1;
        self.out
            .write_fmt(text)
            .and_then(|()| self.out.write_all(b"\n"))
            .map_err(|e| BenchError::check_failed(format!("writing the event file: {e}")))
    }

    fn start(&mut self) -> Result<()> {
        for i in 0..self.holders {
            let s = self.holders + i % self.stores;
            self.line(format_args!(
                r#"{{"op":"attach","holder":{i},"store":{s}}}"#
            ))?;
        }
        Ok(())
    }

    /// One tier of one holder serves `chain`: stores what it lacks, evicts beyond capacity.
    fn serve(&mut self, holder: u64, tier: usize, chain: &[u64]) -> Result<()> {
        let stamp = self.request << 20;
        let lru = match tier {
            0 => &mut self.l1[holder as usize],
            1 => &mut self.l2[holder as usize],
            _ => &mut self.l3[(holder - self.holders) as usize],
        };
        let first_missing = chain.iter().position(|b| !lru.contains(*b));
        for (pos, &b) in chain.iter().enumerate() {
            lru.touch(b, stamp | (0xF_FFFF - pos.min(0xF_FFFF) as u64));
        }
        let mut evicted = Vec::new();
        lru.evict_beyond(self.caps[tier], &mut evicted);
        let name = ["l1", "l2", "l3"][tier];
        if let Some(at) = first_missing {
            let parent = at
                .checked_sub(1)
                .map_or("null".to_string(), |p| chain[p].to_string());
            let hashes = list(&chain[at..]);
            self.line(format_args!(
                r#"{{"op":"store","holder":{holder},"tier":"{name}","parent":{parent},"hashes":[{hashes}]}}"#
            ))?;
        }
        if !evicted.is_empty() {
            let hashes = list(&evicted);
            self.line(format_args!(
                r#"{{"op":"remove","holder":{holder},"tier":"{name}","hashes":[{hashes}]}}"#
            ))?;
        }
        Ok(())
    }

    /// One request: queried, routed, served.
    fn request(&mut self, chain: &[u64]) -> Result<()> {
        if chain.is_empty() {
            return Ok(());
        }
        self.request += 1;
        let hashes = list(chain);
        self.line(format_args!(r#"{{"op":"query","hashes":[{hashes}]}}"#))?;
        let key = chain[1.min(chain.len() - 1)];
        let instance = if self.rng.random_bool(self.random_routing) {
            self.rng.random_range(0..self.holders)
        } else {
            key.wrapping_mul(0x9E37_79B9_7F4A_7C15) % self.holders
        };
        if self.restart_every > 0 && self.rng.random_range(0..self.restart_every) == 0 {
            self.l1[instance as usize].clear();
            self.l2[instance as usize].clear();
            self.line(format_args!(r#"{{"op":"clear","holder":{instance}}}"#))?;
        }
        self.serve(instance, 0, chain)?;
        self.serve(instance, 1, chain)?;
        self.serve(self.holders + instance % self.stores, 2, chain)
    }
}

/// Runs `hicache-bench index-gen`; prints a one-line summary.
pub fn run(args: &IndexGenArgs, mut report: impl Write) -> Result<()> {
    if args.holders == 0 {
        return Err(BenchError::usage("--holders must be at least 1"));
    }
    let stores = args.stores.unwrap_or(args.holders.div_ceil(8)).max(1);
    let file = std::fs::File::create(&args.out).map_err(BenchError::io(&args.out))?;
    let mut fleet = Fleet {
        out: BufWriter::with_capacity(1 << 20, file),
        holders: args.holders,
        stores,
        l1: (0..args.holders).map(|_| Lru::default()).collect(),
        l2: (0..args.holders).map(|_| Lru::default()).collect(),
        l3: (0..stores).map(|_| Lru::default()).collect(),
        caps: [args.l1_blocks, args.l2_blocks, args.l3_blocks],
        request: 0,
        rng: ChaCha8Rng::seed_from_u64(args.seed),
        random_routing: args.random_routing.clamp(0.0, 1.0),
        restart_every: args.restart_every,
        lines: 0,
    };
    fleet.start()?;
    match args.from {
        Source::Mooncake => {
            let chains = read_mooncake(&args.trace)?;
            for pass in 0..args.passes {
                for c in &chains {
                    let salted: Vec<u64> = c.iter().map(|id| pass << 32 | id).collect();
                    fleet.request(&salted)?;
                }
            }
        }
        Source::Multiturn => {
            let workload = hicache_sim::trace::MultiTurn {
                clients: args.clients,
                rounds: args.rounds,
                system_tokens: args.system_tokens,
                user_tokens: args.user_tokens,
                answer_tokens: args.answer_tokens,
                vocab: 128_000,
                seed: args.seed,
            };
            let hasher = ChainHasher::new(args.page_size);
            for request in workload.generate() {
                let mut chain = Vec::new();
                let mut parent = None;
                for page in request.tokens.chunks_exact(hasher.page_size()) {
                    let h = hasher.block(parent, page);
                    chain.push(h);
                    parent = Some(h);
                }
                fleet.request(&chain)?;
            }
        }
    }
    fleet
        .out
        .flush()
        .map_err(|e| BenchError::check_failed(format!("writing the event file: {e}")))?;
    writeln!(
        report,
        "wrote {}: {} lines, {} requests, {} instances, {} stores",
        args.out.display(),
        fleet.lines,
        fleet.request,
        args.holders,
        stores
    )
    .map_err(|e| BenchError::check_failed(e.to_string()))
}

fn read_mooncake(path: &PathBuf) -> Result<Vec<Vec<u64>>> {
    #[derive(serde::Deserialize)]
    struct Req {
        hash_ids: Vec<u64>,
    }
    let file = std::fs::File::open(path).map_err(BenchError::io(path))?;
    let input: Box<dyn BufRead> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(file)))
    } else {
        Box::new(BufReader::new(file))
    };
    let mut out = Vec::new();
    for (n, line) in input.lines().enumerate() {
        let line = line.map_err(BenchError::io(path))?;
        if line.trim().is_empty() {
            continue;
        }
        let req: Req = serde_json::from_str(&line)
            .map_err(|e| BenchError::usage(format!("{}:{}: {e}", path.display(), n + 1)))?;
        out.push(req.hash_ids);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::index::EventFile;

    #[test]
    fn a_generated_file_replays() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("e.jsonl");
        let args = IndexGenArgs {
            from: Source::Multiturn,
            trace: PathBuf::new(),
            out: out.clone(),
            holders: 4,
            stores: None,
            l1_blocks: 16,
            l2_blocks: 32,
            l3_blocks: 64,
            passes: 1,
            random_routing: 0.2,
            restart_every: 10,
            seed: 3,
            clients: 4,
            rounds: 3,
            system_tokens: 64,
            user_tokens: 64,
            answer_tokens: 32,
            page_size: 16,
        };
        run(&args, std::io::sink()).unwrap();
        let file = EventFile::read(&out).unwrap();
        let r = crate::cmd::index::replay_ours(&file, None, None).unwrap();
        assert_eq!(r.query_us.len(), 12);
        // Capacities bound what the fleet holds: 4 × (16 + 32) + 1 × 64.
        assert!(r.holder_blocks > 0 && r.holder_blocks <= 4 * 48 + 64);
    }
}
