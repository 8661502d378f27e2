//! Streams and events of the emulated driver.
//!
//! Ordering, as the driver documents it:
//! 1. Work on one stream runs in order; streams run concurrently (one worker thread each).
//! 2. The legacy NULL stream is deliberately delayed as far as the driver allows: its work is
//!    held until something synchronises with it (`cuCtxSynchronize`, `cuStreamSynchronize`
//!    of it, a synchronous device-to-host copy, `cuMemFree`, an event recorded on it being
//!    waited for, work queued on a blocking stream).
//! 3. The legacy NULL stream synchronises with every blocking stream (one created without
//!    `CU_STREAM_NON_BLOCKING`): work queued on a blocking stream waits for the NULL stream's
//!    earlier work (queuing it first runs the NULL stream's held work), and work queued on the
//!    NULL stream waits for the earlier work of every blocking stream. Non-blocking streams
//!    (our engine's) are not ordered with the NULL stream at all.
//! 4. Events are generation counters: a record bumps `recorded` and queues the bump of
//!    `completed`; a wait captures the generation current at the call.

use std::sync::mpsc;
use std::sync::{Arc, Weak};

use parking_lot::{Condvar, Mutex};

/// One queued piece of work; `Err` is a fault (sticky on its stream, like a GPU's).
pub type Op = Box<dyn FnOnce() -> Result<(), String> + Send>;

#[derive(Default)]
struct Progress {
    queued: u64,
    done: u64,
    fault: Option<String>,
}

/// A stream's count of queued and finished work, shared with its worker thread.
type Shared = Arc<(Mutex<Progress>, Condvar)>;

/// A stream's [`Shared`] progress, held weakly.
type WeakShared = Weak<(Mutex<Progress>, Condvar)>;

/// A stream: a worker thread running its queue in order, or the held NULL stream.
pub struct Stream {
    tx: Mutex<Option<mpsc::Sender<Op>>>,
    held: Mutex<Vec<Op>>,
    is_null: bool,
    progress: Shared,
    /// For a blocking stream: the legacy NULL stream its work waits for (rule 3).
    legacy: Option<Arc<Stream>>,
    /// For the NULL stream: the progress of every blocking stream, whose earlier work its own
    /// work waits for (rule 3); weak, so that finished streams drop out.
    blocking: Mutex<Vec<WeakShared>>,
}

impl Stream {
    /// A new non-blocking worker stream (`CU_STREAM_NON_BLOCKING`): not ordered with the
    /// legacy NULL stream.
    pub fn spawn() -> Arc<Self> {
        Arc::new(Self::start(None))
    }

    /// A new blocking worker stream (default flags), ordered with the legacy NULL stream
    /// `null` both ways (rule 3).
    pub fn spawn_blocking(null: &Arc<Stream>) -> Arc<Self> {
        let s = Self::start(Some(null.clone()));
        null.blocking.lock().push(Arc::downgrade(&s.progress));
        Arc::new(s)
    }

    /// Starts the worker thread of a stream.
    fn start(legacy: Option<Arc<Stream>>) -> Self {
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
        Self {
            tx: Mutex::new(Some(tx)),
            held: Mutex::new(Vec::new()),
            is_null: false,
            progress,
            legacy,
            blocking: Mutex::new(Vec::new()),
        }
    }

    /// The legacy NULL stream (held; see the module docs).
    pub fn null() -> Arc<Self> {
        Arc::new(Self {
            tx: Mutex::new(None),
            held: Mutex::new(Vec::new()),
            is_null: true,
            progress: Arc::default(),
            legacy: None,
            blocking: Mutex::new(Vec::new()),
        })
    }

    /// Queues `op`, after the NULL stream's earlier work on a blocking stream and after every
    /// blocking stream's earlier work on the NULL stream (rule 3).
    pub fn push(&self, op: Op) {
        if self.is_null {
            let wait = self.blocking_work_wait();
            let mut held = self.held.lock();
            held.extend(wait);
            held.push(op);
            return;
        }
        if let Some(null) = &self.legacy {
            null.flush_held();
        }
        self.progress.0.lock().queued += 1;
        if let Some(tx) = self.tx.lock().as_ref() {
            let _ = tx.send(op);
        }
    }

    /// For the NULL stream: work that waits until every blocking stream ran what it has queued
    /// now; `None` when they all have.
    fn blocking_work_wait(&self) -> Option<Op> {
        let mut streams = self.blocking.lock();
        streams.retain(|p| p.strong_count() > 0);
        let pending: Vec<(Shared, u64)> = streams
            .iter()
            .filter_map(Weak::upgrade)
            .filter_map(|p| {
                let queued = {
                    let g = p.0.lock();
                    (g.done < g.queued).then_some(g.queued)
                };
                queued.map(|q| (p, q))
            })
            .collect();
        if pending.is_empty() {
            return None;
        }
        Some(Box::new(move || {
            for (p, target) in pending {
                let (m, cv) = &*p;
                let mut g = m.lock();
                while g.done < target {
                    cv.wait(&mut g);
                }
            }
            Ok(())
        }))
    }

    /// Runs the NULL stream's held work now, on the calling thread.
    /// The queue stays locked until the work ran, so that work another thread queues on a
    /// blocking stream meanwhile waits for it (rule 3).
    fn flush_held(&self) {
        let mut held = self.held.lock();
        for op in held.drain(..) {
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
