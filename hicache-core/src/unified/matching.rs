//! `match_prefix`: the walk, the composed validators, the post-processing (LRU refresh,
//! path stamps, branching lengths).

use super::host::list_pages;
use super::node::ROOT;
use super::{Component, UnifiedTree};
use super::{MAMBA, MAMBA_LRU, SWA, SWA_LRU};
use crate::error::Result;
use crate::tree::NodeId;

/// What a match found (SGLang's `MatchResult`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnifiedMatch {
    /// Tokens the request may reuse from device: the path up to [`node`](Self::node).
    pub device_prefix_len: usize,
    /// The deepest node where every component's device validator passed (lock this one).
    pub node: NodeId,
    /// Tokens of Full KV the walk matched on device or host, valid or not
    /// (`full_kv_hit_length`).
    pub full_hit_len: usize,
    /// SWA branching length: the page-aligned Full hit when it goes past the valid prefix
    /// (device prefix plus host hit).
    pub swa_branching: Option<usize>,
    /// Mamba branching length: the Full hit aligned to `lcm(chunk, page)` when it goes past
    /// the valid prefix (device prefix plus host hit).
    pub mamba_branching: Option<usize>,
    /// The Mamba state slot at [`node`](Self::node), the copy-on-write source.
    pub mamba_slot: Option<u32>,
    /// The deepest node where every component is on device or on host (SGLang's
    /// `best_match_node`, the load-back target); [`node`](Self::node) when nothing on host
    /// goes further.
    pub host_node: NodeId,
    /// Full tokens on host from [`node`](Self::node) (exclusive) down to
    /// [`host_node`](Self::host_node): what a load-back brings to device.
    pub host_hit_len: usize,
    /// SWA tokens within one window of [`host_node`](Self::host_node) held on host only.
    pub swa_host_hit_len: usize,
    /// Whether [`host_node`](Self::host_node)'s Mamba state is on host only.
    pub mamba_host_hit: bool,
}

/// The per-match validator state: SWA's running window since the last tombstone. With
/// `host`, a component on host counts as present (SGLang's HiCache validators).
struct Validators {
    swa_window: Option<u64>,
    swa_len: u64,
    mamba: bool,
    host: bool,
}

impl Validators {
    fn new(t: &UnifiedTree, host: bool) -> Self {
        Self {
            swa_window: t.cfg.swa_window.map(u64::from),
            swa_len: u64::MAX,
            mamba: t.has[MAMBA],
            host,
        }
    }

    /// Runs every configured validator on `i` (all of them: SWA's is stateful).
    fn all(&mut self, t: &UnifiedTree, i: u32) -> bool {
        let n = &t.arena.nodes[i as usize];
        let on = |c: Component| n.comp[c as usize].present || (self.host && n.on_host(c));
        let mut ok = on(Component::Full);
        if let Some(w) = self.swa_window {
            if on(Component::Swa) {
                self.swa_len = self.swa_len.saturating_add(n.key.len() as u64);
                ok &= self.swa_len >= w;
            } else {
                self.swa_len = 0;
                ok = false;
            }
        }
        if self.mamba {
            ok &= on(Component::Mamba);
        }
        ok
    }
}

impl UnifiedTree {
    /// Finds the longest prefix of `key` (truncated to whole pages) where every component
    /// allows a match; splits a node the key ends inside; refreshes the LRUs and stamps the
    /// matched path.
    pub fn match_prefix(&mut self, key: &[u32]) -> Result<UnifiedMatch> {
        let key = &key[..key.len() / self.ps() * self.ps()];
        if key.is_empty() {
            return Ok(self.empty_match());
        }
        let mut v = Validators::new(self, true);
        let mut dv = Validators::new(self, false);
        let (mut node, mut offset, mut full_hit) = (ROOT, 0usize, 0usize);
        let (mut best, mut best_len, mut host_best) = (ROOT, 0usize, ROOT);
        while offset < key.len() {
            let Some(child) = self.child(node, &key[offset..]) else {
                break;
            };
            let plen = self.match_len(child, &key[offset..]);
            full_hit += plen;
            let whole = plen == self.arena.nodes[child as usize].key.len();
            node = if whole {
                child
            } else {
                self.split(child, plen)
            };
            offset += plen;
            if dv.all(self, node) {
                best = node;
                best_len = offset;
            }
            // Without host copies the host validators agree with the device ones.
            if !self.host_seen {
                host_best = best;
            } else if v.all(self, node) {
                host_best = node;
            }
            if !whole {
                break;
            }
        }
        self.refresh_match_end(host_best);
        let mut time = self.tick();
        let mut i = host_best;
        loop {
            self.stamp(i, time);
            time -= 1;
            if i == ROOT {
                break;
            }
            i = self.arena.nodes[i as usize].parent;
        }
        Ok(self.finish_match(best, best_len, host_best, full_hit))
    }

    fn empty_match(&self) -> UnifiedMatch {
        UnifiedMatch {
            device_prefix_len: 0,
            node: self.root(),
            full_hit_len: 0,
            swa_branching: None,
            mamba_branching: None,
            mamba_slot: None,
            host_node: self.root(),
            host_hit_len: 0,
            swa_host_hit_len: 0,
            mamba_host_hit: false,
        }
    }

    /// The host hits (SGLang's `finalize_match_result_in_tree_core` of each component) and
    /// the branching lengths: the Full hit aligned to each component's grid, when past the
    /// valid prefix (device prefix plus Full host hit).
    fn finish_match(&self, best: u32, best_len: usize, host: u32, full_hit: usize) -> UnifiedMatch {
        let mut host_hit = 0;
        let mut i = host;
        while i != best && i != ROOT {
            host_hit += self.arena.nodes[i as usize].host_full.len() * self.ps();
            i = self.arena.nodes[i as usize].parent;
        }
        let boundary = best_len + host_hit;
        let past = |grid: usize| {
            let aligned = full_hit / grid * grid;
            (aligned > boundary).then_some(aligned)
        };
        let n = &self.arena.nodes[best as usize];
        let h = &self.arena.nodes[host as usize];
        UnifiedMatch {
            device_prefix_len: best_len,
            node: self.id(best),
            full_hit_len: full_hit,
            swa_branching: self.has[SWA].then(|| past(self.ps())).flatten(),
            mamba_branching: self.cfg.mamba_grid().and_then(past),
            mamba_slot: n.comp[MAMBA].present.then_some(n.mamba_slot),
            host_node: self.id(host),
            host_hit_len: host_hit,
            swa_host_hit_len: if self.host_seen {
                list_pages(&self.host_swa_window(host)) * self.ps()
            } else {
                0
            },
            mamba_host_hit: host != ROOT && !h.comp[MAMBA].present && h.host_mamba.is_some(),
        }
    }

    /// MATCH_END refresh: SWA moves the window ancestors of the matched node to MRU (the node
    /// most recent); Mamba moves the matched node alone.
    fn refresh_match_end(&mut self, best: u32) {
        if let Some(w) = self.cfg.swa_window {
            self.refresh_window(best, w as usize + self.ps());
        }
        if self.has[MAMBA] && best != ROOT && self.arena.nodes[best as usize].comp[MAMBA].present {
            self.lrus[MAMBA_LRU].touch(best);
        }
    }

    /// SGLang's `reset_node_and_window_ancestors_mru`: from `i` upwards while fewer than
    /// `span` tokens were passed, each node with SWA data goes behind the previous one,
    /// starting at the head.
    pub(crate) fn refresh_window(&mut self, mut i: u32, span: usize) {
        let mut prev = None;
        let mut acc = 0usize;
        while i != ROOT && acc < span {
            if self.arena.nodes[i as usize].comp[SWA].present {
                self.lrus[SWA_LRU].move_after(prev, i);
                prev = Some(i);
            }
            acc += self.arena.nodes[i as usize].key.len();
            i = self.arena.nodes[i as usize].parent;
        }
    }
}
