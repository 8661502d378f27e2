//! The reference of the `redis` backend's storage bench: `redis-benchmark` (shipped with
//! Redis) doing plain `SET` / `GET` of values of the same size against the same cluster, with
//! as many connections as the backend has pages in flight per batch. Its figure is what the
//! server and loopback sustain for raw values of that size, without page headers, checksums or
//! routing of ours.

use std::process::Command;

use crate::error::{BenchError, Result};

/// Where and how to run `redis-benchmark`.
#[derive(Debug, Clone)]
pub struct RedisBench {
    /// One node of the cluster (or the standalone server), `host:port`.
    pub node: String,
    /// Whether the target is a cluster (`--cluster`).
    pub cluster: bool,
    /// Parallel connections.
    pub clients: usize,
}

/// Which command the reference measures.
#[derive(Debug, Clone, Copy)]
pub enum Op {
    /// `SET key value`.
    Set,
    /// `GET key` (after the `SET`s of the same run, so values exist).
    Get,
}

impl RedisBench {
    /// Seconds `redis-benchmark` takes for `pages` requests of `op` on values of `page_bytes`
    /// (derived from the requests per second it reports).
    pub fn secs(&self, op: Op, page_bytes: usize, pages: usize) -> Result<f64> {
        let (host, port) = self.node.rsplit_once(':').ok_or_else(|| {
            BenchError::usage(format!("redis node {:?} is not host:port", self.node))
        })?;
        let test = match op {
            Op::Set => "set",
            Op::Get => "get",
        };
        let mut cmd = Command::new("redis-benchmark");
        cmd.args(["-h", host, "-p", port, "-t", test, "--csv", "-P", "1"])
            .args(["-d", &page_bytes.to_string()])
            .args(["-n", &pages.max(1).to_string()])
            .args(["-c", &self.clients.clamp(1, pages.max(1)).to_string()])
            // Random keys over as many names as pages, so values spread over every shard.
            .args(["-r", &pages.max(1).to_string()]);
        if self.cluster {
            cmd.arg("--cluster");
        }
        let out = cmd.output().map_err(|e| {
            BenchError::usage(format!(
                "cannot run redis-benchmark: {e} (apt-get install redis-tools)"
            ))
        })?;
        let text = String::from_utf8_lossy(&out.stdout);
        let rps = text
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with(&format!("\"{test}\"")))
            .and_then(|l| l.split(',').nth(1))
            .and_then(|v| v.trim_matches('"').parse::<f64>().ok())
            .filter(|r| *r > 0.0)
            .ok_or_else(|| {
                BenchError::usage(format!(
                    "redis-benchmark gave no {test} figure: {text}{}",
                    String::from_utf8_lossy(&out.stderr)
                ))
            })?;
        Ok(pages as f64 / rps)
    }

    /// What the servers say about their memory (`INFO` of every node through `redis-cli
    /// --cluster call`, or of the one server): keys evicted, memory used and `maxmemory`
    /// summed over the nodes, and the eviction policy. `None` where `redis-cli` is missing or
    /// answers nothing usable.
    pub fn memory_report(&self) -> Option<String> {
        let (host, port) = self.node.rsplit_once(':')?;
        let mut cmd = Command::new("redis-cli");
        if self.cluster {
            cmd.args(["--cluster", "call", &self.node, "INFO"]);
        } else {
            cmd.args(["-h", host, "-p", port, "INFO"]);
        }
        let text = String::from_utf8(cmd.output().ok()?.stdout).ok()?;
        let sum = |field: &str| -> Option<u64> {
            let values: Vec<u64> = text
                .match_indices(&format!("{field}:"))
                .filter_map(|(i, m)| {
                    let digits: String = text[i + m.len()..]
                        .chars()
                        .take_while(char::is_ascii_digit)
                        .collect();
                    digits.parse().ok()
                })
                .collect();
            (!values.is_empty()).then(|| values.iter().sum())
        };
        let policy = text
            .split("maxmemory_policy:")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or("unknown");
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        Some(format!(
            "evicted_keys {}, used_memory {:.0} MiB of maxmemory {:.0} MiB, maxmemory_policy {policy}",
            sum("evicted_keys")?,
            mib(sum("used_memory")?),
            mib(sum("maxmemory")?),
        ))
    }
}
