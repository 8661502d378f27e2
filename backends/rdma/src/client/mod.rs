//! The client: [`RdmaStorage`], the [`Storage`] implementation over a pool of
//! [`Connection`]s to one server.
//!
//! # How a call runs
//!
//! - A batch is cut into stripes of at least `stripe_bytes`, at most one per connection, and
//!   the stripes run in parallel, each on its own pooled connection.
//! - `batch_get` stripe: `READ` → the server leases the hits, replies with per-page statuses
//!   followed by the hits' bytes, which are read straight into the caller's page buffers
//!   (scattered over their parts), then releases the leases. Each hit's XXH3-64 is checked
//!   against the checksum stored at commit: a mismatch is [`PageOutcome::Corrupt`], the buffer
//!   is zeroed, and the client asks the server to `DROP` that copy (only if its checksum is
//!   still the bad one, so a concurrent rewrite is kept).
//! - `batch_set` stripe: `ALLOCATE` (present pages with the same metadata are skipped), then
//!   `WRITE` (the bytes, straight from the caller's parts) and `COMMIT` (with checksums)
//!   pipelined back to back; a page is `Stored` only once its commit is acknowledged.
//! - A socket error or timeout drops that connection (a fresh one is made next time) and
//!   fails the call with [`StorageError::Unavailable`] naming the server and the cause; a call
//!   on a connection that had been idle in the pool is retried once on a fresh connection, so
//!   a server restart costs no failed call. After a failed connection attempt, calls fail fast
//!   for `retry_backoff_ms`. Nothing waits longer than `io_timeout_ms` without progress.
//! - Occupancy (`pages`, `bytes`, evictions) comes from the server with every reply; the
//!   newest (by the server's sequence number) is what [`Storage::stats`] reports.

pub mod conn;
pub mod options;
mod spawn;
#[cfg(feature = "verbs")]
mod verbs_path;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Instant;

use async_trait::async_trait;
use hicache_core::{MemoryRegion, PageKey};
use hicache_storage::backend::bump;
use hicache_storage::checksum::{checksum_page, checksum_page_mut};
use hicache_storage::{
    BackendInfo, PageBuf, PageBufMut, PageError, PageOutcome, Result, StatsCounters, Storage,
    StorageError, StorageStats, check_batch,
};
use parking_lot::Mutex;

use crate::error::RdmaError;
use crate::protocol::{AllocStatus, Occupancy, PageReq, ReadStatus, Reply, Request, ServerInfo};
use crate::tls::TlsClient;
pub use conn::Connection;
pub use options::{RdmaOptions, Transport};

/// Runs `$body` (a future using the connection `$c`) on pooled connection `$slot`,
/// connecting if needed. A failure drops the connection; a failure on a connection that was
/// reused from the pool is retried once on a fresh one. Evaluates to `Result<T, StorageError>`.
macro_rules! with_conn {
    ($self:ident, $slot:expr, $c:ident => $body:expr) => {{
        let mut guard = $self.pool[$slot % $self.pool.len()].lock().await;
        let mut attempt = 0;
        loop {
            let reused = guard.is_some();
            if guard.is_none() {
                match $self.open_connection().await {
                    Ok(c) => *guard = Some(c),
                    Err(e) => break Err(StorageError::from(e)),
                }
            }
            let $c: &mut Connection = guard.as_mut().expect("connected above");
            match $body.await {
                Ok(v) => break Ok(v),
                Err(e) => {
                    *guard = None;
                    let retry = attempt == 0
                        && reused
                        && matches!(e, RdmaError::Io { .. } | RdmaError::Protocol { .. });
                    if !retry {
                        break Err(StorageError::from(e));
                    }
                    tracing::debug!("rdma: retrying on a fresh connection after: {e}");
                    attempt += 1;
                }
            }
        }
    }};
}

/// The `rdma` backend: a client of one memory-pool server.
pub struct RdmaStorage {
    opts: RdmaOptions,
    addr: String,
    pool: Vec<tokio::sync::Mutex<Option<Connection>>>,
    next: AtomicUsize,
    info: ServerInfo,
    backoff: Mutex<Option<(Instant, String)>>,
    counters: StatsCounters,
    occupancy: Mutex<Occupancy>,
    /// The verbs data plane and the control connection its queue pair is tied to.
    #[cfg(feature = "verbs")]
    verbs: Option<(crate::verbs::ClientVerbs, tokio::sync::Mutex<Connection>)>,
    /// A server this client started (`spawn_server`); it lives as long as the client.
    _spawned: Option<spawn::Spawned>,
    /// TLS for every connection, when `tls_ca_file` is set.
    tls: Option<TlsClient>,
}

impl std::fmt::Debug for RdmaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaStorage")
            .field("server", &self.addr)
            .field("transport", &self.opts.transport)
            .field("connections", &self.pool.len())
            .finish()
    }
}

/// Runs futures concurrently and returns their outputs in order.
async fn join_all<F: Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter()
        .map(|o| o.expect("every future completed"))
        .collect()
}

/// Awaits every stripe of a batch (all run to completion, none is abandoned mid-frame) and
/// concatenates their outcomes in batch order; the first stripe error is the batch's error.
async fn join_stripes<F>(futs: Vec<F>, pages: usize) -> Result<Vec<PageOutcome>>
where
    F: Future<Output = Result<Vec<PageOutcome>>>,
{
    let mut out = Vec::with_capacity(pages);
    let mut first_err = None;
    for r in join_all(futs).await {
        match r {
            Ok(v) => out.extend(v),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// Cuts `lens` (page byte lengths) into at most `max` consecutive stripes of at least
/// `stripe` bytes each; returns the stripe boundaries.
fn stripes(lens: &[usize], stripe: u64, max: usize) -> Vec<std::ops::Range<usize>> {
    let total: u64 = lens.iter().map(|&l| l as u64).sum();
    let n = ((total / stripe.max(1)) as usize)
        .clamp(1, max.max(1))
        .min(lens.len().max(1));
    let per = total.div_ceil(n as u64);
    let mut v = Vec::with_capacity(n);
    let (mut start, mut acc) = (0, 0u64);
    for (i, &l) in lens.iter().enumerate() {
        acc += l as u64;
        if acc >= per && v.len() + 1 < n {
            v.push(start..i + 1);
            start = i + 1;
            acc = 0;
        }
    }
    if start < lens.len() || v.is_empty() {
        v.push(start..lens.len());
    }
    v
}

impl RdmaStorage {
    /// Connects to the server (or starts one, with `spawn_server`) and performs the handshake
    /// on one connection; the others connect on first use.
    pub async fn connect(opts: RdmaOptions) -> Result<Self> {
        let mut opts = opts;
        let (addr, spawned) = spawn::server_addr(&mut opts).await?;
        let tls = opts
            .tls
            .as_ref()
            .map(|t| TlsClient::new(t, &addr))
            .transpose()?;
        #[allow(unused_mut)]
        let mut first = Connection::connect_tls(
            &addr,
            &opts.client_name,
            opts.token.as_ref(),
            tls.as_ref(),
            opts.connect_timeout,
            opts.io_timeout,
        )
        .await?;
        let info = first.info().clone();
        if opts.max_batch > info.max_batch as usize {
            return Err(StorageError::config(
                "backend rdma",
                "max_batch",
                opts.max_batch.to_string(),
                format!(
                    "exceeds the server's limit of {} pages per request (its --max-batch)",
                    info.max_batch
                ),
            ));
        }
        #[cfg(feature = "verbs")]
        let verbs = match opts.transport {
            Transport::Verbs => {
                let v = crate::verbs::ClientVerbs::open(
                    opts.device.as_deref(),
                    opts.ib_port,
                    opts.gid_index,
                    &info,
                )?;
                let mine = v.endpoint()?;
                let mut ctl = Connection::connect_tls(
                    &addr,
                    &opts.client_name,
                    opts.token.as_ref(),
                    tls.as_ref(),
                    opts.connect_timeout,
                    opts.io_timeout,
                )
                .await?;
                match ctl.call(&Request::VerbsConnect { endpoint: mine }).await? {
                    (_, Reply::VerbsConnect(theirs)) => v.connect(&theirs)?,
                    (_, other) => return Err(ctl.mismatch("VERBS_CONNECT reply", &other).into()),
                }
                Some((v, tokio::sync::Mutex::new(ctl)))
            }
            Transport::Tcp => None,
        };
        #[cfg(not(feature = "verbs"))]
        if opts.transport == Transport::Verbs {
            return Err(RdmaError::VerbsNotBuilt.into());
        }
        let pool: Vec<_> = (0..opts.connections)
            .map(|_| tokio::sync::Mutex::new(None))
            .collect();
        *pool[0].try_lock().expect("fresh mutex") = Some(first);
        Ok(Self {
            addr,
            pool,
            next: AtomicUsize::new(0),
            info,
            backoff: Mutex::new(None),
            counters: StatsCounters::default(),
            occupancy: Mutex::new(Occupancy::default()),
            #[cfg(feature = "verbs")]
            verbs,
            _spawned: spawned,
            tls,
            opts,
        })
    }

    /// The server's address.
    pub fn server_addr(&self) -> &str {
        &self.addr
    }

    /// The options in use.
    pub fn options(&self) -> &RdmaOptions {
        &self.opts
    }

    fn note(&self, occ: Occupancy) {
        let mut o = self.occupancy.lock();
        if occ.seq > o.seq {
            *o = occ;
        }
    }

    async fn open_connection(&self) -> crate::error::Result<Connection> {
        if let Some((until, last)) = self.backoff.lock().clone()
            && Instant::now() < until
        {
            return Err(RdmaError::Backoff {
                peer: self.addr.clone(),
                retry_ms: self.opts.retry_backoff.as_millis() as u64,
                last,
            });
        }
        match Connection::connect_tls(
            &self.addr,
            &self.opts.client_name,
            self.opts.token.as_ref(),
            self.tls.as_ref(),
            self.opts.connect_timeout,
            self.opts.io_timeout,
        )
        .await
        {
            Ok(c) => {
                *self.backoff.lock() = None;
                Ok(c)
            }
            Err(e) => {
                if !self.opts.retry_backoff.is_zero() {
                    *self.backoff.lock() =
                        Some((Instant::now() + self.opts.retry_backoff, e.to_string()));
                }
                Err(e)
            }
        }
    }

    fn base_slot(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    async fn get_stripe(
        &self,
        slot: usize,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Vec<PageOutcome>> {
        let pages = page_reqs(keys, dst.iter().map(|d| (d.len(), d.layout())));
        let (outcomes, mismatches) =
            with_conn!(self, slot, c => self.get_on(c, &pages, &mut *dst))?;
        bump(&self.counters.meta_mismatches, mismatches);
        Ok(outcomes)
    }

    async fn get_on(
        &self,
        c: &mut Connection,
        pages: &[PageReq],
        dst: &mut [PageBufMut<'_>],
    ) -> crate::error::Result<(Vec<PageOutcome>, u64)> {
        let id = c
            .send(
                &Request::Read {
                    pages: pages.to_vec(),
                },
                0,
            )
            .await?;
        c.flush().await?;
        let (occ, reply, payload) = c.recv(id).await?;
        let statuses = match reply {
            Reply::Read(v) if v.len() == pages.len() => v,
            other => return Err(c.mismatch("READ reply, one status per page", &other)),
        };
        let expect: u64 = statuses
            .iter()
            .zip(pages)
            .filter(|(s, _)| matches!(s, ReadStatus::Hit { .. }))
            .map(|(_, p)| p.len)
            .sum();
        if payload != expect {
            return Err(c.mismatch(
                &format!("READ payload of {expect} bytes"),
                &Reply::Read(statuses),
            ));
        }
        let mut out = Vec::with_capacity(pages.len());
        let mut drops = Vec::new();
        let mut mismatches = 0u64;
        for (i, s) in statuses.iter().enumerate() {
            match *s {
                ReadStatus::Miss => out.push(PageOutcome::Miss),
                ReadStatus::Mismatch => {
                    mismatches += 1;
                    out.push(PageOutcome::Miss);
                }
                ReadStatus::Hit { checksum } => {
                    let d = &mut dst[i];
                    for part in d.parts_mut() {
                        c.read_payload(part).await?;
                    }
                    if checksum_page_mut(d) == checksum {
                        out.push(PageOutcome::Hit);
                    } else {
                        d.zero();
                        drops.push((pages[i].key, checksum));
                        out.push(PageOutcome::Corrupt);
                    }
                }
            }
        }
        let mut occ = occ;
        if !drops.is_empty() {
            tracing::warn!(
                "rdma: {} page(s) from {} failed checksum verification; dropping them",
                drops.len(),
                c.peer()
            );
            occ = c.call(&Request::Drop { pages: drops }).await?.0;
        }
        self.note(occ);
        Ok((out, mismatches))
    }

    async fn set_stripe(
        &self,
        slot: usize,
        keys: &[PageKey],
        src: &[PageBuf<'_>],
    ) -> Result<Vec<PageOutcome>> {
        let pages = page_reqs(keys, src.iter().map(|s| (s.len(), s.layout())));
        with_conn!(self, slot, c => self.set_on(c, &pages, src))
    }

    async fn set_on(
        &self,
        c: &mut Connection,
        pages: &[PageReq],
        src: &[PageBuf<'_>],
    ) -> crate::error::Result<Vec<PageOutcome>> {
        let (occ, reply) = c
            .call(&Request::Allocate {
                pages: pages.to_vec(),
            })
            .await?;
        self.note(occ);
        let statuses = match reply {
            Reply::Allocate(v) if v.len() == pages.len() => v,
            other => return Err(c.mismatch("ALLOCATE reply, one status per page", &other)),
        };
        let mut out: Vec<PageOutcome> = Vec::with_capacity(pages.len());
        let mut writes = Vec::new(); // (index, slot id)
        for (i, s) in statuses.iter().enumerate() {
            out.push(match *s {
                AllocStatus::Slot { id, .. } => {
                    writes.push((i, id));
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
        if writes.is_empty() {
            return Ok(out);
        }
        let slots: Vec<(u64, u64)> = writes
            .iter()
            .map(|&(i, id)| (id, src[i].len() as u64))
            .collect();
        let commits: Vec<(u64, u64)> = writes
            .iter()
            .map(|&(i, id)| (id, checksum_page(&src[i])))
            .collect();
        let total: u64 = slots.iter().map(|s| s.1).sum();
        // WRITE and COMMIT pipelined: the server handles them in order.
        let wid = c.send(&Request::Write { slots }, total).await?;
        for &(i, _) in &writes {
            for part in src[i].parts() {
                c.write_payload(part).await?;
            }
        }
        let cid = c.send(&Request::Commit { slots: commits }, 0).await?;
        c.flush().await?;
        let written = match c.recv(wid).await? {
            (_, Reply::Write(v), 0) if v.len() == writes.len() => v,
            (_, other, _) => return Err(c.mismatch("WRITE reply", &other)),
        };
        let (occ, committed) = match c.recv(cid).await? {
            (occ, Reply::Commit(v), 0) if v.len() == writes.len() => (occ, v),
            (_, other, _) => return Err(c.mismatch("COMMIT reply", &other)),
        };
        self.note(occ);
        for (k, &(i, _)) in writes.iter().enumerate() {
            if !(written[k] && committed[k]) {
                out[i] = PageOutcome::Failed(PageError::Backend(format!(
                    "rdma: the reservation for page {i} expired before it was committed \
                         (server {})",
                    c.peer()
                )));
            }
        }
        Ok(out)
    }
}

#[async_trait]
impl Storage for RdmaStorage {
    fn info(&self) -> BackendInfo {
        let mut i = BackendInfo::new(crate::BACKEND_NAME, self.opts.max_batch);
        i.zero_copy = true;
        i.shared = true;
        i.persistent = false;
        i.max_page_bytes = self.info.max_page_bytes as usize;
        i.capacity_bytes = Some(self.info.pool_bytes);
        i
    }

    async fn batch_exists(&self, keys: &[PageKey]) -> Result<usize> {
        check_batch("batch_exists", self.opts.max_batch, keys.len(), keys.len())?;
        if keys.is_empty() {
            self.counters.record_exists(0, 0);
            return Ok(0);
        }
        let req = Request::Exists {
            keys: keys.to_vec(),
        };
        let slot = self.base_slot();
        let (occ, reply) = with_conn!(self, slot, c => c.call(&req))?;
        self.note(occ);
        let Reply::Exists { run } = reply else {
            return Err(StorageError::backend(
                crate::BACKEND_NAME,
                format!("EXISTS answered with {reply:?}"),
            ));
        };
        let run = (run as usize).min(keys.len());
        self.counters.record_exists((run + 1).min(keys.len()), run);
        Ok(run)
    }

    async fn batch_get(
        &self,
        keys: &[PageKey],
        dst: &mut [PageBufMut<'_>],
    ) -> Result<Vec<PageOutcome>> {
        check_batch("batch_get", self.opts.max_batch, keys.len(), dst.len())?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let lens: Vec<usize> = dst.iter().map(|d| d.len()).collect();
        #[cfg(feature = "verbs")]
        if let Some(out) = self.get_verbs(keys, dst).await? {
            self.counters.record_get(&out, lens.into_iter());
            return Ok(out);
        }
        let ranges = stripes(&lens, self.opts.stripe_bytes, self.pool.len());
        let base = self.base_slot();
        let mut futs = Vec::with_capacity(ranges.len());
        let mut rest: &mut [PageBufMut<'_>] = dst;
        for (n, r) in ranges.iter().enumerate() {
            let (mine, tail) = rest.split_at_mut(r.len());
            rest = tail;
            futs.push(self.get_stripe(base + n, &keys[r.clone()], mine));
        }
        let out = match join_stripes(futs, keys.len()).await {
            Ok(out) => out,
            Err(e) => {
                bump(&self.counters.get_errors, keys.len() as u64);
                return Err(e);
            }
        };
        self.counters.record_get(&out, lens.into_iter());
        Ok(out)
    }

    async fn batch_set(&self, keys: &[PageKey], src: &[PageBuf<'_>]) -> Result<Vec<PageOutcome>> {
        check_batch("batch_set", self.opts.max_batch, keys.len(), src.len())?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let lens: Vec<usize> = src.iter().map(|s| s.len()).collect();
        #[cfg(feature = "verbs")]
        if let Some(out) = self.set_verbs(keys, src).await? {
            self.counters.record_set(&out, lens.into_iter());
            return Ok(out);
        }
        let ranges = stripes(&lens, self.opts.stripe_bytes, self.pool.len());
        let base = self.base_slot();
        let futs: Vec<_> = ranges
            .iter()
            .enumerate()
            .map(|(n, r)| self.set_stripe(base + n, &keys[r.clone()], &src[r.clone()]))
            .collect();
        let out = match join_stripes(futs, keys.len()).await {
            Ok(out) => out,
            Err(e) => {
                bump(&self.counters.set_errors, keys.len() as u64);
                return Err(e);
            }
        };
        self.counters.record_set(&out, lens.into_iter());
        Ok(out)
    }

    fn register_memory(&self, region: MemoryRegion) -> Result<()> {
        #[cfg(feature = "verbs")]
        if let Some((v, _)) = &self.verbs {
            return v.register(region).map_err(Into::into);
        }
        let _ = region;
        Ok(())
    }

    async fn delete(&self, keys: &[PageKey]) -> Result<usize> {
        check_batch("delete", self.opts.max_batch, keys.len(), keys.len())?;
        if keys.is_empty() {
            return Ok(0);
        }
        let req = Request::Delete {
            keys: keys.to_vec(),
        };
        let slot = self.base_slot();
        let (occ, reply) = with_conn!(self, slot, c => c.call(&req))?;
        self.note(occ);
        let Reply::Delete { n } = reply else {
            return Err(StorageError::backend(
                crate::BACKEND_NAME,
                format!("DELETE answered with {reply:?}"),
            ));
        };
        bump(&self.counters.deleted_pages, n as u64);
        Ok(n as usize)
    }

    fn stats(&self) -> StorageStats {
        let o = *self.occupancy.lock();
        let mut s = self
            .counters
            .snapshot(o.pages, o.bytes, Some(self.info.pool_bytes));
        s.evicted_pages = o.evicted_pages;
        s.evicted_bytes = o.evicted_bytes;
        s
    }
}

/// The pages `keys` name, with the lengths and layouts of their buffers.
fn page_reqs(
    keys: &[PageKey],
    bufs: impl Iterator<Item = (usize, hicache_core::LayoutKind)>,
) -> Vec<PageReq> {
    keys.iter()
        .zip(bufs)
        .map(|(k, (len, layout))| PageReq {
            key: *k,
            len: len as u64,
            layout: layout.tag(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripes_cover_in_order() {
        let lens = vec![256 << 10; 128];
        let s = stripes(&lens, 2 << 20, 4);
        assert_eq!(s.len(), 4);
        assert_eq!(s.first().unwrap().start, 0);
        assert_eq!(s.last().unwrap().end, 128);
        for w in s.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        assert_eq!(stripes(&[10, 10], 2 << 20, 4), vec![0..2]);
        assert_eq!(stripes(&[8 << 20], 2 << 20, 4), vec![0..1]);
        let s = stripes(&[8 << 20; 3], 2 << 20, 4);
        assert_eq!(s, vec![0..1, 1..2, 2..3]);
    }
}
