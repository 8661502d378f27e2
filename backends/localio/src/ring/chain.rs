//! A [`NewFile`](crate::NewFile)'s steps as one chain of linked requests on a direct
//! descriptor (a fixed-file slot the chain's open fills):
//!
//! ```text
//! openat(slot, O_CREAT|O_EXCL) -> fallocate -> writev(offset 0) -> fsync(DATASYNC) -> renameat
//! ```
//!
//! Each request but the last is `IOSQE_IO_LINK`ed to the next, so the kernel starts a step
//! only once the one before it succeeded in full (a short write fails the link) and cancels
//! the rest otherwise: the rename, and so the file's visibility, happens only after every
//! byte was written (and synced). After the last completion the driver closes the slot.

use std::io;

use io_uring::{IoUring, opcode, squeue, types};

use super::Completion;
use super::thread::user_data;
use crate::newfile::{Chain, Step};

/// Whether the kernel runs every request a chain takes.
pub(super) fn supported(ring: &IoUring) -> bool {
    let mut probe = io_uring::Probe::new();
    if ring.submitter().register_probe(&mut probe).is_err() {
        return false;
    }
    [
        opcode::OpenAt::CODE,
        opcode::Fallocate::CODE,
        opcode::Writev::CODE,
        opcode::Fsync::CODE,
        opcode::RenameAt::CODE,
        opcode::Close::CODE,
    ]
    .into_iter()
    .all(|c| probe.is_supported(c))
}

/// A chain in the ring: its requests' results as they complete.
pub(super) struct ChainFlight {
    pub(super) chain: Chain,
    /// Its direct-descriptor slot.
    pub(super) slot: u32,
    /// Each step's result, once completed.
    res: Vec<Option<i32>>,
    /// Steps not yet completed.
    pub(super) left: usize,
}

impl ChainFlight {
    pub(super) fn new(chain: Chain) -> Self {
        let n = chain.steps.len();
        Self {
            chain,
            slot: 0,
            res: vec![None; n],
            left: n,
        }
    }

    /// The linked requests of flight `id`, in order.
    pub(super) fn entries(&self, id: usize) -> Vec<squeue::Entry> {
        let c = &self.chain;
        let file = types::Fixed(self.slot);
        let cwd = types::Fd(libc::AT_FDCWD);
        let n = c.steps.len();
        c.steps
            .iter()
            .enumerate()
            .map(|(k, step)| {
                let e = match step {
                    // (No O_CLOEXEC: the kernel refuses it for a direct descriptor, which no
                    // exec can inherit anyway.)
                    Step::Create => opcode::OpenAt::new(cwd, c.tmp.as_ptr())
                        .flags(
                            libc::O_WRONLY
                                | libc::O_CREAT
                                | libc::O_EXCL
                                | if c.direct { libc::O_DIRECT } else { 0 },
                        )
                        .mode(0o666)
                        .file_index(Some(
                            types::DestinationSlot::try_from_slot_target(self.slot)
                                .expect("chain slots lie below the kernel's limit"),
                        ))
                        .build(),
                    Step::Preallocate => opcode::Fallocate::new(file, c.prealloc).build(),
                    Step::Write => opcode::Writev::new(file, c.iov.as_ptr(), c.iov.len() as u32)
                        .offset(0)
                        .build(),
                    Step::Sync => opcode::Fsync::new(file)
                        .flags(types::FsyncFlags::DATASYNC)
                        .build(),
                    Step::Rename => {
                        opcode::RenameAt::new(cwd, c.tmp.as_ptr(), cwd, c.dest.as_ptr()).build()
                    }
                };
                let e = e.user_data(user_data(id, k));
                if k + 1 < n {
                    e.flags(squeue::Flags::IO_LINK)
                } else {
                    e
                }
            })
            .collect()
    }

    /// Records the completion of step `k` with `res`.
    pub(super) fn complete(&mut self, k: usize, res: i32) {
        if let Some(r) = self.res.get_mut(k)
            && r.is_none()
        {
            *r = Some(res);
            self.left -= 1;
        }
    }

    /// Whether its open succeeded (its slot then holds the file).
    pub(super) fn opened(&self) -> bool {
        self.res.first().copied().flatten().is_some_and(|r| r >= 0)
    }

    /// The chain's outcome: `Ok(steps)` when every step succeeded, else the first failure's
    /// error with the number of steps that succeeded before it.
    pub(super) fn outcome(&self) -> Completion {
        let c = &self.chain;
        let bytes: usize = c.iov.iter().map(|v| v.iov_len).sum();
        let mut ok = 0;
        let mut err = None;
        for (k, step) in c.steps.iter().enumerate() {
            match self.res[k] {
                Some(r) if r >= 0 && (*step != Step::Write || r as usize == bytes) => ok += 1,
                Some(r) if r >= 0 => {
                    err = Some(io::Error::new(
                        io::ErrorKind::WriteZero,
                        format!("short write: {r} of {bytes} bytes"),
                    ));
                    break;
                }
                Some(r) => {
                    err = Some(io::Error::from_raw_os_error(-r));
                    break;
                }
                None => {
                    err = Some(io::Error::other("the chain ended before this step"));
                    break;
                }
            }
        }
        Completion {
            tag: c.tag,
            result: match err {
                None => Ok(ok),
                Some(e) => Err(e),
            },
            ok,
        }
    }
}
