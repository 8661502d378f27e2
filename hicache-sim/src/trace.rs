//! Request traces: JSON Lines, optionally gzip-compressed, one request per line:
//! `{"id": "c3-r5", "tokens": [u32, ...]}`. Also the generator of the default multi-turn trace.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{Result, SimError};

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
    /// Generates the trace: every turn's request, round by round (see
    /// [`conversations`](Self::conversations) for the token order).
    pub fn generate(&self) -> Vec<Request> {
        let conversations = self.conversations();
        let mut out = Vec::with_capacity(self.clients * self.rounds);
        for round in 0..self.rounds {
            for (client, c) in conversations.iter().enumerate() {
                out.push(Request {
                    id: format!("c{client}-r{round}"),
                    tokens: c.prompt(round).to_vec(),
                });
            }
        }
        out
    }

    /// Generates one [`Conversation`] per client. Token order (normative, so that traces are
    /// reproducible): the system prompt; then for each round, for each client in order: the
    /// user turn, then the answer. Request `c{client}-r{round}` is the client's history plus
    /// its user turn; the answer is appended to the history after it.
    pub fn conversations(&self) -> Vec<Conversation> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let vocab = self.vocab.max(1);
        let mut draw = |n: usize, into: &mut Vec<u32>| {
            into.extend((0..n).map(|_| rng.random_range(0..vocab)));
        };
        let mut system = Vec::new();
        draw(self.system_tokens, &mut system);
        let per_client = self.system_tokens + self.rounds * (self.user_tokens + self.answer_tokens);
        let mut out: Vec<Conversation> = (0..self.clients)
            .map(|client| {
                let mut tokens = Vec::with_capacity(per_client);
                tokens.extend_from_slice(&system);
                Conversation {
                    id: format!("c{client}"),
                    tokens,
                    turns: Vec::with_capacity(self.rounds),
                }
            })
            .collect();
        for _ in 0..self.rounds {
            for c in &mut out {
                draw(self.user_tokens, &mut c.tokens);
                let prompt_end = c.tokens.len();
                draw(self.answer_tokens, &mut c.tokens);
                c.turns.push(Turn {
                    prompt_end,
                    answer_end: c.tokens.len(),
                });
            }
        }
        out
    }
}

/// One turn of a [`Conversation`]: its prompt is `tokens[..prompt_end]`, its answer
/// `tokens[prompt_end..answer_end]`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Turn {
    /// End of the prompt (exclusive) in the conversation's tokens.
    pub prompt_end: usize,
    /// End of the answer (exclusive); the next turn's prompt extends past it.
    pub answer_end: usize,
}

/// A client's whole conversation: one token sequence and where each turn's prompt and answer
/// end in it. Invariant: `prompt_end ≤ answer_end ≤ next prompt_end ≤ tokens.len()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conversation {
    /// Client or request id (free text).
    pub id: String,
    /// Every token of the conversation.
    pub tokens: Vec<u32>,
    /// The turns, in order.
    pub turns: Vec<Turn>,
}

impl Conversation {
    /// A one-turn conversation: `prompt` followed by `answer_tokens` tokens drawn from `rng`.
    pub fn single(
        id: String,
        prompt: Vec<u32>,
        answer_tokens: usize,
        vocab: u32,
        rng: &mut impl Rng,
    ) -> Self {
        let mut tokens = prompt;
        let prompt_end = tokens.len();
        tokens.extend((0..answer_tokens).map(|_| rng.random_range(0..vocab.max(1))));
        Self {
            id,
            turns: vec![Turn {
                prompt_end,
                answer_end: tokens.len(),
            }],
            tokens,
        }
    }

    /// The prompt of turn `round`.
    pub fn prompt(&self, round: usize) -> &[u32] {
        &self.tokens[..self.turns[round].prompt_end]
    }

    /// The prompt and answer of turn `round` (what is cached once the turn finishes).
    pub fn with_answer(&self, round: usize) -> &[u32] {
        &self.tokens[..self.turns[round].answer_end]
    }

    /// Answer tokens of turn `round`.
    pub fn answer_len(&self, round: usize) -> usize {
        let t = self.turns[round];
        t.answer_end - t.prompt_end
    }
}

/// Shape of the generated long-context workload (like SGLang's `bench_long_context.py`): a few
/// very long shared documents and many independent questions about each; every request is one
/// document followed by one question.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LongContext {
    /// Shared documents.
    pub documents: usize,
    /// Tokens per document.
    pub document_tokens: usize,
    /// Questions per document.
    pub questions: usize,
    /// Tokens per question.
    pub question_tokens: usize,
    /// Tokens per answer.
    pub answer_tokens: usize,
    /// Token ids are uniform in `[0, vocab)`.
    pub vocab: u32,
    /// Seed of the token generator.
    pub seed: u64,
}

impl LongContext {
    /// Generates one one-turn conversation per question, `d{document}-q{question}`, ordered
    /// question-major (`d0-q0, d1-q0, …, d0-q1, …`) so that consecutive requests alternate
    /// between documents. Token order (normative): every document in order, then for each
    /// conversation in that order its question, then its answer.
    pub fn conversations(&self) -> Vec<Conversation> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let vocab = self.vocab.max(1);
        let docs: Vec<Vec<u32>> = (0..self.documents)
            .map(|_| {
                (0..self.document_tokens)
                    .map(|_| rng.random_range(0..vocab))
                    .collect()
            })
            .collect();
        let mut out = Vec::with_capacity(self.documents * self.questions);
        for q in 0..self.questions {
            for (d, doc) in docs.iter().enumerate() {
                let mut prompt = Vec::with_capacity(
                    self.document_tokens + self.question_tokens + self.answer_tokens,
                );
                prompt.extend_from_slice(doc);
                prompt.extend((0..self.question_tokens).map(|_| rng.random_range(0..vocab)));
                out.push(Conversation::single(
                    format!("d{d}-q{q}"),
                    prompt,
                    self.answer_tokens,
                    vocab,
                    &mut rng,
                ));
            }
        }
        out
    }
}

/// Turns a trace into one one-turn conversation per request, in trace order, each answered by
/// `answer_tokens` tokens drawn from a generator seeded with `seed` (the trace holds prompts
/// only; an engine caches what it generates).
pub fn conversations_of(
    trace: Vec<Request>,
    answer_tokens: usize,
    vocab: u32,
    seed: u64,
) -> Vec<Conversation> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    trace
        .into_iter()
        .map(|r| Conversation::single(r.id, r.tokens, answer_tokens, vocab, &mut rng))
        .collect()
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
        .map_err(SimError::io(name))?
        .starts_with(&[0x1f, 0x8b]);
    let reader: Box<dyn BufRead> = if gz {
        Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(input)))
    } else {
        Box::new(input)
    };
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let lineno = i + 1;
        let line = line.map_err(SimError::io(name))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed: Line = serde_json::from_str(&line).map_err(|e| {
            SimError::Usage(format!(
                "{name}:{lineno}: not a trace line ({e}); expected {{\"id\": ..., \"tokens\": [u32, ...]}}"
            ))
        })?;
        let id = match parsed.id {
            serde_json::Value::String(s) => s,
            v @ serde_json::Value::Number(_) => v.to_string(),
            v => {
                return Err(SimError::Usage(format!(
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
                        SimError::Usage(format!(
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
    let f = std::fs::File::open(path).map_err(SimError::io(path))?;
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
    fn conversations_hold_every_turn() {
        let m = MultiTurn {
            clients: 3,
            rounds: 4,
            system_tokens: 10,
            user_tokens: 5,
            answer_tokens: 2,
            ..MultiTurn::default()
        };
        let cs = m.conversations();
        let trace = m.generate();
        assert_eq!(cs.len(), 3);
        for (client, c) in cs.iter().enumerate() {
            assert_eq!(c.id, format!("c{client}"));
            assert_eq!(c.tokens.len(), 10 + 4 * 7);
            for round in 0..4 {
                assert_eq!(c.prompt(round), &trace[round * 3 + client].tokens[..]);
                assert_eq!(c.answer_len(round), 2);
                assert_eq!(c.with_answer(round).len(), 10 + 7 * (round + 1));
            }
        }
        assert_eq!(
            cs[0].tokens[..10],
            cs[2].tokens[..10],
            "shared system prompt"
        );
        assert_eq!(m.conversations(), cs, "seeded");
    }

    #[test]
    fn long_context_shares_documents() {
        let l = LongContext {
            documents: 2,
            document_tokens: 100,
            questions: 3,
            question_tokens: 7,
            answer_tokens: 4,
            vocab: 1000,
            seed: 5,
        };
        let cs = l.conversations();
        assert_eq!(cs.len(), 6);
        assert_eq!(cs[0].id, "d0-q0");
        assert_eq!(cs[1].id, "d1-q0");
        assert_eq!(cs[2].id, "d0-q1");
        for c in &cs {
            assert_eq!(c.turns.len(), 1);
            assert_eq!(c.prompt(0).len(), 107);
            assert_eq!(c.answer_len(0), 4);
        }
        assert_eq!(cs[0].tokens[..100], cs[2].tokens[..100]);
        assert_ne!(cs[0].tokens[..100], cs[1].tokens[..100]);
        assert_ne!(cs[0].tokens[100..107], cs[2].tokens[100..107]);
        assert_eq!(l.conversations(), cs);
    }

    #[test]
    fn trace_requests_become_one_turn_conversations() {
        let trace = vec![
            Request {
                id: "a".into(),
                tokens: vec![1, 2, 3],
            },
            Request {
                id: "b".into(),
                tokens: vec![],
            },
        ];
        let cs = conversations_of(trace.clone(), 5, 10, 1);
        assert_eq!(cs.len(), 2);
        assert_eq!(cs[0].prompt(0), &[1, 2, 3]);
        assert_eq!(cs[0].answer_len(0), 5);
        // The answer follows the prompt and its tokens come from the vocabulary 0..10.
        assert_eq!(cs[0].tokens.len(), 3 + 5);
        assert!(cs[0].with_answer(0)[3..].iter().all(|&t| t < 10));
        assert_eq!(cs[1].id, "b");
        assert_eq!(conversations_of(trace, 5, 10, 1), cs);
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
