//! Streams and events of the emulated driver.
//!
//! Ordering, as the driver documents it:
//! 1. Work on one stream runs in order; streams run concurrently (one worker thread each).
//! 2. The legacy NULL stream is deliberately delayed as far as the driver allows: its work is
//!    held until something synchronises with it (`cuCtxSynchronize`, `cuStreamSynchronize`
//!    of it, a synchronous device-to-host copy, `cuMemFree`, an event recorded on it being
//!    waited for). Our engine's streams are non-blocking, so nothing else orders them after it.
//! 3. Events are generation counters: a record bumps `recorded` and queues the bump of
//!    `completed`; a wait captures the generation current at the call.

use std::sync::Arc;
use std::sync::mpsc;

use parking_lot::{Condvar, Mutex};

/// One queued piece of work; `Err` is a fault (sticky on its stream, like a GPU's).
pub type Op = Box<dyn FnOnce() -> Result<(), String> + Send>;

#[derive(Default)]
struct Progress {
    queued: u64,
    done: u64,
    fault: Option<String>,
}

/// A stream: a worker thread running its queue in order, or the held NULL stream.
pub struct Stream {
    tx: Mutex<Option<mpsc::Sender<Op>>>,
    held: Mutex<Vec<Op>>,
    is_null: bool,
    progress: Arc<(Mutex<Progress>, Condvar)>,
}

impl Stream {
    /// A new worker stream.
    pub fn spawn() -> Arc<Self> {
        let (tx, rx) = mpsc::channel::<Op>();
        let progress: Arc<(Mutex<Progress>, Condvar)> = Arc::default();
        let p = progress.clone();
        std::thread::Builder::new()
            .name("cuda-emu-stream".into())
            .spawn(move || {
                for op in rx {
                    let faulted = p.0.lock().fault.is_some();
                    let r = if faulted { Ok(()) } else { op() };
                    let mut g = p.0.lock();
                    if let Err(e) = r {
                        g.fault.get_or_insert(e);
                    }
                    g.done += 1;
                    p.1.notify_all();
                }
            })
            .expect("spawning a stream worker thread");
        Arc::new(Self {
            tx: Mutex::new(Some(tx)),
            held: Mutex::new(Vec::new()),
            is_null: false,
            progress,
        })
    }

    /// The legacy NULL stream (held; see the module docs).
    pub fn null() -> Arc<Self> {
        Arc::new(Self {
            tx: Mutex::new(None),
            held: Mutex::new(Vec::new()),
            is_null: true,
            progress: Arc::default(),
        })
    }

    /// Queues `op`.
    pub fn push(&self, op: Op) {
        if self.is_null {
            self.held.lock().push(op);
            return;
        }
        self.progress.0.lock().queued += 1;
        if let Some(tx) = self.tx.lock().as_ref() {
            let _ = tx.send(op);
        }
    }

    /// Runs the NULL stream's held work now, on the calling thread.
    fn flush_held(&self) {
        let ops: Vec<Op> = std::mem::take(&mut *self.held.lock());
        for op in ops {
            if let Err(e) = op() {
                self.progress.0.lock().fault.get_or_insert(e);
            }
        }
    }

    /// Waits until everything queued so far ran; returns the stream's fault, if any.
    pub fn synchronize(&self) -> Result<(), String> {
        if self.is_null {
            self.flush_held();
        }
        let (m, cv) = &*self.progress;
        let mut g = m.lock();
        let target = g.queued;
        while g.done < target {
            cv.wait(&mut g);
        }
        g.fault.clone().map_or(Ok(()), Err)
    }

    /// Whether everything queued so far ran.
    pub fn is_idle(&self) -> bool {
        let g = self.progress.0.lock();
        g.done >= g.queued && (!self.is_null || self.held.lock().is_empty())
    }

    /// Stops the worker after its queued work (`cuStreamDestroy` returns at once; the work
    /// still completes).
    pub fn close(&self) {
        self.tx.lock().take();
    }
}

#[derive(Default)]
struct Gen {
    recorded: u64,
    completed: u64,
}

/// An event: generation counters.
#[derive(Default)]
pub struct Event {
    state: Arc<(Mutex<Gen>, Condvar)>,
    /// The NULL stream holds the latest record, so waiting must flush it first.
    on_null: Mutex<bool>,
}

impl Event {
    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &Stream) {
        let generation = {
            let mut g = self.state.0.lock();
            g.recorded += 1;
            g.recorded
        };
        *self.on_null.lock() = stream.is_null;
        let s = self.state.clone();
        stream.push(Box::new(move || {
            let mut g = s.0.lock();
            g.completed = g.completed.max(generation);
            s.1.notify_all();
            Ok(())
        }));
    }

    /// Whether the latest record completed.
    pub fn is_done(&self) -> bool {
        let g = self.state.0.lock();
        g.completed >= g.recorded
    }

    /// Whether the latest record is held on the NULL stream.
    pub fn recorded_on_null(&self) -> bool {
        *self.on_null.lock()
    }

    /// Blocks until the record current at the call completed.
    pub fn synchronize(&self) {
        let (m, cv) = &*self.state;
        let mut g = m.lock();
        let target = g.recorded;
        while g.completed < target {
            cv.wait(&mut g);
        }
    }

    /// Work that holds a stream until the record current now completes.
    pub fn wait_op(&self) -> Op {
        let s = self.state.clone();
        let target = s.0.lock().recorded;
        Box::new(move || {
            let (m, cv) = &*s;
            let mut g = m.lock();
            while g.completed < target {
                cv.wait(&mut g);
            }
            Ok(())
        })
    }
}
