//! Encoding and decoding of message bodies: [`Request`] and [`ReplyFrame`] to and from bytes,
//! one function per message group, over a bounds-checked reader ([`Rd`]).

use bytes::{Buf, BufMut};
use hicache_core::PageKey;

use super::{
    AllocStatus, LookupStatus, MAC_LEN, MAGIC, MAX_ENTRIES, Occupancy, PageReq, ProtocolError,
    REPLY_BIT, ReadStatus, RegionDesc, Reply, ReplyFrame, Request, ServerInfo, ServerStats,
    VERSION, VerbsEndpoint, layout_of, op,
};

/// Longest client name a `HELLO` may carry.
const MAX_CLIENT_NAME: usize = 4096;
/// Longest error message an `ERROR` frame carries (longer ones are cut).
const MAX_ERROR_MESSAGE: usize = 64 << 10;

fn put_keys(b: &mut Vec<u8>, keys: &[PageKey]) {
    b.put_u32_le(keys.len() as u32);
    for k in keys {
        b.put_slice(&k.to_bytes());
    }
}

fn put_pages(b: &mut Vec<u8>, pages: &[PageReq]) {
    b.put_u32_le(pages.len() as u32);
    for p in pages {
        b.put_slice(&p.key.to_bytes());
        b.put_u64_le(p.len);
        b.put_u8(p.layout);
    }
}

fn put_pairs(b: &mut Vec<u8>, pairs: &[(u64, u64)]) {
    b.put_u32_le(pairs.len() as u32);
    for (a, c) in pairs {
        b.put_u64_le(*a);
        b.put_u64_le(*c);
    }
}

fn put_u64s(b: &mut Vec<u8>, v: &[u64]) {
    b.put_u32_le(v.len() as u32);
    for x in v {
        b.put_u64_le(*x);
    }
}

fn put_bools(b: &mut Vec<u8>, v: &[bool]) {
    b.put_u32_le(v.len() as u32);
    for x in v {
        b.put_u8(*x as u8);
    }
}

fn put_mac(b: &mut Vec<u8>, mac: &Option<[u8; MAC_LEN]>) {
    match mac {
        Some(m) => {
            b.put_u8(1);
            b.put_slice(m);
        }
        None => b.put_u8(0),
    }
}

fn put_endpoint(b: &mut Vec<u8>, e: &VerbsEndpoint) {
    b.put_u16_le(e.lid);
    b.put_u32_le(e.qpn);
    b.put_u32_le(e.psn);
    b.put_slice(&e.gid);
}

fn put_list<T>(b: &mut Vec<u8>, v: &[T], put: impl Fn(&mut Vec<u8>, &T)) {
    b.put_u32_le(v.len() as u32);
    for x in v {
        put(b, x);
    }
}

fn put_info(b: &mut Vec<u8>, i: &ServerInfo) {
    b.put_u16_le(i.version);
    b.put_u64_le(i.server_id);
    b.put_u64_le(i.pool_bytes);
    b.put_u64_le(i.max_page_bytes);
    b.put_u32_le(i.max_batch);
    b.put_u32_le(i.lease_ms);
    b.put_u32_le(i.alloc_ttl_ms);
    b.put_u8(i.verbs as u8);
    put_list(b, &i.regions, |b, r| {
        b.put_u32_le(r.id);
        b.put_u64_le(r.len);
        b.put_u64_le(r.addr);
        b.put_u32_le(r.rkey);
    });
}

fn put_read_status(b: &mut Vec<u8>, s: &ReadStatus) {
    match s {
        ReadStatus::Miss => b.put_u8(0),
        ReadStatus::Mismatch => b.put_u8(1),
        ReadStatus::Hit { checksum } => {
            b.put_u8(2);
            b.put_u64_le(*checksum);
        }
    }
}

fn put_lookup_status(b: &mut Vec<u8>, s: &LookupStatus) {
    match s {
        LookupStatus::Miss => b.put_u8(0),
        LookupStatus::Mismatch => b.put_u8(1),
        LookupStatus::Hit {
            region,
            offset,
            checksum,
            lease,
        } => {
            b.put_u8(2);
            b.put_u32_le(*region);
            b.put_u64_le(*offset);
            b.put_u64_le(*checksum);
            b.put_u64_le(*lease);
        }
    }
}

fn put_alloc_status(b: &mut Vec<u8>, s: &AllocStatus) {
    match s {
        AllocStatus::Slot { id, region, offset } => {
            b.put_u8(0);
            b.put_u64_le(*id);
            b.put_u32_le(*region);
            b.put_u64_le(*offset);
        }
        AllocStatus::Present => b.put_u8(1),
        AllocStatus::TooLarge { max } => {
            b.put_u8(2);
            b.put_u64_le(*max);
        }
        AllocStatus::NoSpace => b.put_u8(3),
        AllocStatus::Empty => b.put_u8(4),
    }
}

/// The 13 counters of a [`ServerStats`] after its occupancy, in wire order.
fn stats_counters(s: &ServerStats) -> [u64; 13] {
    [
        s.pool_bytes,
        s.reserved_bytes,
        s.reservations,
        s.leases,
        s.reclaimed_reservations,
        s.expired_leases,
        s.connections,
        s.protocol_errors,
        s.auth_failures,
        s.forbidden,
        s.refused_connections,
        s.timed_out_connections,
        s.open_connections,
    ]
}

fn put_stats(b: &mut Vec<u8>, s: &ServerStats) {
    put_occupancy(b, &s.occupancy);
    for x in stats_counters(s) {
        b.put_u64_le(x);
    }
}

fn put_occupancy(b: &mut Vec<u8>, o: &Occupancy) {
    b.put_u64_le(o.seq);
    b.put_u64_le(o.pages);
    b.put_u64_le(o.bytes);
    b.put_u64_le(o.evicted_pages);
    b.put_u64_le(o.evicted_bytes);
}

impl Request {
    /// The op code.
    pub fn op(&self) -> u8 {
        match self {
            Request::Hello { .. } => op::HELLO,
            Request::Auth { .. } => op::AUTH,
            Request::Exists { .. } => op::EXISTS,
            Request::Read { .. } => op::READ,
            Request::Lookup { .. } => op::LOOKUP,
            Request::Release { .. } => op::RELEASE,
            Request::Allocate { .. } => op::ALLOCATE,
            Request::Write { .. } => op::WRITE,
            Request::Commit { .. } => op::COMMIT,
            Request::Abort { .. } => op::ABORT,
            Request::Drop { .. } => op::DROP,
            Request::Delete { .. } => op::DELETE,
            Request::Stats => op::STATS,
            Request::VerbsConnect { .. } => op::VERBS_CONNECT,
        }
    }

    /// Encodes the body.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            Request::Hello {
                magic,
                version,
                client,
                nonce,
            } => {
                b.put_slice(magic);
                b.put_u16_le(*version);
                b.put_u32_le(client.len() as u32);
                b.put_slice(client.as_bytes());
                b.put_slice(nonce);
            }
            Request::Auth { mac } => put_mac(&mut b, mac),
            Request::Exists { keys } | Request::Delete { keys } => put_keys(&mut b, keys),
            Request::Read { pages } | Request::Lookup { pages } | Request::Allocate { pages } => {
                put_pages(&mut b, pages)
            }
            Request::Release { leases } => put_u64s(&mut b, leases),
            Request::Write { slots } | Request::Commit { slots } => put_pairs(&mut b, slots),
            Request::Abort { slots } => put_u64s(&mut b, slots),
            Request::Drop { pages } => put_list(&mut b, pages, |b, (k, c)| {
                b.put_slice(&k.to_bytes());
                b.put_u64_le(*c);
            }),
            Request::Stats => {}
            Request::VerbsConnect { endpoint } => put_endpoint(&mut b, endpoint),
        }
        b
    }

    /// Decodes a body of op `op`.
    pub fn decode(op: u8, body: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Rd(body);
        let req = match op {
            op::HELLO => r.hello()?,
            op::AUTH => Request::Auth {
                mac: r.opt_mac("client MAC")?,
            },
            op::EXISTS => Request::Exists { keys: r.keys()? },
            op::DELETE => Request::Delete { keys: r.keys()? },
            op::READ => Request::Read { pages: r.pages()? },
            op::LOOKUP => Request::Lookup { pages: r.pages()? },
            op::ALLOCATE => Request::Allocate { pages: r.pages()? },
            op::RELEASE => Request::Release {
                leases: r.u64s("leases")?,
            },
            op::WRITE => Request::Write {
                slots: r.pairs("write slots")?,
            },
            op::COMMIT => Request::Commit {
                slots: r.pairs("commit slots")?,
            },
            op::ABORT => Request::Abort {
                slots: r.u64s("abort slots")?,
            },
            op::DROP => Request::Drop {
                pages: r.list("drop list", |r| Ok((r.key()?, r.u64("checksum")?)))?,
            },
            op::STATS => Request::Stats,
            op::VERBS_CONNECT => Request::VerbsConnect {
                endpoint: r.endpoint()?,
            },
            other => return Err(ProtocolError::UnknownOp(other)),
        };
        r.finish()?;
        Ok(req)
    }
}

impl Reply {
    /// The reply op (request op with [`REPLY_BIT`]).
    pub fn op(&self) -> u8 {
        REPLY_BIT
            | match self {
                Reply::Hello { .. } => op::HELLO,
                Reply::Auth { .. } => op::AUTH,
                Reply::Exists { .. } => op::EXISTS,
                Reply::Read(_) => op::READ,
                Reply::Lookup(_) => op::LOOKUP,
                Reply::Release { .. } => op::RELEASE,
                Reply::Allocate(_) => op::ALLOCATE,
                Reply::Write(_) => op::WRITE,
                Reply::Commit(_) => op::COMMIT,
                Reply::Abort { .. } => op::ABORT,
                Reply::Drop { .. } => op::DROP,
                Reply::Delete { .. } => op::DELETE,
                Reply::Stats(_) => op::STATS,
                Reply::VerbsConnect(_) => op::VERBS_CONNECT,
            }
    }

    /// Appends the reply's body (after the occupancy every reply starts with).
    fn encode_into(&self, b: &mut Vec<u8>) {
        match self {
            Reply::Hello { nonce, auth } => {
                b.put_slice(nonce);
                b.put_u8(*auth as u8);
            }
            Reply::Auth { info, proof } => {
                put_mac(b, proof);
                put_info(b, info);
            }
            Reply::Exists { run } => b.put_u32_le(*run),
            Reply::Read(v) => put_list(b, v, put_read_status),
            Reply::Lookup(v) => put_list(b, v, put_lookup_status),
            Reply::Allocate(v) => put_list(b, v, put_alloc_status),
            Reply::Write(v) | Reply::Commit(v) => put_bools(b, v),
            Reply::Release { released: n }
            | Reply::Abort { n }
            | Reply::Drop { n }
            | Reply::Delete { n } => b.put_u32_le(*n),
            Reply::Stats(s) => put_stats(b, s),
            Reply::VerbsConnect(e) => put_endpoint(b, e),
        }
    }

    /// Decodes the reply of request op `op` (the reply bit already cleared).
    fn decode_from(op: u8, r: &mut Rd<'_>) -> Result<Self, ProtocolError> {
        Ok(match op {
            op::HELLO => Reply::Hello {
                nonce: r.array("server nonce")?,
                auth: r.u8("auth flag")? != 0,
            },
            op::AUTH => Reply::Auth {
                proof: r.opt_mac("server proof")?,
                info: r.info()?,
            },
            op::EXISTS => Reply::Exists { run: r.u32("run")? },
            op::READ => Reply::Read(r.list("read statuses", Rd::read_status)?),
            op::LOOKUP => Reply::Lookup(r.list("lookup statuses", Rd::lookup_status)?),
            op::ALLOCATE => Reply::Allocate(r.list("allocate statuses", Rd::alloc_status)?),
            op::WRITE => Reply::Write(r.bools("write statuses")?),
            op::COMMIT => Reply::Commit(r.bools("commit statuses")?),
            op::RELEASE => Reply::Release {
                released: r.u32("released")?,
            },
            op::ABORT => Reply::Abort { n: r.u32("n")? },
            op::DROP => Reply::Drop { n: r.u32("n")? },
            op::DELETE => Reply::Delete { n: r.u32("n")? },
            op::STATS => Reply::Stats(r.stats()?),
            op::VERBS_CONNECT => Reply::VerbsConnect(r.endpoint()?),
            _ => return Err(ProtocolError::UnknownOp(op | REPLY_BIT)),
        })
    }
}

impl ReplyFrame {
    /// The op code of the frame.
    pub fn op(&self) -> u8 {
        match self {
            ReplyFrame::Ok(_, r) => r.op(),
            ReplyFrame::Error { .. } => op::ERROR,
        }
    }

    /// Encodes the body.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            ReplyFrame::Error { code, message } => {
                b.put_u16_le(*code);
                let m = &message.as_bytes()[..message.len().min(MAX_ERROR_MESSAGE)];
                b.put_u32_le(m.len() as u32);
                b.put_slice(m);
            }
            ReplyFrame::Ok(occ, reply) => {
                put_occupancy(&mut b, occ);
                reply.encode_into(&mut b);
            }
        }
        b
    }

    /// Decodes a reply frame of op `op`.
    pub fn decode(op: u8, body: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Rd(body);
        let frame = if op == op::ERROR {
            let code = r.u16("error code")?;
            let n = r.u32("error message length")? as usize;
            let message = String::from_utf8_lossy(r.bytes(n, "error message")?).into_owned();
            ReplyFrame::Error { code, message }
        } else if op & REPLY_BIT == 0 {
            return Err(ProtocolError::UnknownOp(op));
        } else {
            let occ = r.occupancy()?;
            ReplyFrame::Ok(occ, Reply::decode_from(op & !REPLY_BIT, &mut r)?)
        };
        r.finish()?;
        Ok(frame)
    }
}

/// A bounds-checked reader over a body.
struct Rd<'a>(&'a [u8]);

impl<'a> Rd<'a> {
    fn need(&self, n: usize, what: &'static str) -> Result<(), ProtocolError> {
        if self.0.remaining() < n {
            Err(ProtocolError::Truncated(what))
        } else {
            Ok(())
        }
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, ProtocolError> {
        self.need(1, what)?;
        Ok(self.0.get_u8())
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, ProtocolError> {
        self.need(2, what)?;
        Ok(self.0.get_u16_le())
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, ProtocolError> {
        self.need(4, what)?;
        Ok(self.0.get_u32_le())
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, ProtocolError> {
        self.need(8, what)?;
        Ok(self.0.get_u64_le())
    }
    fn bytes(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], ProtocolError> {
        self.need(n, what)?;
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], ProtocolError> {
        Ok(self.bytes(N, what)?.try_into().expect("N bytes"))
    }
    fn count(&mut self, what: &'static str) -> Result<usize, ProtocolError> {
        let n = self.u32(what)? as usize;
        if n > MAX_ENTRIES {
            return Err(ProtocolError::TooLarge {
                what,
                len: n as u64,
                max: MAX_ENTRIES as u64,
            });
        }
        Ok(n)
    }
    fn key(&mut self) -> Result<PageKey, ProtocolError> {
        Ok(PageKey::from_bytes(&self.array("page key")?))
    }
    fn keys(&mut self) -> Result<Vec<PageKey>, ProtocolError> {
        let n = self.count("key list")?;
        (0..n).map(|_| self.key()).collect()
    }
    fn pages(&mut self) -> Result<Vec<PageReq>, ProtocolError> {
        let n = self.count("page list")?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let key = self.key()?;
            let len = self.u64("page length")?;
            let layout = self.u8("layout tag")?;
            if layout_of(layout).is_none() {
                return Err(ProtocolError::Invalid {
                    what: "layout tag",
                    value: layout as u64,
                });
            }
            v.push(PageReq { key, len, layout });
        }
        Ok(v)
    }
    fn pairs(&mut self, what: &'static str) -> Result<Vec<(u64, u64)>, ProtocolError> {
        let n = self.count(what)?;
        (0..n)
            .map(|_| Ok((self.u64(what)?, self.u64(what)?)))
            .collect()
    }
    fn u64s(&mut self, what: &'static str) -> Result<Vec<u64>, ProtocolError> {
        let n = self.count(what)?;
        (0..n).map(|_| self.u64(what)).collect()
    }
    fn bools(&mut self, what: &'static str) -> Result<Vec<bool>, ProtocolError> {
        let n = self.count(what)?;
        (0..n)
            .map(|_| match self.u8(what)? {
                0 => Ok(false),
                1 => Ok(true),
                x => Err(ProtocolError::Invalid {
                    what,
                    value: x as u64,
                }),
            })
            .collect()
    }
    fn opt_mac(&mut self, what: &'static str) -> Result<Option<[u8; MAC_LEN]>, ProtocolError> {
        match self.u8(what)? {
            0 => Ok(None),
            1 => Ok(Some(self.array(what)?)),
            x => Err(ProtocolError::Invalid {
                what,
                value: x as u64,
            }),
        }
    }
    fn endpoint(&mut self) -> Result<VerbsEndpoint, ProtocolError> {
        Ok(VerbsEndpoint {
            lid: self.u16("lid")?,
            qpn: self.u32("qpn")?,
            psn: self.u32("psn")?,
            gid: self.array("gid")?,
        })
    }
    fn occupancy(&mut self) -> Result<Occupancy, ProtocolError> {
        Ok(Occupancy {
            seq: self.u64("occupancy")?,
            pages: self.u64("occupancy")?,
            bytes: self.u64("occupancy")?,
            evicted_pages: self.u64("occupancy")?,
            evicted_bytes: self.u64("occupancy")?,
        })
    }
    fn list<T>(
        &mut self,
        what: &'static str,
        mut item: impl FnMut(&mut Self) -> Result<T, ProtocolError>,
    ) -> Result<Vec<T>, ProtocolError> {
        let n = self.count(what)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(item(self)?);
        }
        Ok(v)
    }
    fn hello(&mut self) -> Result<Request, ProtocolError> {
        let magic: [u8; 8] = self.array("magic")?;
        if magic != MAGIC {
            return Err(ProtocolError::BadMagic(magic.to_vec()));
        }
        let version = self.u16("version")?;
        if version != VERSION {
            return Err(ProtocolError::Version {
                got: version,
                want: VERSION,
            });
        }
        let n = self.u32("client name length")? as usize;
        if n > MAX_CLIENT_NAME {
            return Err(ProtocolError::TooLarge {
                what: "client name",
                len: n as u64,
                max: MAX_CLIENT_NAME as u64,
            });
        }
        let client = String::from_utf8_lossy(self.bytes(n, "client name")?).into_owned();
        Ok(Request::Hello {
            magic,
            version,
            client,
            nonce: self.array("client nonce")?,
        })
    }
    fn info(&mut self) -> Result<ServerInfo, ProtocolError> {
        Ok(ServerInfo {
            version: self.u16("version")?,
            server_id: self.u64("server id")?,
            pool_bytes: self.u64("pool bytes")?,
            max_page_bytes: self.u64("max page bytes")?,
            max_batch: self.u32("max batch")?,
            lease_ms: self.u32("lease ms")?,
            alloc_ttl_ms: self.u32("alloc ttl ms")?,
            verbs: self.u8("verbs flag")? != 0,
            regions: self.list("regions", |r| {
                Ok(RegionDesc {
                    id: r.u32("region id")?,
                    len: r.u64("region len")?,
                    addr: r.u64("region addr")?,
                    rkey: r.u32("region rkey")?,
                })
            })?,
        })
    }
    fn invalid<T>(what: &'static str, tag: u8) -> Result<T, ProtocolError> {
        Err(ProtocolError::Invalid {
            what,
            value: tag as u64,
        })
    }
    fn read_status(&mut self) -> Result<ReadStatus, ProtocolError> {
        Ok(match self.u8("read status")? {
            0 => ReadStatus::Miss,
            1 => ReadStatus::Mismatch,
            2 => ReadStatus::Hit {
                checksum: self.u64("checksum")?,
            },
            x => return Self::invalid("read status", x),
        })
    }
    fn lookup_status(&mut self) -> Result<LookupStatus, ProtocolError> {
        Ok(match self.u8("lookup status")? {
            0 => LookupStatus::Miss,
            1 => LookupStatus::Mismatch,
            2 => LookupStatus::Hit {
                region: self.u32("region")?,
                offset: self.u64("offset")?,
                checksum: self.u64("checksum")?,
                lease: self.u64("lease")?,
            },
            x => return Self::invalid("lookup status", x),
        })
    }
    fn alloc_status(&mut self) -> Result<AllocStatus, ProtocolError> {
        Ok(match self.u8("allocate status")? {
            0 => AllocStatus::Slot {
                id: self.u64("slot id")?,
                region: self.u32("region")?,
                offset: self.u64("offset")?,
            },
            1 => AllocStatus::Present,
            2 => AllocStatus::TooLarge {
                max: self.u64("max")?,
            },
            3 => AllocStatus::NoSpace,
            4 => AllocStatus::Empty,
            x => return Self::invalid("allocate status", x),
        })
    }
    fn stats(&mut self) -> Result<ServerStats, ProtocolError> {
        let occupancy = self.occupancy()?;
        let mut x = [0u64; 13];
        for v in &mut x {
            *v = self.u64("stats counter")?;
        }
        Ok(ServerStats {
            occupancy,
            pool_bytes: x[0],
            reserved_bytes: x[1],
            reservations: x[2],
            leases: x[3],
            reclaimed_reservations: x[4],
            expired_leases: x[5],
            connections: x[6],
            protocol_errors: x[7],
            auth_failures: x[8],
            forbidden: x[9],
            refused_connections: x[10],
            timed_out_connections: x[11],
            open_connections: x[12],
        })
    }
    fn finish(self) -> Result<(), ProtocolError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ProtocolError::Trailing(self.0.len()))
        }
    }
}
