//! The reference of the `rdma` backend's storage bench: raw TCP loopback throughput of the
//! same bytes, one plain blocking socket between two threads of this process (a writer
//! sending page after page, a reader draining into one page-sized buffer). It is TCP over
//! loopback, not RDMA: it bounds what the backend's TCP data plane can do on this machine.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use crate::error::{BenchError, Result};

/// Seconds to move `pages` pages of `page_bytes` (cycling through the pages of `src`) over
/// one loopback TCP connection, from the first byte written until the reader has every byte.
pub fn secs(src: &[u8], page_bytes: usize, pages: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(BenchError::io("tcp loopback bind"))?;
    let addr = listener
        .local_addr()
        .map_err(BenchError::io("tcp loopback address"))?;
    let total = page_bytes as u64 * pages as u64;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; page_bytes.min(8 << 20)];
        let mut left = total;
        while left > 0 {
            let want = (buf.len() as u64).min(left) as usize;
            let n = s.read(&mut buf[..want])?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "loopback writer closed early",
                ));
            }
            left -= n as u64;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr).map_err(BenchError::io("tcp loopback connect"))?;
    s.set_nodelay(true)
        .map_err(BenchError::io("tcp loopback nodelay"))?;
    let per_batch = (src.len() / page_bytes).max(1);
    let t = Instant::now();
    for i in 0..pages {
        s.write_all(&src[(i % per_batch) * page_bytes..][..page_bytes])
            .map_err(BenchError::io("tcp loopback write"))?;
    }
    reader
        .join()
        .map_err(|_| BenchError::CheckFailed("tcp loopback reader panicked".into()))?
        .map_err(BenchError::io("tcp loopback read"))?;
    Ok(t.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use memmap2::MmapMut;

    #[test]
    fn moves_every_byte() {
        let mut src = MmapMut::map_anon(4 * 65536).unwrap();
        src.fill(3);
        let t = secs(&src, 65536, 10).unwrap();
        assert!(t > 0.0);
    }
}
