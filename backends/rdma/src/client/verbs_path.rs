//! The verbs data path of [`RdmaStorage`] (feature `verbs`): `batch_get` by `LOOKUP`, RDMA
//! READ, checksum check and `RELEASE`; `batch_set` by `ALLOCATE`, RDMA WRITE and `COMMIT`.
//! Used where every page part lies in the registered host region; the rest goes over TCP.

use hicache_core::PageKey;
use hicache_storage::backend::bump;
use hicache_storage::checksum::{checksum_page, checksum_page_mut};
use hicache_storage::{PageBuf, PageBufMut, PageError, PageOutcome, Result};

use super::{Connection, RdmaStorage, page_reqs};
use crate::error::RdmaError;
use crate::protocol::{AllocStatus, Reply, Request};
use crate::verbs::{ClientVerbs, Transfer};

/// Appends to `ops` the RDMA transfers that move `parts` (local address, length), in order,
/// to or from the server's extent at `(region, offset)`; `call` names the request that named
/// the extent.
fn push_transfers(
    v: &ClientVerbs,
    call: &'static str,
    (region, offset): (u32, u64),
    lkey: u32,
    parts: impl Iterator<Item = (u64, usize)>,
    ops: &mut Vec<Transfer>,
) -> crate::error::Result<()> {
    let (mut remote, rkey) = v.remote(region, offset).ok_or_else(|| RdmaError::Verbs {
        call,
        detail: format!("server named unregistered region {region}"),
    })?;
    for (local, len) in parts {
        ops.push(Transfer {
            local,
            len,
            lkey,
            remote,
            rkey,
        });
        remote += len as u64;
    }
    Ok(())
}

impl RdmaStorage {
    /// The verbs data plane, its control connection and the local key covering every one of
    /// `ranges` (address, length); `None` without verbs or where a range lies outside the
    /// registered region (the caller goes over TCP).
    fn verbs_for(
        &self,
        ranges: impl Iterator<Item = (usize, usize)>,
    ) -> Option<(&ClientVerbs, &tokio::sync::Mutex<Connection>, u32)> {
        let (v, ctl) = self.verbs.as_ref()?;
        Some((v, ctl, v.lkey_for(ranges)?))
    }

    /// `batch_get` over RDMA READ, when every destination part lies in the registered region;
    /// `None` otherwise (the caller goes over TCP).
    pub(super) async fn get_verbs(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Option<Vec<PageOutcome>>> {
        use crate::protocol::LookupStatus;
        let ranges = dst
            .iter()
            .flat_map(|d| d.parts().iter().map(|p| (p.as_ptr() as usize, p.len())));
        let Some((v, ctl, lkey)) = self.verbs_for(ranges) else {
            return Ok(None);
        };
        let pages = page_reqs(keys, dst.iter().map(|d| (d.len(), d.layout())));
        let mut c = ctl.lock().await;
        let (occ, reply) = c.call(&Request::Lookup { pages }).await?;
        self.note(occ);
        let statuses = match reply {
            Reply::Lookup(s) if s.len() == keys.len() => s,
            other => return Err(c.mismatch("LOOKUP reply", &other).into()),
        };
        let mut ops = Vec::new();
        let mut leases = Vec::new();
        for (i, s) in statuses.iter().enumerate() {
            if let LookupStatus::Hit {
                region,
                offset,
                lease,
                ..
            } = *s
            {
                leases.push(lease);
                let parts = dst[i].parts_mut().iter_mut();
                let parts = parts.map(|p| (p.as_mut_ptr() as u64, p.len()));
                push_transfers(v, "LOOKUP", (region, offset), lkey, parts, &mut ops)?;
            }
        }
        let read = v.read(&ops);
        let (occ, _) = c.call(&Request::Release { leases }).await?;
        self.note(occ);
        read?;
        let mut out = Vec::with_capacity(keys.len());
        let mut drops = Vec::new();
        for (i, s) in statuses.iter().enumerate() {
            out.push(match *s {
                LookupStatus::Miss => PageOutcome::Miss,
                LookupStatus::Mismatch => {
                    bump(&self.counters.meta_mismatches, 1);
                    PageOutcome::Miss
                }
                LookupStatus::Hit { checksum, .. } => {
                    if checksum_page_mut(&dst[i]) == checksum {
                        PageOutcome::Hit
                    } else {
                        dst[i].zero();
                        drops.push((keys[i], checksum));
                        PageOutcome::Corrupt
                    }
                }
            });
        }
        if !drops.is_empty() {
            let (occ, _) = c.call(&Request::Drop { pages: drops }).await?;
            self.note(occ);
        }
        Ok(Some(out))
    }

    /// `batch_set` over RDMA WRITE, when every source part lies in the registered region;
    /// `None` otherwise.
    pub(super) async fn set_verbs(
        &self,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
    ) -> Result<Option<Vec<PageOutcome>>> {
        let ranges = src
            .iter()
            .flat_map(|s| s.parts().iter().map(|p| (p.as_ptr() as usize, p.len())));
        let Some((v, ctl, lkey)) = self.verbs_for(ranges) else {
            return Ok(None);
        };
        let pages = page_reqs(keys, src.iter().map(|s| (s.len(), s.layout())));
        let mut c = ctl.lock().await;
        let (occ, reply) = c.call(&Request::Allocate { pages }).await?;
        self.note(occ);
        let statuses = match reply {
            Reply::Allocate(s) if s.len() == keys.len() => s,
            other => return Err(c.mismatch("ALLOCATE reply", &other).into()),
        };
        let mut out = Vec::with_capacity(keys.len());
        let mut ops = Vec::new();
        let mut commits = Vec::new();
        for (i, s) in statuses.iter().enumerate() {
            out.push(match *s {
                AllocStatus::Slot { id, region, offset } => {
                    let parts = src[i].parts().iter().map(|p| (p.as_ptr() as u64, p.len()));
                    push_transfers(v, "ALLOCATE", (region, offset), lkey, parts, &mut ops)?;
                    commits.push((i, id, checksum_page(&src[i])));
                    PageOutcome::Stored
                }
                AllocStatus::Present => PageOutcome::Present,
                AllocStatus::TooLarge { max } => PageOutcome::Failed(PageError::TooLarge {
                    len: src[i].len(),
                    max: max as usize,
                }),
                AllocStatus::NoSpace => PageOutcome::Failed(PageError::NoSpace),
                AllocStatus::Empty => PageOutcome::Failed(PageError::EmptyPage),
            });
        }
        if commits.is_empty() {
            return Ok(Some(out));
        }
        if let Err(e) = v.write(&ops) {
            let slots = commits.iter().map(|c| c.1).collect();
            let _ = c.call(&Request::Abort { slots }).await;
            return Err(e.into());
        }
        let (occ, reply) = c
            .call(&Request::Commit {
                slots: commits.iter().map(|c| (c.1, c.2)).collect(),
            })
            .await?;
        self.note(occ);
        let ok = match reply {
            Reply::Commit(v) if v.len() == commits.len() => v,
            other => return Err(c.mismatch("COMMIT reply", &other).into()),
        };
        for (k, &(i, _, _)) in commits.iter().enumerate() {
            if !ok[k] {
                out[i] = PageOutcome::Failed(PageError::Backend(format!(
                    "rdma: the reservation for page {i} expired before it was committed"
                )));
            }
        }
        Ok(Some(out))
    }
}
