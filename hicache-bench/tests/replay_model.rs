//! The `tree` replay against an independent, deliberately naive radix cache written from the
//! replay rule (SGLang's `RadixCache`: page-aligned keys, children by first page, split on a
//! partial match, one logical clock stamping every node walked or created, LRU eviction of
//! whole unlocked leaves). Per-request outcomes must be identical.

use hicache_bench::cmd::tree::{RequestOutcome, replay};
use hicache_core::StrategyKind;
use hicache_sim::trace::{MultiTurn, Request};
use proptest::prelude::*;

struct Node {
    key: Vec<u32>,
    children: Vec<usize>,
    parent: usize,
    stamp: u64,
    lock: u32,
    alive: bool,
}

struct Naive {
    nodes: Vec<Node>,
    ps: usize,
    clock: u64,
}

impl Naive {
    fn new(ps: usize) -> Self {
        let root = Node {
            key: vec![],
            children: vec![],
            parent: usize::MAX,
            stamp: 0,
            lock: 1,
            alive: true,
        };
        Self {
            nodes: vec![root],
            ps,
            clock: 0,
        }
    }

    fn pages(&self) -> usize {
        self.nodes
            .iter()
            .skip(1)
            .filter(|n| n.alive)
            .map(|n| n.key.len() / self.ps)
            .sum()
    }

    fn split(&mut self, c: usize, k: usize) -> usize {
        let ps = self.ps;
        let parent = self.nodes[c].parent;
        let upper = self.nodes[c].key[..k * ps].to_vec();
        self.nodes[c].key.drain(..k * ps);
        let n = self.nodes.len();
        self.nodes.push(Node {
            key: upper,
            children: vec![c],
            parent,
            stamp: self.clock,
            lock: self.nodes[c].lock,
            alive: true,
        });
        self.nodes[c].parent = n;
        for ch in &mut self.nodes[parent].children {
            if *ch == c {
                *ch = n;
            }
        }
        n
    }

    /// Walks `key`, stamping and splitting; returns (pages matched, last node, rest offset).
    fn walk(&mut self, key: &[u32]) -> (usize, usize) {
        let ps = self.ps;
        let mut node = 0;
        let mut off = 0;
        while off < key.len() {
            let rest = &key[off..];
            let Some(&c) = self.nodes[node]
                .children
                .iter()
                .find(|&&c| self.nodes[c].key[..ps] == rest[..ps])
            else {
                break;
            };
            self.nodes[c].stamp = self.clock;
            let ck = &self.nodes[c].key;
            let mut common = 0;
            while common * ps < ck.len()
                && common * ps < rest.len()
                && ck[common * ps..(common + 1) * ps] == rest[common * ps..(common + 1) * ps]
            {
                common += 1;
            }
            if common * ps < ck.len() {
                node = self.split(c, common);
                off += common * ps;
                break;
            }
            node = c;
            off += common * ps;
        }
        (off / ps, node)
    }

    fn match_prefix(&mut self, key: &[u32]) -> (usize, usize) {
        self.clock += 1;
        self.walk(key)
    }

    fn insert(&mut self, key: &[u32]) -> usize {
        self.clock += 1;
        let (m, node) = self.walk(key);
        if m * self.ps < key.len() {
            let n = self.nodes.len();
            self.nodes.push(Node {
                key: key[m * self.ps..].to_vec(),
                children: vec![],
                parent: node,
                stamp: self.clock,
                lock: 0,
                alive: true,
            });
            self.nodes[node].children.push(n);
        }
        m
    }

    fn lock(&mut self, mut n: usize, delta: i32) {
        while n != 0 {
            self.nodes[n].lock = self.nodes[n].lock.checked_add_signed(delta).unwrap();
            n = self.nodes[n].parent;
        }
    }

    fn evict(&mut self, pages: usize) -> usize {
        let mut freed = 0;
        while freed < pages {
            let victim = (1..self.nodes.len())
                .filter(|&i| {
                    let n = &self.nodes[i];
                    n.alive && n.lock == 0 && n.children.is_empty()
                })
                .min_by_key(|&i| self.nodes[i].stamp);
            let Some(v) = victim else { break };
            self.nodes[v].alive = false;
            freed += self.nodes[v].key.len() / self.ps;
            let p = self.nodes[v].parent;
            self.nodes[p].children.retain(|&c| c != v);
        }
        freed
    }

    fn replay(trace: &[Request], ps: usize, cap: Option<usize>) -> Vec<RequestOutcome> {
        let mut t = Naive::new(ps);
        let mut out = Vec::new();
        for r in trace {
            let n = r.tokens.len() / ps;
            let mut o = RequestOutcome {
                key_tokens: n * ps,
                ..Default::default()
            };
            if n > 0 {
                let key = &r.tokens[..n * ps];
                let (m, node) = t.match_prefix(key);
                t.lock(node, 1);
                o.hit_tokens = m * ps;
                let need = n - m;
                if let Some(c) = cap {
                    let free = c - t.pages();
                    if need > 0 && free < need {
                        o.evicted_tokens = t.evict(need - free) * ps;
                    }
                }
                if cap.is_some_and(|c| c - t.pages() < need) {
                    o.skipped = true;
                } else {
                    assert_eq!(t.insert(key), m);
                }
                t.lock(node, -1);
            }
            out.push(o);
        }
        out
    }
}

fn ours(trace: &[Request], ps: u32, cap: Option<usize>) -> Vec<RequestOutcome> {
    let mut log = Vec::new();
    let (_, tree) = replay::<false>(trace, ps, cap, StrategyKind::Lru, Some(&mut log)).unwrap();
    tree.check_invariants().unwrap();
    log
}

#[test]
fn default_trace_matches_the_naive_radix_cache() {
    let trace = MultiTurn {
        clients: 8,
        rounds: 4,
        ..MultiTurn::default()
    }
    .generate();
    let unique = ours(&trace, 64, None)
        .iter()
        .map(|o| o.key_tokens - o.hit_tokens)
        .sum::<usize>()
        / 64;
    for cap in [None, Some(unique / 4), Some(unique / 2), Some(40)] {
        assert_eq!(
            ours(&trace, 64, cap),
            Naive::replay(&trace, 64, cap),
            "{cap:?}"
        );
    }
}

fn small_trace() -> impl Strategy<Value = Vec<Request>> {
    // Requests built from a few shared "words" of 2-6 tokens so prefixes overlap often and
    // splits fall inside and at the edge of pages.
    let word = prop::collection::vec(0u32..3, 2..7);
    prop::collection::vec(prop::collection::vec(word, 0..6), 1..40).prop_map(|reqs| {
        reqs.into_iter()
            .enumerate()
            .map(|(i, words)| Request {
                id: format!("r{i}"),
                tokens: words.concat(),
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_traces_match_the_naive_radix_cache(
        trace in small_trace(),
        ps in 1u32..4,
        cap in prop::option::of(1usize..12),
    ) {
        prop_assert_eq!(ours(&trace, ps, cap), Naive::replay(&trace, ps as usize, cap));
    }
}
