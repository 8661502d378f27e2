//! Where the slab layout's requests run: on the io_uring [`Ring`] (registered buffers, fixed
//! files, completions streamed back while later requests are still in flight) or, where
//! io_uring is unavailable or `io_engine: "threads"` asks for it, on the [`Threads`] engine
//! (blocking positioned calls on a few threads: the same requests and outcomes, without the
//! registered fast paths).

use std::collections::VecDeque;
use std::io;

use crate::io::ring::{Pending, Req};
use crate::io::{Driver, Ring, Threads};

/// The engine a slab store was opened on.
#[derive(Debug)]
pub(crate) enum Engine {
    /// io_uring.
    Ring(Ring),
    /// The thread-pool fallback.
    Threads(Threads),
}

/// The outcomes of one batch of requests, in completion order.
pub(crate) enum Submitted {
    /// In flight in the ring (dropping it waits for every request).
    Ring(Pending),
    /// Already run by the threads.
    Done(VecDeque<(usize, io::Result<usize>)>),
}

impl Submitted {
    /// Requests never handed to the ring because its thread had ended (count and reason).
    pub(crate) fn not_submitted(&self) -> Option<&(usize, String)> {
        match self {
            Submitted::Ring(p) => p.not_submitted(),
            Submitted::Done(_) => None,
        }
    }

    /// The next completed request's tag and outcome; `None` when all have been reported.
    pub(crate) fn wait_next(&mut self) -> Option<(usize, io::Result<usize>)> {
        match self {
            Submitted::Ring(p) => p.wait_next(),
            Submitted::Done(q) => q.pop_front(),
        }
    }
}

impl Engine {
    /// Runs `reqs`: handed to the ring (the caller works on while they are in flight), or run
    /// to completion on the threads.
    pub(crate) fn submit(&self, reqs: Vec<Req>) -> Submitted {
        match self {
            Engine::Ring(r) => Submitted::Ring(r.submit(reqs)),
            Engine::Threads(t) => {
                let mut done = VecDeque::with_capacity(reqs.len());
                t.run(reqs, &mut |tag, r| done.push_back((tag, r)));
                Submitted::Done(done)
            }
        }
    }

    /// The ring, when io_uring carries the I/O.
    pub(crate) fn ring(&self) -> Option<&Ring> {
        match self {
            Engine::Ring(r) => Some(r),
            Engine::Threads(_) => None,
        }
    }
}
