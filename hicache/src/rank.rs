//! Agreement between tensor-parallel ranks.
//!
//! Every rank runs its own scheduler, tree and pools. The trees must keep the same *shape* (host
//! slot indices may differ), so every count that drives a tree mutation — how many write acks to
//! finish, how many pages a prefetch brought, whether a prefetch may terminate — is agreed once
//! per tick through [`RankGroup::exchange`]: one fixed-shape all-reduce of a small vector whose
//! first part is reduced with `min` and second part with `max`.
//!
//! Rules (what keeps ranks in lock-step):
//! 1. Every rank calls `exchange` the same number of times, in the same order, with the same
//!    shape. The implementations check this (sequence number and shape travel with every
//!    message) and fail every rank with [`RankError::Diverged`] instead of hanging or silently
//!    mixing values (SGLang's gloo "data size doesn't match" aborts came from per-rank shapes).
//! 2. A collective is never called inside a loop whose trip count is rank-dependent (SGLang
//!    issue #30760); the controller gathers all per-tick counts first, then exchanges once.
//! 3. A peer that does not answer within the group's timeout is an error naming the peer, not an
//!    endless wait.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use thiserror::Error;

/// Why a collective failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RankError {
    /// A socket operation failed while talking to `peer`.
    #[error("rank {rank}: I/O with rank {peer} failed during {during}: {source}")]
    Io {
        /// This rank.
        rank: usize,
        /// The peer rank (0 is the hub).
        peer: usize,
        /// What was being done.
        during: &'static str,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// Ranks called collectives in different orders or with different shapes.
    #[error("rank {rank}: ranks diverged: {detail}")]
    Diverged {
        /// This rank.
        rank: usize,
        /// What differed.
        detail: String,
    },
    /// The group was configured inconsistently (bad rank, size, duplicate rank at connect).
    #[error("rank group setup: {0}")]
    Setup(String),
}

/// A group of ranks that agree on per-tick counts.
pub trait RankGroup: Send + Sync {
    /// This rank's index in `0..size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn size(&self) -> usize;

    /// One all-reduce round: on return every rank holds the element-wise minimum of all ranks'
    /// `min` vectors and the element-wise maximum of their `max` vectors. Shapes must agree.
    fn exchange(&self, min: &mut [u64], max: &mut [u64]) -> Result<(), RankError>;

    /// Waits until every rank has reached the same barrier.
    fn barrier(&self) -> Result<(), RankError> {
        self.exchange(&mut [], &mut [])
    }

    /// Whether [`exchange`](Self::exchange) always leaves both vectors as they are (a group
    /// of one that does not alter values): callers may then skip encoding the per-tick
    /// values. `false` unless a group says otherwise, so a group that holds values back
    /// (even of one rank) is always asked.
    fn is_identity(&self) -> bool {
        false
    }
}

/// The group of one: every collective is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleRank;

impl RankGroup for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn exchange(&self, _min: &mut [u64], _max: &mut [u64]) -> Result<(), RankError> {
        Ok(())
    }
    fn is_identity(&self) -> bool {
        true
    }
}

const HELLO_MAGIC: u32 = 0x4843_5247; // "HCRG"
const STATUS_OK: u32 = 0;
const STATUS_DIVERGED: u32 = 1;
/// Largest vector one exchange may carry (the per-tick exchange is a handful of counters).
pub const MAX_EXCHANGE_LEN: usize = 4096;

/// A rank group over TCP, star-shaped: rank 0 is the hub, every other rank holds one connection
/// to it. One exchange = each non-hub rank sends `(seq, shape, values)`, the hub checks that
/// every sequence number and shape equals its own, reduces, and sends the result (or a
/// divergence status) back. Two message latencies per tick; fine for the few counters a tick
/// needs and for the handful of ranks of one node.
pub struct TcpRankGroup {
    rank: usize,
    size: usize,
    timeout: Duration,
    state: Mutex<TcpState>,
}

struct Conn {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

struct TcpState {
    seq: u64,
    /// For the hub: connections to ranks 1..size (index = rank - 1). For others: one, to the hub.
    conns: Vec<Conn>,
}

impl std::fmt::Debug for TcpRankGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpRankGroup")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

fn conn(stream: TcpStream, timeout: Duration) -> std::io::Result<Conn> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    Ok(Conn {
        reader: BufReader::new(stream.try_clone()?),
        writer: BufWriter::new(stream),
    })
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

impl TcpRankGroup {
    /// Joins a group of `size` ranks whose hub (rank 0) listens on `hub`. Rank 0 binds and
    /// waits for the others; the others connect (retrying until `timeout`). Every later
    /// collective also fails after `timeout` without progress.
    pub fn connect(
        rank: usize,
        size: usize,
        hub: SocketAddr,
        timeout: Duration,
    ) -> Result<Self, RankError> {
        if size == 0 || rank >= size {
            return Err(RankError::Setup(format!(
                "rank {rank} is not below group size {size}"
            )));
        }
        let io = |peer, during| {
            move |source| RankError::Io {
                rank,
                peer,
                during,
                source,
            }
        };
        let conns = if rank == 0 {
            Self::accept_all(size, hub, timeout)?
        } else {
            let deadline = Instant::now() + timeout;
            let stream = loop {
                match TcpStream::connect_timeout(&hub, timeout) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(rank, error = %e, "hub not up yet; retrying");
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(io(0, "connect")(e)),
                }
            };
            let mut c = conn(stream, timeout).map_err(io(0, "connect"))?;
            let mut hello = Vec::with_capacity(12);
            hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
            hello.extend_from_slice(&(rank as u32).to_le_bytes());
            hello.extend_from_slice(&(size as u32).to_le_bytes());
            c.writer.write_all(&hello).map_err(io(0, "hello"))?;
            c.writer.flush().map_err(io(0, "hello"))?;
            let ack = read_u32(&mut c.reader).map_err(io(0, "hello"))?;
            if ack != STATUS_OK {
                return Err(RankError::Setup(format!(
                    "hub refused rank {rank} of {size} (duplicate rank or size mismatch)"
                )));
            }
            vec![c]
        };
        Ok(Self {
            rank,
            size,
            timeout,
            state: Mutex::new(TcpState { seq: 0, conns }),
        })
    }

    fn accept_all(size: usize, hub: SocketAddr, timeout: Duration) -> Result<Vec<Conn>, RankError> {
        let io = |during| {
            move |source| RankError::Io {
                rank: 0,
                peer: 0,
                during,
                source,
            }
        };
        let listener = TcpListener::bind(hub).map_err(io("bind"))?;
        listener.set_nonblocking(true).map_err(io("bind"))?;
        let deadline = Instant::now() + timeout;
        let mut slots: Vec<Option<Conn>> = (1..size).map(|_| None).collect();
        let mut joined = 0;
        while joined < size - 1 {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).map_err(io("accept"))?;
                    let mut c = conn(stream, timeout).map_err(io("accept"))?;
                    let magic = read_u32(&mut c.reader).map_err(io("hello"))?;
                    let r = read_u32(&mut c.reader).map_err(io("hello"))? as usize;
                    let s = read_u32(&mut c.reader).map_err(io("hello"))? as usize;
                    let ok = magic == HELLO_MAGIC
                        && s == size
                        && (1..size).contains(&r)
                        && slots[r - 1].is_none();
                    let status = if ok { STATUS_OK } else { STATUS_DIVERGED };
                    c.writer
                        .write_all(&status.to_le_bytes())
                        .and_then(|_| c.writer.flush())
                        .map_err(io("hello"))?;
                    if ok {
                        slots[r - 1] = Some(c);
                        joined += 1;
                    } else {
                        tracing::warn!(claimed_rank = r, claimed_size = s, "refused a rank");
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(RankError::Setup(format!(
                            "only {joined} of {} ranks joined the hub at {hub} within {timeout:?}",
                            size - 1
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(io("accept")(e)),
            }
        }
        Ok(slots.into_iter().map(|c| c.expect("all joined")).collect())
    }

    /// The timeout of every collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

fn write_frame(
    w: &mut impl Write,
    status: u32,
    seq: u64,
    min: &[u64],
    max: &[u64],
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(20 + 8 * (min.len() + max.len()));
    buf.extend_from_slice(&status.to_le_bytes());
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(&(min.len() as u32).to_le_bytes());
    buf.extend_from_slice(&(max.len() as u32).to_le_bytes());
    for v in min.iter().chain(max) {
        buf.extend_from_slice(&v.to_le_bytes());
    }
    w.write_all(&buf)?;
    w.flush()
}

struct Frame {
    status: u32,
    seq: u64,
    min: Vec<u64>,
    max: Vec<u64>,
}

fn read_frame(r: &mut impl Read) -> std::io::Result<Frame> {
    let status = read_u32(r)?;
    let seq = read_u64(r)?;
    let nmin = read_u32(r)? as usize;
    let nmax = read_u32(r)? as usize;
    if nmin + nmax > MAX_EXCHANGE_LEN {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "exchange of {} values exceeds {MAX_EXCHANGE_LEN}",
                nmin + nmax
            ),
        ));
    }
    let mut vals = Vec::with_capacity(nmin + nmax);
    for _ in 0..nmin + nmax {
        vals.push(read_u64(r)?);
    }
    let max = vals.split_off(nmin);
    Ok(Frame {
        status,
        seq,
        min: vals,
        max,
    })
}

impl RankGroup for TcpRankGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&self, min: &mut [u64], max: &mut [u64]) -> Result<(), RankError> {
        if min.len() + max.len() > MAX_EXCHANGE_LEN {
            return Err(RankError::Setup(format!(
                "exchange of {} values exceeds {MAX_EXCHANGE_LEN}",
                min.len() + max.len()
            )));
        }
        let rank = self.rank;
        let mut st = self.state.lock();
        st.seq += 1;
        let seq = st.seq;
        let io = |peer, during| {
            move |source| RankError::Io {
                rank,
                peer,
                during,
                source,
            }
        };
        if rank == 0 {
            let mut diverged: Option<String> = None;
            for (i, c) in st.conns.iter_mut().enumerate() {
                let f = read_frame(&mut c.reader).map_err(io(i + 1, "exchange receive"))?;
                if f.status != STATUS_OK || f.seq != seq {
                    diverged.get_or_insert(format!(
                        "rank {} is at collective #{} but rank 0 at #{seq}",
                        i + 1,
                        f.seq
                    ));
                } else if f.min.len() != min.len() || f.max.len() != max.len() {
                    diverged.get_or_insert(format!(
                        "collective #{seq}: rank {} sent shape ({}, {}) but rank 0 ({}, {})",
                        i + 1,
                        f.min.len(),
                        f.max.len(),
                        min.len(),
                        max.len()
                    ));
                } else if diverged.is_none() {
                    min.iter_mut()
                        .zip(&f.min)
                        .for_each(|(a, b)| *a = (*a).min(*b));
                    max.iter_mut()
                        .zip(&f.max)
                        .for_each(|(a, b)| *a = (*a).max(*b));
                }
            }
            let status = if diverged.is_some() {
                STATUS_DIVERGED
            } else {
                STATUS_OK
            };
            for (i, c) in st.conns.iter_mut().enumerate() {
                write_frame(&mut c.writer, status, seq, min, max)
                    .map_err(io(i + 1, "exchange reply"))?;
            }
            match diverged {
                Some(detail) => Err(RankError::Diverged { rank, detail }),
                None => Ok(()),
            }
        } else {
            let c = &mut st.conns[0];
            write_frame(&mut c.writer, STATUS_OK, seq, min, max).map_err(io(0, "exchange send"))?;
            let f = read_frame(&mut c.reader).map_err(io(0, "exchange receive"))?;
            if f.status != STATUS_OK {
                return Err(RankError::Diverged {
                    rank,
                    detail: format!("the hub reported divergence at collective #{seq}"),
                });
            }
            if f.seq != seq || f.min.len() != min.len() || f.max.len() != max.len() {
                return Err(RankError::Diverged {
                    rank,
                    detail: format!("reply #{} does not match collective #{seq}", f.seq),
                });
            }
            min.copy_from_slice(&f.min);
            max.copy_from_slice(&f.max);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn free_addr() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }

    fn group(size: usize) -> Vec<TcpRankGroup> {
        let addr = free_addr();
        let handles: Vec<_> = (0..size)
            .map(|r| {
                std::thread::spawn(move || {
                    TcpRankGroup::connect(r, size, addr, Duration::from_secs(10)).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn single_rank_is_identity() {
        let mut a = [3, 4];
        let mut b = [5];
        SingleRank.exchange(&mut a, &mut b).unwrap();
        assert_eq!((a, b), ([3, 4], [5]));
        SingleRank.barrier().unwrap();
    }

    #[test]
    fn four_ranks_reduce_min_and_max() {
        let groups: Vec<Arc<TcpRankGroup>> = group(4).into_iter().map(Arc::new).collect();
        for round in 0..20u64 {
            let handles: Vec<_> = groups
                .iter()
                .cloned()
                .map(|g| {
                    std::thread::spawn(move || {
                        let r = g.rank() as u64;
                        let mut min = [10 + r + round, 100 - r];
                        let mut max = [r * round];
                        g.exchange(&mut min, &mut max).unwrap();
                        (min, max)
                    })
                })
                .collect();
            for h in handles {
                let (min, max) = h.join().unwrap();
                assert_eq!(min, [10 + round, 97]);
                assert_eq!(max, [3 * round]);
            }
        }
    }

    #[test]
    fn shape_mismatch_fails_every_rank() {
        let groups: Vec<Arc<TcpRankGroup>> = group(3).into_iter().map(Arc::new).collect();
        let handles: Vec<_> = groups
            .iter()
            .cloned()
            .map(|g| {
                std::thread::spawn(move || {
                    let mut min = vec![1; if g.rank() == 2 { 3 } else { 2 }];
                    g.exchange(&mut min, &mut []).map(|_| ())
                })
            })
            .collect();
        for h in handles {
            let err = h.join().unwrap().unwrap_err();
            assert!(matches!(err, RankError::Diverged { .. }), "{err}");
        }
    }

    #[test]
    fn bad_setup_is_an_error() {
        assert!(matches!(
            TcpRankGroup::connect(3, 2, free_addr(), Duration::from_millis(50)),
            Err(RankError::Setup(_))
        ));
        // A hub whose peers never come.
        let err = TcpRankGroup::connect(0, 2, free_addr(), Duration::from_millis(100)).unwrap_err();
        assert!(err.to_string().contains("joined"), "{err}");
    }

    #[test]
    fn a_silent_peer_times_out_with_a_named_error() {
        let addr = free_addr();
        let h = std::thread::spawn(move || {
            TcpRankGroup::connect(0, 2, addr, Duration::from_millis(300)).unwrap()
        });
        let peer = TcpRankGroup::connect(1, 2, addr, Duration::from_millis(300)).unwrap();
        let hub = h.join().unwrap();
        // Only the hub enters the collective: it must fail, naming rank 1.
        let err = hub.exchange(&mut [1], &mut []).unwrap_err();
        assert!(err.to_string().contains("rank 1"), "{err}");
        drop(peer);
    }
}
