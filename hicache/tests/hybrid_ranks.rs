//! Tensor parallelism for the hybrid facade: copies finish at counts every rank agreed on.
//! Two ranks in one process over the TCP rank group (loopback) must keep identical trees
//! after every tick; a group that holds the backup count back keeps the nodes locked.

mod common;
mod hybrid_common;

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hicache::hybrid::HYBRID_EXCHANGE_BACKUPS;
use hicache::{
    Component, HybridCache, HybridConfig, RankError, RankGroup, SingleRank, TcpRankGroup,
};
use hybrid_common::{Engine, prompt};

fn cache(rank: Arc<dyn RankGroup>) -> HybridCache {
    let cfg = HybridConfig {
        page_size: 4,
        swa_window: Some(8),
        mamba_chunk: Some(8),
        ..Default::default()
    };
    hybrid_common::builder(cfg, 16)
        .rank_group(rank)
        .build()
        .unwrap()
}

/// What a rank's tree looks like: nodes, sizes per component, copies in flight.
fn shape(c: &HybridCache) -> (usize, [u64; 3], usize) {
    let t = c.tree();
    let sizes = [Component::Full, Component::Swa, Component::Mamba].map(|x| t.size(x));
    (t.node_count(), sizes, c.copies_in_flight())
}

fn run_rank(rank: usize, hub: std::net::SocketAddr) -> Vec<(usize, [u64; 3], usize)> {
    let group: Arc<dyn RankGroup> =
        Arc::new(TcpRankGroup::connect(rank, 2, hub, Duration::from_secs(30)).unwrap());
    let mut e = Engine::new(cache(group));
    let mut shapes = Vec::new();
    let system = prompt(1, 24);
    for turn in 0..4u32 {
        let mut p = system.clone();
        p.extend(prompt(10 + turn % 2, 16 + 4 * turn as usize));
        e.run(&p);
        shapes.push(shape(&e.cache));
        e.cache.poll().unwrap();
        shapes.push(shape(&e.cache));
    }
    e.settle();
    shapes.push(shape(&e.cache));
    e.cache.shutdown().unwrap();
    shapes
}

#[test]
fn two_ranks_keep_identical_trees() {
    let hub = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let peer = std::thread::spawn(move || run_rank(1, hub));
    let mine = run_rank(0, hub);
    let theirs = peer.join().unwrap();
    assert_eq!(mine, theirs);
    assert_eq!(mine.last().unwrap().2, 0, "everything finished at the end");
}

/// A single rank whose peers (simulated) have not seen any backup land while `hold` is set.
struct HoldBackups {
    hold: AtomicBool,
}

impl RankGroup for HoldBackups {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        2
    }
    fn exchange(&self, min: &mut [u64], max: &mut [u64]) -> Result<(), RankError> {
        SingleRank.exchange(min, max)?;
        if self.hold.load(Ordering::SeqCst) && !min.is_empty() {
            min[HYBRID_EXCHANGE_BACKUPS] = 0;
        }
        Ok(())
    }
}

#[test]
fn backups_finish_only_at_the_agreed_count() {
    let group = Arc::new(HoldBackups {
        hold: AtomicBool::new(true),
    });
    let mut e = Engine::new(cache(group.clone()));
    e.run(&prompt(1, 40));
    e.cache.flush().unwrap();
    let held = e.cache.copies_in_flight();
    assert!(held > 0, "backups wait for the peers");
    assert!(e.cache.tree().pending_backups() > 0);
    group.hold.store(false, Ordering::SeqCst);
    e.cache.poll().unwrap();
    assert_eq!(e.cache.copies_in_flight(), 0);
    assert_eq!(e.cache.tree().pending_backups(), 0);
    e.settle();
    e.cache.shutdown().unwrap();
}
