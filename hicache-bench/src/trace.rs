//! Request traces: JSON Lines, optionally gzip-compressed, one request per line:
//! `{"id": "c3-r5", "tokens": [u32, ...]}`. Also the generator of the default multi-turn trace.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{BenchError, Result};

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Request {
    /// Request id (free text).
    pub id: String,
    /// Token ids.
    pub tokens: Vec<u32>,
}

/// Shape of the generated multi-turn trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MultiTurn {
    /// Concurrent conversations.
    pub clients: usize,
    /// Turns per conversation.
    pub rounds: usize,
    /// Tokens of the system prompt shared by every conversation.
    pub system_tokens: usize,
    /// Tokens of each user turn.
    pub user_tokens: usize,
    /// Tokens of each answer, appended to the history after the request.
    pub answer_tokens: usize,
    /// Token ids are uniform in `[0, vocab)`.
    pub vocab: u32,
    /// Seed of the token generator.
    pub seed: u64,
}

impl Default for MultiTurn {
    /// The issue's default: 32 clients × 8 rounds, 1024-token system prompt, 512-token user
    /// turns, 256-token answers, vocabulary 128000, seed 1.
    fn default() -> Self {
        Self {
            clients: 32,
            rounds: 8,
            system_tokens: 1024,
            user_tokens: 512,
            answer_tokens: 256,
            vocab: 128_000,
            seed: 1,
        }
    }
}

impl MultiTurn {
    /// Generates the trace. Order (normative, so that the trace is reproducible): the system
    /// prompt; then for each round, for each client in order: the user turn, the request
    /// (history + user turn, id `c{client}-r{round}`), then the answer, appended with the
    /// user turn to that client's history.
    pub fn generate(&self) -> Vec<Request> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let vocab = self.vocab.max(1);
        let mut draw =
            |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
        let system = draw(self.system_tokens);
        let mut history: Vec<Vec<u32>> = vec![system; self.clients];
        let mut out = Vec::with_capacity(self.clients * self.rounds);
        for round in 0..self.rounds {
            for (client, h) in history.iter_mut().enumerate() {
                let user = draw(self.user_tokens);
                h.extend_from_slice(&user);
                out.push(Request {
                    id: format!("c{client}-r{round}"),
                    tokens: h.clone(),
                });
                let answer = draw(self.answer_tokens);
                h.extend_from_slice(&answer);
            }
        }
        out
    }
}

#[derive(Deserialize)]
struct Line {
    id: serde_json::Value,
    tokens: Vec<serde_json::Value>,
}

/// Reads a trace from `input` (plain or gzip, detected by its magic bytes). `name` is used in
/// error messages, which give the line and the position of the first bad value.
pub fn read(name: &str, input: impl Read) -> Result<Vec<Request>> {
    let mut input = BufReader::new(input);
    let gz = input
        .fill_buf()
        .map_err(BenchError::io(name))?
        .starts_with(&[0x1f, 0x8b]);
    let reader: Box<dyn BufRead> = if gz {
        Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(input)))
    } else {
        Box::new(input)
    };
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let lineno = i + 1;
        let line = line.map_err(BenchError::io(name))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed: Line = serde_json::from_str(&line).map_err(|e| {
            BenchError::Usage(format!(
                "{name}:{lineno}: not a trace line ({e}); expected {{\"id\": ..., \"tokens\": [u32, ...]}}"
            ))
        })?;
        let id = match parsed.id {
            serde_json::Value::String(s) => s,
            v @ serde_json::Value::Number(_) => v.to_string(),
            v => {
                return Err(BenchError::Usage(format!(
                    "{name}:{lineno}: id must be a string or a number, got {v}"
                )));
            }
        };
        let tokens = parsed
            .tokens
            .iter()
            .enumerate()
            .map(|(pos, v)| {
                v.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        BenchError::Usage(format!(
                            "{name}:{lineno}: token {pos} ({v}) is not an id in 0..2^32"
                        ))
                    })
            })
            .collect::<Result<Vec<u32>>>()?;
        out.push(Request { id, tokens });
    }
    Ok(out)
}

/// Reads a trace file.
pub fn read_file(path: &Path) -> Result<Vec<Request>> {
    let f = std::fs::File::open(path).map_err(BenchError::io(path))?;
    read(&path.display().to_string(), f)
}

/// Writes a trace as plain JSON Lines.
pub fn write(out: &mut impl Write, trace: &[Request]) -> std::io::Result<()> {
    for r in trace {
        serde_json::to_writer(&mut *out, r)?;
        out.write_all(b"\n")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_trace_has_the_issue_shape() {
        let t = MultiTurn::default().generate();
        assert_eq!(t.len(), 256);
        assert_eq!(t[0].id, "c0-r0");
        assert_eq!(t[32].id, "c0-r1");
        assert_eq!(t[0].tokens.len(), 1024 + 512);
        assert_eq!(t[32].tokens.len(), 1024 + 512 + 256 + 512);
        // Shared system prompt, growing history.
        assert_eq!(t[0].tokens[..1024], t[1].tokens[..1024]);
        assert_ne!(t[0].tokens[1024..], t[1].tokens[1024..]);
        assert_eq!(t[0].tokens[..], t[32].tokens[..1536]);
        assert!(t.iter().all(|r| r.tokens.iter().all(|&x| x < 128_000)));
        assert_eq!(MultiTurn::default().generate(), t, "seeded");
        let other = MultiTurn {
            seed: 2,
            ..MultiTurn::default()
        };
        assert_ne!(other.generate()[0].tokens, t[0].tokens);
    }

    #[test]
    fn round_trips_plain_and_gzip() {
        let t = MultiTurn {
            clients: 2,
            rounds: 2,
            system_tokens: 3,
            user_tokens: 2,
            answer_tokens: 1,
            ..MultiTurn::default()
        }
        .generate();
        let mut plain = Vec::new();
        write(&mut plain, &t).unwrap();
        assert_eq!(read("x", &plain[..]).unwrap(), t);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&plain).unwrap();
        let gz = gz.finish().unwrap();
        assert_eq!(read("x.gz", &gz[..]).unwrap(), t);
    }

    #[test]
    fn bad_lines_name_the_line_and_token() {
        let e = read(
            "t",
            &b"{\"id\": \"a\", \"tokens\": [1, 2]}\n{\"id\": 3, \"tokens\": [1, 4294967296]}\n"[..],
        )
        .unwrap_err();
        assert!(e.to_string().contains("t:2: token 1"), "{e}");
        assert_eq!(e.exit_code(), 2);
        let e = read("t", &b"{\"id\": \"a\", \"tokens\": [-1]}"[..]).unwrap_err();
        assert!(e.to_string().contains("t:1: token 0"), "{e}");
        let e = read("t", &b"not json"[..]).unwrap_err();
        assert!(e.to_string().starts_with("t:1:"), "{e}");
        let e = read("t", &b"{\"tokens\": [1]}"[..]).unwrap_err();
        assert!(e.to_string().contains("t:1"), "{e}");
        assert_eq!(
            read("t", &b"\n{\"id\": 7, \"tokens\": []}\n"[..]).unwrap()[0].id,
            "7"
        );
    }
}
