//! The Mooncake FAST'25 trace format: JSON Lines `{"timestamp": ms, "input_length": n,
//! "output_length": m, "hash_ids": [u64, …]}`, one hash id per 512-token block of the prompt,
//! equal ids meaning equal blocks (the last block may be partial).
//!
//! Tokens are synthesised so that equal hash ids give equal tokens: token `j` of block `h` is
//! a fixed function of `(h, j)` (SplitMix64), so two prompts share exactly the leading blocks
//! whose ids they share, and a partial block is a prefix of the whole one.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

use crate::trace::Conversation;

use crate::error::{Result, SimError};

/// Tokens per hash id of the Mooncake traces.
pub const BLOCK_TOKENS: usize = 512;

/// One request of a Mooncake trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct MooncakeRequest {
    /// Arrival (ms from the trace's start).
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Answer tokens.
    pub output_length: usize,
    /// One id per 512-token block of the prompt.
    pub hash_ids: Vec<u64>,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl MooncakeRequest {
    /// The prompt's tokens in `[0, vocab)`: block `i` from hash id `hash_ids[i]`; positions
    /// past the listed blocks continue the last block's sequence.
    pub fn tokens(&self, vocab: u32) -> Vec<u32> {
        let vocab = vocab.max(1) as u64;
        (0..self.input_length)
            .map(|p| {
                let b = p / BLOCK_TOKENS;
                let (id, j) = match self.hash_ids.get(b) {
                    Some(&id) => (id, (p % BLOCK_TOKENS) as u64),
                    None => (
                        self.hash_ids.last().copied().unwrap_or(u64::MAX),
                        (p - BLOCK_TOKENS * self.hash_ids.len().saturating_sub(1)) as u64,
                    ),
                };
                (splitmix(splitmix(id) ^ j) % vocab) as u32
            })
            .collect()
    }
}

/// Whether the first non-empty line of `path` (plain or gzip) is a Mooncake trace line.
pub fn is_mooncake(path: &Path) -> Result<bool> {
    let mut lines = open(path)?;
    let mut line = String::new();
    while lines.read_line(&mut line).map_err(SimError::io(path))? > 0 {
        if !line.trim().is_empty() {
            return Ok(line.contains("\"hash_ids\""));
        }
        line.clear();
    }
    Ok(false)
}

fn open(path: &Path) -> Result<Box<dyn BufRead>> {
    let f = std::fs::File::open(path).map_err(SimError::io(path))?;
    let mut input = BufReader::new(f);
    let gz = input
        .fill_buf()
        .map_err(SimError::io(path))?
        .starts_with(&[0x1f, 0x8b]);
    Ok(if gz {
        Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(input)))
    } else {
        Box::new(input)
    })
}

/// Reads the first `limit` requests (all with `None`) of a Mooncake trace.
pub fn read(path: &Path, limit: Option<usize>) -> Result<Vec<MooncakeRequest>> {
    read_from(&path.display().to_string(), open(path)?, limit)
}

/// Reads Mooncake lines from `input`; `name` names it in errors (with the line number).
pub fn read_from(
    name: &str,
    input: impl Read,
    limit: Option<usize>,
) -> Result<Vec<MooncakeRequest>> {
    let mut out = Vec::new();
    for (i, line) in BufReader::new(input).lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        let line = line.map_err(SimError::io(name))?;
        if line.trim().is_empty() {
            continue;
        }
        let r: MooncakeRequest = serde_json::from_str(&line).map_err(|e| {
            SimError::Usage(format!(
                "{name}:{}: not a Mooncake trace line ({e}); expected {{\"timestamp\", \
                 \"input_length\", \"output_length\", \"hash_ids\"}}",
                i + 1
            ))
        })?;
        if r.input_length == 0 {
            return Err(SimError::Usage(format!(
                "{name}:{}: input_length is 0",
                i + 1
            )));
        }
        out.push(r);
    }
    Ok(out)
}

/// The requests as one-turn conversations (prompt from the hash ids, answer of
/// `output_length` tokens drawn with `seed`) and their arrival times in seconds, the trace's
/// timestamps multiplied by `time_scale` and shifted to start at 0.
pub fn workload(
    requests: &[MooncakeRequest],
    vocab: u32,
    seed: u64,
    time_scale: f64,
) -> (Vec<Conversation>, Vec<f64>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let t0 = requests.iter().map(|r| r.timestamp).min().unwrap_or(0);
    let convs = requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            Conversation::single(
                format!("m{i}"),
                r.tokens(vocab),
                r.output_length.max(1),
                vocab,
                &mut rng,
            )
        })
        .collect();
    let times = requests
        .iter()
        .map(|r| (r.timestamp - t0) as f64 / 1e3 * time_scale)
        .collect();
    (convs, times)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_hash_ids_give_equal_blocks_and_partial_blocks_are_prefixes() {
        let text = "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [7, 8, 9]}\n\
                    {\"timestamp\": 30, \"input_length\": 700, \"output_length\": 1, \"hash_ids\": [7, 4]}\n";
        let r = read_from("t", text.as_bytes(), None).unwrap();
        assert_eq!(r.len(), 2);
        let (a, b) = (r[0].tokens(1000), r[1].tokens(1000));
        assert_eq!((a.len(), b.len()), (1100, 700));
        assert_eq!(a[..512], b[..512]);
        assert_ne!(a[512..700], b[512..700]);
        let c = MooncakeRequest {
            timestamp: 0,
            input_length: 600,
            output_length: 1,
            hash_ids: vec![7, 8],
        };
        assert_eq!(c.tokens(1000)[..], a[..600]);
        assert!(
            read_from("t", "{\"timestamp\": 1}".as_bytes(), None)
                .unwrap_err()
                .to_string()
                .contains("t:1")
        );
    }
}
