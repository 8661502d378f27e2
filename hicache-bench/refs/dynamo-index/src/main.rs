//! Replays a fleet KV-event file (the JSON Lines of `hicache-bench index`) through Dynamo's
//! `dynamo-kv-router` `RadixTree`, timed as `hicache-bench index` times its own replays, and
//! prints one JSON line with the same fields.
//!
//! Usage: `hicache-bench-dynamo-index FILE`.
//!
//! Mapping, the same as the bench's `smg-radix-tree` reference: one Dynamo worker (dp rank 0)
//! per (holder, tier) of the file, worker id `holder_index × 4 + tier`; a `store` line is a
//! `Stored` event under its parent, re-applied at the root where the worker lacks the parent
//! (Dynamo rejects the event with `ParentBlockNotFound` then); the file's chained hashes serve
//! as both the block hash and the tokens hash (a chained hash names its position, so the tree
//! matches exactly as it would with token hashes); `remove` is `Removed`; `clear` is `Cleared`
//! for the holder's three workers; `attach` is not applied (Dynamo has no instance reading a
//! shared store); `query` is `find_matches(hashes, false)`. Dynamo keeps no byte count of its
//! own: its bytes are the process RSS growth over the replay.
//!
//! Timing: the file is parsed before the clock starts; ingest is the wall time of the runs of
//! non-query lines, each query is timed alone.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::ExitCode;
use std::time::Instant;

use dynamo_kv_router::RadixTree;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheEventError,
    KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use serde_json::Value;

/// One parsed line.
enum Op {
    Store {
        worker: u64,
        parent: Option<u64>,
        hashes: Vec<u64>,
    },
    Remove {
        worker: u64,
        hashes: Vec<u64>,
    },
    Clear {
        holder: u64,
    },
    Query {
        hashes: Vec<u64>,
    },
    Skip,
}

fn tier_index(t: &str) -> Result<u64, String> {
    match t {
        "l1" => Ok(0),
        "l2" => Ok(1),
        "l3" => Ok(2),
        other => Err(format!("unknown tier {other:?}")),
    }
}

fn hashes_of(v: &Value) -> Result<Vec<u64>, String> {
    v["hashes"]
        .as_array()
        .ok_or("no \"hashes\" list")?
        .iter()
        .map(|h| h.as_u64().ok_or_else(|| format!("bad hash {h}")))
        .collect()
}

fn parse(path: &str) -> Result<Vec<Op>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{path}: {e}"))?;
    let mut dense: HashMap<u64, u64> = HashMap::new();
    let mut ops = Vec::new();
    for (n, line) in BufReader::with_capacity(1 << 20, file).lines().enumerate() {
        let line = line.map_err(|e| format!("{path}: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = |e: String| format!("{path}:{}: {e}", n + 1);
        let v: Value = serde_json::from_str(&line).map_err(|e| at(e.to_string()))?;
        let mut holder = |v: &Value| -> Result<u64, String> {
            let id = v.as_u64().ok_or("no holder id")?;
            let next = dense.len() as u64;
            Ok(*dense.entry(id).or_insert(next))
        };
        let op = match v["op"].as_str().unwrap_or("") {
            "store" => {
                let h = holder(&v["holder"]).map_err(at)?;
                let t = tier_index(v["tier"].as_str().unwrap_or("")).map_err(at)?;
                Op::Store {
                    worker: h * 4 + t,
                    parent: v["parent"].as_u64(),
                    hashes: hashes_of(&v).map_err(at)?,
                }
            }
            "remove" => {
                let h = holder(&v["holder"]).map_err(at)?;
                let t = tier_index(v["tier"].as_str().unwrap_or("")).map_err(at)?;
                Op::Remove {
                    worker: h * 4 + t,
                    hashes: hashes_of(&v).map_err(at)?,
                }
            }
            "clear" => Op::Clear {
                holder: holder(&v["holder"]).map_err(at)?,
            },
            "attach" => {
                holder(&v["holder"]).map_err(at)?;
                holder(&v["store"]).map_err(at)?;
                Op::Skip
            }
            "query" => Op::Query {
                hashes: hashes_of(&v).map_err(at)?,
            },
            other => return Err(at(format!("unknown op {other:?}"))),
        };
        ops.push(op);
    }
    Ok(ops)
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse::<u64>().ok())
        .unwrap_or(0)
        * 4096
}

fn event(id: &mut u64, worker: u64, data: KvCacheEventData) -> RouterEvent {
    *id += 1;
    RouterEvent::new(
        worker,
        KvCacheEvent {
            event_id: *id,
            data,
            dp_rank: 0,
        },
    )
}

fn stored(parent: Option<u64>, hashes: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(ExternalSequenceBlockHash),
        start_position: None,
        blocks: hashes
            .iter()
            .map(|&h| KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(h),
                tokens_hash: LocalBlockHash(h),
                mm_extra_info: None,
            })
            .collect(),
    })
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn run(path: &str) -> Result<String, String> {
    let ops = parse(path)?;
    let rss0 = rss_bytes();
    let mut tree = RadixTree::new();
    let mut id = 0u64;
    let (mut block_ops, mut ingest_s, mut query_us) = (0u64, 0f64, Vec::new());
    let (mut since, mut ingesting) = (Instant::now(), true);
    for op in &ops {
        let is_query = matches!(op, Op::Query { .. });
        if is_query && ingesting {
            ingest_s += since.elapsed().as_secs_f64();
            ingesting = false;
        } else if !is_query && !ingesting {
            since = Instant::now();
            ingesting = true;
        }
        match op {
            Op::Store {
                worker,
                parent,
                hashes,
            } => {
                let e = event(&mut id, *worker, stored(*parent, hashes));
                if let Err(KvCacheEventError::ParentBlockNotFound) = tree.apply_event(e) {
                    let e = event(&mut id, *worker, stored(None, hashes));
                    let _ = tree.apply_event(e);
                }
                block_ops += hashes.len() as u64;
            }
            Op::Remove { worker, hashes } => {
                let data = KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: hashes
                        .iter()
                        .map(|&h| ExternalSequenceBlockHash(h))
                        .collect(),
                });
                let _ = tree.apply_event(event(&mut id, *worker, data));
                block_ops += hashes.len() as u64;
            }
            Op::Clear { holder } => {
                for t in 0..3 {
                    let e = event(&mut id, holder * 4 + t, KvCacheEventData::Cleared);
                    let _ = tree.apply_event(e);
                }
            }
            Op::Query { hashes } => {
                let seq: Vec<LocalBlockHash> = hashes.iter().map(|&h| LocalBlockHash(h)).collect();
                let t = Instant::now();
                let scores = tree.find_matches(seq, false);
                query_us.push(t.elapsed().as_secs_f64() * 1e6);
                std::hint::black_box(scores);
            }
            Op::Skip => {}
        }
    }
    if ingesting {
        ingest_s += since.elapsed().as_secs_f64();
    }
    query_us.sort_by(f64::total_cmp);
    let holder_blocks = tree.current_size() as u64;
    let growth = rss_bytes().saturating_sub(rss0);
    let summary = serde_json::json!({
        "case": "summary",
        "reference": "dynamo-kv-router 1.6.1 RadixTree",
        "block_ops": block_ops,
        "ingest_block_ops_per_s": block_ops as f64 / ingest_s.max(1e-9),
        "queries": query_us.len(),
        "query_p50_us": quantile(&query_us, 0.5),
        "query_p99_us": quantile(&query_us, 0.99),
        "holder_blocks": holder_blocks,
        "rss_growth_bytes": growth,
        "rss_growth_per_holder_block": growth as f64 / holder_blocks.max(1) as f64,
    });
    Ok(summary.to_string())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let [_, path] = args.as_slice() else {
        eprintln!("usage: hicache-bench-dynamo-index EVENTS.jsonl");
        return ExitCode::from(2);
    };
    match run(path) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("hicache-bench-dynamo-index: {e}");
            ExitCode::FAILURE
        }
    }
}
