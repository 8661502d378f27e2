//! The sim device: "device" memory is host memory, a stream is a worker thread that runs its
//! queue in order, an event is a generation counter, and every kernel is replaced by its CPU
//! reference. Completions are genuinely asynchronous (they happen on the worker thread), so
//! the controller's polling and waiting logic is exercised as on a GPU.
//!
//! Semantics mirrored from CUDA:
//! 1. Work queued on one stream runs in queue order; different streams run concurrently.
//! 2. `record(event)` marks the event pending until the stream reaches that point; an event
//!    recorded again moves to the newer point (`is_done` reflects the latest record).
//! 3. `wait(event)` on a stream holds the stream's later work until the event's record that
//!    was latest *at the time of the wait call* completes (a never-recorded event is done).
//! 4. Work queued inside [`SimStream::batch`] reaches the worker as one hand-off when the batch
//!    closes, in queue order (a stream's queue order is push order, batched or not): one
//!    wake-up of the worker per transfer instead of one per kernel and event. Nothing inside a
//!    batch may block on work queued in it (it has not reached the worker yet).
//!
//! A stream's worker stands in for a GPU's copy engine, which takes no CPU time from the
//! thread that launches work on it. On Linux the worker runs in the `SCHED_BATCH` class
//! ([`yield_to_launcher`]): waking it for new work never preempts the launching thread (the
//! scheduler's wake-up preemption skips batch threads), which on a busy machine otherwise
//! lost its core to the worker at every hand-off. The worker still gets its fair share of CPU.

use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use hicache_host::{HostMemory, HugePagePolicy, Populate};

use crate::error::{GpuError, Result};

/// Alignment of sim allocations (at least what cudaMalloc gives, 256).
pub const SIM_ALIGN: usize = 4096;

/// An owned, zeroed sim allocation: an anonymous, populated mapping (huge pages when
/// available), like the host pool, so sim "device" memory behaves like RAM that was touched
/// before (no first-touch faults inside a timed transfer). Without payload
/// ([`Device::sim_without_payload`](crate::Device::sim_without_payload)), populated only
/// where touched: its page copies never touch it.
#[derive(Debug)]
pub struct SimMemory {
    map: HostMemory,
    len: usize,
}

impl SimMemory {
    /// `len` zeroed bytes aligned to [`SIM_ALIGN`], populated now (`payload`) or on touch.
    pub fn new(len: usize, payload: bool) -> Result<Self> {
        // Huge pages only where they can pay off (a 2 MiB mapping per small buffer would not).
        let policy = if len >= 2 << 20 {
            HugePagePolicy::Auto
        } else {
            HugePagePolicy::Off
        };
        let populate = if payload {
            Populate::Now
        } else {
            Populate::OnTouch
        };
        let map = HostMemory::with_population(len.max(1), policy, populate)?;
        Ok(Self { map, len })
    }

    /// Address (the sim's device pointer).
    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether zero bytes were asked for.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Debug, Default)]
struct EventState {
    recorded: u64,
    completed: u64,
}

/// A sim event (see the module semantics).
#[derive(Debug, Clone, Default)]
pub struct SimEvent {
    inner: Arc<(Mutex<EventState>, Condvar)>,
}

impl SimEvent {
    /// A new, never-recorded (hence done) event.
    pub fn new() -> Self {
        Self::default()
    }

    fn mark_recorded(&self) -> u64 {
        let mut s = self.inner.0.lock();
        s.recorded += 1;
        s.recorded
    }

    fn complete(&self, generation: u64) {
        let mut s = self.inner.0.lock();
        if generation > s.completed {
            s.completed = generation;
        }
        self.inner.1.notify_all();
    }

    fn wait_for(&self, generation: u64) {
        let mut s = self.inner.0.lock();
        while s.completed < generation {
            self.inner.1.wait(&mut s);
        }
    }

    /// Whether the latest record has completed.
    pub fn is_done(&self) -> bool {
        let s = self.inner.0.lock();
        s.completed >= s.recorded
    }

    /// Blocks until the latest record (as of this call) has completed.
    pub fn wait(&self) {
        let target = self.inner.0.lock().recorded;
        self.wait_for(target);
    }
}

enum Task {
    Run(Box<dyn FnOnce() + Send>),
    Signal(SimEvent, u64),
    Wait(SimEvent, u64),
    /// The tasks of one [`SimStream::batch`], in queue order.
    Batch(Vec<Task>),
}

impl Task {
    fn run(self) {
        match self {
            Task::Run(f) => f(),
            Task::Signal(e, g) => e.complete(g),
            Task::Wait(e, g) => e.wait_for(g),
            Task::Batch(tasks) => tasks.into_iter().for_each(Task::run),
        }
    }
}

/// Puts the calling thread in the `SCHED_BATCH` class (see the module docs); best effort: a
/// refusal leaves it as it was, which changes timing only.
fn yield_to_launcher() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` is a valid, initialised `sched_param` that outlives the call; pid 0
        // names the calling thread, and lowering one's own class needs no privilege.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
        if rc != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "sim stream worker stays in its scheduling class"
            );
        }
    }
}

/// A sim stream: a worker thread running its queue in order.
pub struct SimStream {
    tx: Option<mpsc::Sender<Task>>,
    /// The open batch's tasks (semantics 4); `None` outside a batch. Pushes take this lock
    /// and send under it, so the queue order is the push order across threads.
    open: Mutex<Option<Vec<Task>>>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for SimStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStream")
            .field("batching", &self.open.lock().is_some())
            .finish_non_exhaustive()
    }
}

/// Closes a batch when dropped (also on unwind), so tasks queued in it are never lost.
struct OpenBatch<'a> {
    stream: &'a SimStream,
}

impl OpenBatch<'_> {
    /// Sends the batch's tasks as one hand-off.
    fn close(self) -> Result<()> {
        let r = self.stream.close_batch();
        std::mem::forget(self);
        r
    }
}

impl Drop for OpenBatch<'_> {
    fn drop(&mut self) {
        // Only on unwind; a stopped worker is reported by the next push.
        let _ = self.stream.close_batch();
    }
}

impl SimStream {
    /// Starts the worker thread.
    pub fn new(name: &str) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Task>();
        let worker = std::thread::Builder::new()
            .name(format!("hicache-sim-{name}"))
            .spawn(move || {
                yield_to_launcher();
                for task in rx {
                    task.run();
                }
            })
            .map_err(|e| GpuError::StreamStopped(format!("cannot start a worker: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            open: Mutex::new(None),
            worker: Some(worker),
        })
    }

    fn send(&self, task: Task) -> Result<()> {
        self.tx
            .as_ref()
            .expect("sender lives until drop")
            .send(task)
            .map_err(|_| GpuError::StreamStopped("the worker thread exited".into()))
    }

    fn push(&self, task: Task) -> Result<()> {
        let mut open = self.open.lock();
        match open.as_mut() {
            Some(batch) => {
                batch.push(task);
                Ok(())
            }
            None => self.send(task),
        }
    }

    fn close_batch(&self) -> Result<()> {
        let mut open = self.open.lock();
        match open.take() {
            Some(tasks) if !tasks.is_empty() => self.send(Task::Batch(tasks)),
            _ => Ok(()),
        }
    }

    /// Runs `f`; what it queues on this stream reaches the worker as one hand-off when `f`
    /// returns (semantics 4), so the worker thread is woken once, not once per kernel and
    /// event. Inside an open batch (another `batch` call, on any thread) `f` joins it. `f`
    /// must not block on work it queues here.
    pub fn batch<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        {
            let mut open = self.open.lock();
            if open.is_some() {
                drop(open);
                return Ok(f());
            }
            *open = Some(Vec::new());
        }
        let batch = OpenBatch { stream: self };
        let r = f();
        batch.close()?;
        Ok(r)
    }

    /// Queues `f` (a "kernel" or "memcpy").
    pub fn run(&self, f: impl FnOnce() + Send + 'static) -> Result<()> {
        self.push(Task::Run(Box::new(f)))
    }

    /// Records `event` at the current end of the queue.
    pub fn record(&self, event: &SimEvent) -> Result<()> {
        let g = event.mark_recorded();
        self.push(Task::Signal(event.clone(), g))
    }

    /// Holds later work until `event`'s latest record (as of now) completes.
    pub fn wait(&self, event: &SimEvent) -> Result<()> {
        let g = event.inner.0.lock().recorded;
        self.push(Task::Wait(event.clone(), g))
    }

    /// Blocks until everything queued so far has run.
    pub fn synchronize(&self) -> Result<()> {
        let e = SimEvent::new();
        self.record(&e)?;
        e.wait();
        Ok(())
    }
}

impl Drop for SimStream {
    fn drop(&mut self) {
        // Closing the channel lets the worker drain the queue and exit; joining makes the drop
        // wait for queued work, like destroying a CUDA stream after synchronising it.
        drop(self.tx.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn streams_run_in_order_and_events_complete() {
        let s = SimStream::new("t").unwrap();
        let gate = SimEvent::new();
        let other = SimStream::new("gate").unwrap();
        let (tx, rx) = mpsc::channel::<()>();
        // `other` blocks until we send, then records `gate`.
        other
            .run(move || {
                rx.recv().unwrap();
            })
            .unwrap();
        other.record(&gate).unwrap();
        s.wait(&gate).unwrap();
        let n = Arc::new(AtomicU32::new(0));
        let n2 = n.clone();
        s.run(move || {
            n2.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        let done = SimEvent::new();
        s.record(&done).unwrap();
        assert!(!done.is_done(), "must wait for the gate");
        assert_eq!(n.load(Ordering::SeqCst), 0);
        tx.send(()).unwrap();
        done.wait();
        assert!(done.is_done());
        assert_eq!(n.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_batch_reaches_the_worker_when_it_closes_in_queue_order() {
        let s = SimStream::new("b").unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let done = SimEvent::new();
        let push = |k: u32| {
            let log = log.clone();
            s.run(move || log.lock().push(k)).unwrap();
        };
        push(0);
        s.synchronize().unwrap();
        let r = s
            .batch(|| {
                push(1);
                // A nested batch joins the open one.
                s.batch(|| push(2)).unwrap();
                s.record(&done).unwrap();
                // Nothing has reached the worker yet (deterministic: not sent).
                assert!(!done.is_done());
                assert_eq!(*log.lock(), [0]);
                7
            })
            .unwrap();
        assert_eq!(r, 7);
        push(3);
        s.synchronize().unwrap();
        assert!(done.is_done());
        assert_eq!(*log.lock(), [0, 1, 2, 3]);
        // An empty batch sends nothing; a stream keeps working after it.
        s.batch(|| ()).unwrap();
        s.synchronize().unwrap();
    }

    #[test]
    fn never_recorded_events_are_done() {
        let e = SimEvent::new();
        assert!(e.is_done());
        e.wait();
        let s = SimStream::new("w").unwrap();
        s.wait(&e).unwrap();
        s.synchronize().unwrap();
    }

    #[test]
    fn memory_is_zeroed_and_aligned() {
        let m = SimMemory::new(1000, true).unwrap();
        assert_eq!(m.addr() % SIM_ALIGN as u64, 0);
        // SAFETY: inside the allocation.
        let s = unsafe { std::slice::from_raw_parts(m.addr() as *const u8, m.len()) };
        assert!(s.iter().all(|&b| b == 0));
    }
}
