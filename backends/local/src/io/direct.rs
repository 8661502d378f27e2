//! The O_DIRECT probe: whether the file system under a directory takes direct I/O.

use std::io;
use std::path::Path;

use crate::io::buf::{ALIGN, AlignedBuf};
use crate::io::sys;

/// Writes one aligned block with O_DIRECT to a scratch file `direct-probe` in `dir` (removed
/// again); `Ok` if the file system took it. tmpfs and some network file systems refuse.
pub fn probe_direct(dir: &Path) -> io::Result<()> {
    let p = dir.join("direct-probe");
    let r = (|| -> io::Result<()> {
        let f = sys::create_new(&p, true)?;
        let buf = AlignedBuf::zeroed(ALIGN);
        sys::pwritev_all(&f, &[io::IoSlice::new(&buf)], 0)
    })();
    let _ = std::fs::remove_file(&p);
    r
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_disk_directory_takes_direct_io_and_the_probe_cleans_up() {
        // The temp dir may be tmpfs (refuses O_DIRECT): either answer is fine, the scratch
        // file must be gone.
        let dir = tempfile::tempdir().unwrap();
        let _ = super::probe_direct(dir.path());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
