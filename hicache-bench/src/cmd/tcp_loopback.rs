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
    let (t, received) = transfer(src, page_bytes, pages)?;
    let total = page_bytes as u64 * pages as u64;
    if received.bytes != total || received.mismatches != 0 {
        return Err(BenchError::check_failed(format!(
            "tcp loopback: {} of {total} bytes arrived, {} reads began with a wrong byte",
            received.bytes, received.mismatches
        )));
    }
    Ok(t)
}

/// What the reader of [`transfer`] saw.
#[derive(Debug)]
struct Received {
    /// Bytes read until the writer closed the connection.
    bytes: u64,
    /// Reads whose first byte differs from the byte written at that stream offset (one byte
    /// per read is compared, so the check costs the reference nothing measurable).
    mismatches: u64,
}

/// Moves the pages and returns the seconds taken and what the reader received, reading until
/// the writer closes the connection (so a short or long stream shows in `bytes`).
fn transfer(src: &[u8], page_bytes: usize, pages: usize) -> Result<(f64, Received)> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(BenchError::io("tcp loopback bind"))?;
    let addr = listener
        .local_addr()
        .map_err(BenchError::io("tcp loopback address"))?;
    let per_batch = (src.len() / page_bytes).max(1);
    // The byte written at stream offset `at`.
    let written_at = |at: u64| {
        let page = (at / page_bytes as u64) as usize % per_batch;
        src[page * page_bytes + (at % page_bytes as u64) as usize]
    };
    std::thread::scope(|scope| {
        // Connect first: the connection waits in the listen backlog, so `accept` returns at
        // once and no thread is left blocked if either side fails.
        let mut s = TcpStream::connect(addr).map_err(BenchError::io("tcp loopback connect"))?;
        s.set_nodelay(true)
            .map_err(BenchError::io("tcp loopback nodelay"))?;
        let (mut r, _) = listener
            .accept()
            .map_err(BenchError::io("tcp loopback accept"))?;
        r.set_nodelay(true)
            .map_err(BenchError::io("tcp loopback nodelay"))?;
        let reader = scope.spawn(move || -> std::io::Result<Received> {
            let mut buf = vec![0u8; page_bytes.min(8 << 20)];
            let mut got = Received {
                bytes: 0,
                mismatches: 0,
            };
            loop {
                let n = r.read(&mut buf)?;
                if n == 0 {
                    return Ok(got);
                }
                if buf[0] != written_at(got.bytes) {
                    got.mismatches += 1;
                }
                got.bytes += n as u64;
            }
        });
        let t = Instant::now();
        let written = (0..pages)
            .try_for_each(|i| s.write_all(&src[(i % per_batch) * page_bytes..][..page_bytes]));
        // Dropping the stream closes it: the reader's next read returns 0 (also after a failed
        // write, so the reader always ends).
        drop(s);
        written.map_err(BenchError::io("tcp loopback write"))?;
        let received = reader
            .join()
            .map_err(|_| BenchError::check_failed("tcp loopback reader panicked"))?
            .map_err(BenchError::io("tcp loopback read"))?;
        Ok((t.elapsed().as_secs_f64(), received))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use memmap2::MmapMut;

    #[test]
    fn moves_every_byte() {
        let mut src = MmapMut::map_anon(4 * 65536).unwrap();
        for (i, page) in src.chunks_mut(65536).enumerate() {
            page.fill(i as u8 + 1);
        }
        let (t, received) = transfer(&src, 65536, 10).unwrap();
        assert!(t > 0.0);
        assert_eq!(received.bytes, 10 * 65536, "every byte written was read");
        assert_eq!(
            received.mismatches, 0,
            "the bytes read are the bytes written"
        );
    }
}
