//! The verbs data plane (feature `verbs`): one-sided RDMA READ/WRITE over an RC queue pair,
//! with libibverbs through `rdma-sys`.
//!
//! - The server opens the first RDMA device, registers every pool region for remote read and
//!   write, and publishes each region's address and rkey in its `HELLO` reply. For each client
//!   that sends `VERBS_CONNECT` it creates an RC queue pair, connects it to the client's, and
//!   keeps it while that control connection lives.
//! - The client opens its device (the `device` field, or the first one), registers the host
//!   region announced by [`Storage::register_memory`](hicache_storage::Storage::register_memory),
//!   and exchanges queue-pair endpoints on its first control connection. A `batch_get` whose
//!   destinations lie in the registered region runs `LOOKUP` (leased locations), RDMA READs
//!   straight into the destination parts, checksum verification, then `RELEASE`; a
//!   `batch_set` runs `ALLOCATE`, RDMA WRITEs from the source parts, then `COMMIT`. Pages
//!   outside the registered region go over TCP.
//! - Completions are polled (busy, with `yield_now`) on the calling thread.
//!
//! Without a device, opening fails with [`RdmaError::NoDevice`] saying so. This module is
//! compiled and linted on machines without RDMA hardware; it has not been run against a
//! device.

use std::collections::HashMap;
use std::ffi::CStr;
use std::os::raw::c_int;

use hicache_core::MemoryRegion;
use parking_lot::Mutex;
use rdma_sys::*;

use crate::error::{RdmaError, Result};
use crate::protocol::{RegionDesc, ServerInfo, VerbsEndpoint};

/// Largest single RDMA message (the verbs length field is 32-bit).
const MAX_MSG: usize = 1 << 30;
/// Work requests posted before polling.
const MAX_OUTSTANDING: usize = 256;

fn errno() -> String {
    std::io::Error::last_os_error().to_string()
}

fn verbs_err(call: &'static str, detail: impl Into<String>) -> RdmaError {
    RdmaError::Verbs {
        call,
        detail: detail.into(),
    }
}

/// An opened device with a protection domain and the port's attributes.
struct Device {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    name: String,
    port: u8,
    gid_index: u8,
    lid: u16,
    mtu: ibv_mtu::Type,
}

// SAFETY: libibverbs contexts and protection domains may be used from any thread (the library
// is thread-safe); this struct only holds the pointers and frees them once in `Drop`.
unsafe impl Send for Device {}
// SAFETY: as for `Send`; no method mutates the pointed-to objects without libibverbs' own
// locking.
unsafe impl Sync for Device {}

impl Device {
    fn open(name: Option<&str>, port: u8, gid_index: u8) -> Result<Self> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed below on every path.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(RdmaError::NoDevice(format!(
                "ibv_get_device_list failed ({}); is an RDMA driver loaded?",
                errno()
            )));
        }
        let devices: Vec<*mut ibv_device> = (0..n.max(0) as usize)
            // SAFETY: the list holds `n` device pointers.
            .map(|i| unsafe { *list.add(i) })
            .collect();
        let names: Vec<String> = devices
            .iter()
            .map(|d| {
                // SAFETY: `d` is a device of the live list; the name is a C string it owns.
                unsafe { CStr::from_ptr(ibv_get_device_name(*d)) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        let chosen = match name {
            None => devices.first().map(|d| (*d, names[0].clone())),
            Some(want) => names
                .iter()
                .position(|n| n == want)
                .map(|i| (devices[i], names[i].clone())),
        };
        let Some((dev, dev_name)) = chosen else {
            // SAFETY: the list came from ibv_get_device_list and is freed once.
            unsafe { ibv_free_device_list(list) };
            return Err(RdmaError::NoDevice(match name {
                None => "libibverbs lists no RDMA devices on this machine".into(),
                Some(w) => format!("device `{w}` not present (devices: {})", names.join(", ")),
            }));
        };
        // SAFETY: `dev` is a device of the live list.
        let ctx = unsafe { ibv_open_device(dev) };
        // SAFETY: freed once; the opened context stays valid after the list is freed.
        unsafe { ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(verbs_err(
                "ibv_open_device",
                format!("{dev_name}: {}", errno()),
            ));
        }
        // SAFETY: `ctx` is an open context.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            let e = errno();
            // SAFETY: closes the context opened above, once.
            unsafe { ibv_close_device(ctx) };
            return Err(verbs_err("ibv_alloc_pd", e));
        }
        let mut d = Self {
            ctx,
            pd,
            name: dev_name,
            port,
            gid_index,
            lid: 0,
            mtu: ibv_mtu::IBV_MTU_1024,
        };
        // SAFETY: all-zero is a valid `ibv_port_attr` (plain integers).
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open and `attr` a valid out-pointer.
        if unsafe { ___ibv_query_port(d.ctx, port, &mut attr) } != 0 {
            return Err(verbs_err(
                "ibv_query_port",
                format!("{} port {port}: {}", d.name, errno()),
            ));
        }
        d.lid = attr.lid;
        d.mtu = attr.active_mtu;
        Ok(d)
    }

    fn gid(&self) -> Result<[u8; 16]> {
        // SAFETY: all-zero is a valid GID.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open and `gid` a valid out-pointer.
        if unsafe { ibv_query_gid(self.ctx, self.port, self.gid_index as c_int, &mut gid) } != 0 {
            return Err(verbs_err("ibv_query_gid", errno()));
        }
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        Ok(unsafe { gid.raw })
    }

    fn register(&self, addr: *mut u8, len: usize) -> Result<Mr> {
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        // SAFETY: `pd` is live; the caller keeps `[addr, addr + len)` mapped for the life of
        // the returned registration (regions outlive their `Mr`s; the host pool outlives the
        // backend, per `register_memory`'s contract).
        let mr = unsafe { ibv_reg_mr(self.pd, addr.cast(), len, access.0 as c_int) };
        if mr.is_null() {
            return Err(verbs_err(
                "ibv_reg_mr",
                format!("{len} bytes at {addr:p}: {}", errno()),
            ));
        }
        Ok(Mr(mr))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: both were created in `open` and are released once, PD before context; every
        // QP and MR on them holds... is dropped first (they are fields declared after the
        // device in their owners, or owned by it).
        unsafe {
            ibv_dealloc_pd(self.pd);
            ibv_close_device(self.ctx);
        }
    }
}

/// A memory registration.
struct Mr(*mut ibv_mr);

// SAFETY: a registration is an immutable descriptor once created; libibverbs allows using it
// from any thread.
unsafe impl Send for Mr {}
// SAFETY: as for `Send`.
unsafe impl Sync for Mr {}

impl Mr {
    fn lkey(&self) -> u32 {
        // SAFETY: the registration is live while `self` is.
        unsafe { (*self.0).lkey }
    }
    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.0).rkey }
    }
    fn range(&self) -> (usize, usize) {
        // SAFETY: as above.
        unsafe { ((*self.0).addr as usize, (*self.0).length) }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `Device::register`, deregistered once.
        unsafe { ibv_dereg_mr(self.0) };
    }
}

/// One RDMA transfer: `len` bytes between local memory (in a registration with `lkey`) and
/// remote memory (`remote`, `rkey`).
#[derive(Copy, Clone, Debug)]
pub struct Transfer {
    /// Local address.
    pub local: u64,
    /// Bytes.
    pub len: usize,
    /// Local key.
    pub lkey: u32,
    /// Remote address.
    pub remote: u64,
    /// Remote key.
    pub rkey: u32,
}

/// An RC queue pair and its completion queue.
struct Qp {
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    psn: u32,
}

// SAFETY: queue pairs may be used from any thread; posting and polling are serialised by the
// owner's mutex.
unsafe impl Send for Qp {}

impl Qp {
    fn create(dev: &Device) -> Result<Self> {
        // SAFETY: `ctx` is open; no completion channel.
        let cq = unsafe {
            ibv_create_cq(
                dev.ctx,
                (MAX_OUTSTANDING * 2) as c_int,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(verbs_err("ibv_create_cq", errno()));
        }
        // SAFETY: all-zero is a valid init attribute (null pointers, zero caps).
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq;
        init.recv_cq = cq;
        init.cap.max_send_wr = MAX_OUTSTANDING as u32;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        // SAFETY: `pd` is live and `init` fully initialised.
        let qp = unsafe { ibv_create_qp(dev.pd, &mut init) };
        if qp.is_null() {
            let e = errno();
            // SAFETY: the CQ created above, destroyed once.
            unsafe { ibv_destroy_cq(cq) };
            return Err(verbs_err("ibv_create_qp", e));
        }
        let psn = (std::process::id() ^ (qp as usize as u32)) & 0x00ff_ffff;
        Ok(Self { cq, qp, psn })
    }

    fn endpoint(&self, dev: &Device) -> Result<VerbsEndpoint> {
        Ok(VerbsEndpoint {
            lid: dev.lid,
            // SAFETY: the QP is live.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            gid: dev.gid()?,
        })
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, what: &str) -> Result<()> {
        // SAFETY: the QP is live and `attr` is initialised for the fields in `mask`.
        let rc = unsafe { ibv_modify_qp(self.qp, attr, mask.0 as c_int) };
        if rc != 0 {
            return Err(verbs_err(
                "ibv_modify_qp",
                format!("{what}: {}", std::io::Error::from_raw_os_error(rc)),
            ));
        }
        Ok(())
    }

    /// Moves the QP through INIT, RTR and RTS towards `remote`.
    fn connect(&self, dev: &Device, remote: &VerbsEndpoint) -> Result<()> {
        use ibv_qp_attr_mask as m;
        // SAFETY: all-zero is a valid attribute block.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = dev.port;
        a.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        self.modify(
            &mut a,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
            "to INIT",
        )?;
        // SAFETY: as above.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = dev.mtu;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 16;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
        a.ah_attr.grh.sgid_index = dev.gid_index;
        a.ah_attr.grh.hop_limit = 1;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = dev.port;
        self.modify(
            &mut a,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
            "to RTR",
        )?;
        // SAFETY: as above.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = self.psn;
        a.max_rd_atomic = 16;
        self.modify(
            &mut a,
            m::IBV_QP_STATE
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
            "to RTS",
        )
    }

    /// Runs `ops` (READ when `read`, else WRITE) and waits for every completion.
    fn run(&self, read: bool, ops: &[Transfer]) -> Result<()> {
        let mut pieces = Vec::new();
        for t in ops {
            let mut off = 0;
            while off < t.len {
                let n = (t.len - off).min(MAX_MSG);
                pieces.push(Transfer {
                    local: t.local + off as u64,
                    len: n,
                    remote: t.remote + off as u64,
                    ..*t
                });
                off += n;
            }
        }
        for group in pieces.chunks(MAX_OUTSTANDING) {
            for (i, t) in group.iter().enumerate() {
                let mut sge = ibv_sge {
                    addr: t.local,
                    length: t.len as u32,
                    lkey: t.lkey,
                };
                // SAFETY: all-zero is a valid work request (null pointers, zero fields).
                let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
                wr.wr_id = i as u64;
                wr.sg_list = &mut sge;
                wr.num_sge = 1;
                wr.opcode = if read {
                    ibv_wr_opcode::IBV_WR_RDMA_READ
                } else {
                    ibv_wr_opcode::IBV_WR_RDMA_WRITE
                };
                wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
                wr.wr.rdma = rdma_t {
                    remote_addr: t.remote,
                    rkey: t.rkey,
                };
                let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
                // SAFETY: the QP is live and connected; `wr` and `sge` live across the call
                // (the provider copies them); the local range lies in a live registration
                // and stays borrowed by the caller until the completions below.
                let rc = unsafe { ibv_post_send(self.qp, &mut wr, &mut bad) };
                if rc != 0 {
                    // Drain what was posted so no completion outlives the caller's buffers.
                    let _ = self.poll(i);
                    return Err(verbs_err(
                        "ibv_post_send",
                        std::io::Error::from_raw_os_error(rc).to_string(),
                    ));
                }
            }
            self.poll(group.len())?;
        }
        Ok(())
    }

    /// Waits for `n` completions; fails on the first bad status (after collecting all `n`).
    fn poll(&self, n: usize) -> Result<()> {
        let mut done = 0;
        let mut failed = None;
        // SAFETY: all-zero is a valid work completion.
        let mut wcs: Vec<ibv_wc> = (0..16).map(|_| unsafe { std::mem::zeroed() }).collect();
        while done < n {
            // SAFETY: the CQ is live and `wcs` has room for 16 entries.
            let got = unsafe { ibv_poll_cq(self.cq, wcs.len() as c_int, wcs.as_mut_ptr()) };
            if got < 0 {
                return Err(verbs_err("ibv_poll_cq", format!("returned {got}")));
            }
            for wc in &wcs[..got as usize] {
                if wc.status != ibv_wc_status::IBV_WC_SUCCESS && failed.is_none() {
                    failed = Some(format!(
                        "work request {} completed with status {} (vendor error {})",
                        wc.wr_id, wc.status, wc.vendor_err
                    ));
                }
            }
            done += got as usize;
            if got == 0 {
                std::thread::yield_now();
            }
        }
        match failed {
            Some(f) => Err(verbs_err("RDMA transfer", f)),
            None => Ok(()),
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created in `create`, destroyed once, QP before its CQ.
        unsafe {
            ibv_destroy_qp(self.qp);
            ibv_destroy_cq(self.cq);
        }
    }
}

/// The server's side: the device, the registered regions, one QP per connected client.
pub struct ServerVerbs {
    // Field order is drop order: QPs and MRs before the device.
    qps: Mutex<HashMap<u64, Qp>>,
    mrs: Vec<Mr>,
    dev: Device,
}

impl std::fmt::Debug for ServerVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerVerbs")
            .field("device", &self.dev.name)
            .field("regions", &self.mrs.len())
            .finish()
    }
}

impl ServerVerbs {
    /// Opens the first device and registers every region (`(start, length)` of the server's
    /// pool mappings, in region-id order) for remote read and write.
    pub fn register(regions: impl IntoIterator<Item = (*mut u8, usize)>) -> Result<Self> {
        let dev = Device::open(None, 1, 0)?;
        let mrs = regions
            .into_iter()
            .map(|(addr, len)| dev.register(addr, len))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            qps: Mutex::new(HashMap::new()),
            mrs,
            dev,
        })
    }

    /// Fills in the regions' addresses and rkeys.
    pub fn publish(&self, descs: &mut [RegionDesc]) {
        for (d, mr) in descs.iter_mut().zip(&self.mrs) {
            d.addr = mr.range().0 as u64;
            d.rkey = mr.rkey();
        }
    }

    /// Creates a QP for connection `conn`, connects it to `remote`, and returns its endpoint.
    pub fn accept(&self, conn: u64, remote: VerbsEndpoint) -> Result<VerbsEndpoint> {
        let qp = Qp::create(&self.dev)?;
        qp.connect(&self.dev, &remote)?;
        let mine = qp.endpoint(&self.dev)?;
        self.qps.lock().insert(conn, qp);
        Ok(mine)
    }

    /// Drops the QP of a closed connection.
    pub fn connection_closed(&self, conn: u64) {
        self.qps.lock().remove(&conn);
    }
}

/// The client's side: the device, its QP to the server, and the registered host region.
pub struct ClientVerbs {
    qp: Mutex<Qp>,
    mr: Mutex<Option<Mr>>,
    regions: Vec<RegionDesc>,
    dev: Device,
}

impl std::fmt::Debug for ClientVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientVerbs")
            .field("device", &self.dev.name)
            .finish()
    }
}

impl ClientVerbs {
    /// Opens `device` (or the first one) on `ib_port` with `gid_index` (the client's
    /// `device`, `ib_port` and `gid_index` options) and creates a QP. Fails with
    /// [`RdmaError::NoDevice`] on a machine without RDMA devices, and if the server offers no
    /// RDMA registration.
    pub fn open(
        device: Option<&str>,
        ib_port: u8,
        gid_index: u8,
        info: &ServerInfo,
    ) -> Result<Self> {
        let dev = Device::open(device, ib_port, gid_index)?;
        if !info.verbs {
            return Err(verbs_err(
                "server handshake",
                "the server offers no RDMA data plane (no device there, or started with \
                 --no-verbs); use transport \"tcp\"",
            ));
        }
        let qp = Qp::create(&dev)?;
        Ok(Self {
            qp: Mutex::new(qp),
            mr: Mutex::new(None),
            regions: info.regions.clone(),
            dev,
        })
    }

    /// This side's QP endpoint, for `VERBS_CONNECT`.
    pub fn endpoint(&self) -> Result<VerbsEndpoint> {
        self.qp.lock().endpoint(&self.dev)
    }

    /// Connects the QP to the server's endpoint.
    pub fn connect(&self, remote: &VerbsEndpoint) -> Result<()> {
        self.qp.lock().connect(&self.dev, remote)
    }

    /// Registers the caller's host region (once).
    pub fn register(&self, region: MemoryRegion) -> Result<()> {
        let mr = self.dev.register(region.addr as *mut u8, region.len)?;
        *self.mr.lock() = Some(mr);
        Ok(())
    }

    /// The local key if every `(addr, len)` lies in the registered region.
    pub fn lkey_for(&self, ranges: impl IntoIterator<Item = (usize, usize)>) -> Option<u32> {
        let mr = self.mr.lock();
        let mr = mr.as_ref()?;
        let (base, len) = mr.range();
        ranges
            .into_iter()
            .all(|(a, n)| a >= base && a.checked_add(n).is_some_and(|e| e <= base + len))
            .then(|| mr.lkey())
    }

    /// The remote address and rkey of `offset` in server region `region`.
    pub fn remote(&self, region: u32, offset: u64) -> Option<(u64, u32)> {
        self.regions
            .iter()
            .find(|r| r.id == region && r.rkey != 0)
            .map(|r| (r.addr + offset, r.rkey))
    }

    /// Runs RDMA READs (remote → local) and waits for them.
    pub fn read(&self, ops: &[Transfer]) -> Result<()> {
        self.qp.lock().run(true, ops)
    }

    /// Runs RDMA WRITEs (local → remote) and waits for them.
    pub fn write(&self, ops: &[Transfer]) -> Result<()> {
        self.qp.lock().run(false, ops)
    }
}
