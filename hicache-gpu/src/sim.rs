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
//! 5. A launch wakes no thread while the worker is warm, as a GPU's copy engine costs the
//!    launching CPU no thread wake: a worker that ran work less than [`LINGER`] ago naps
//!    ([`NAP`] at a time) and finds new work itself; only a worker idle for longer sleeps until
//!    a push wakes it. A blocking wait on an event ([`SimEvent::wait`], a stream's `wait`,
//!    `synchronize`) rings the stream of the event's latest record, so it never waits out a
//!    nap. Queued work therefore always runs: within a nap of its push, or at once when
//!    someone waits for it.

use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

/// Longest a warm worker leaves new work queued before it looks (semantics 5).
pub const NAP: Duration = Duration::from_micros(50);

/// How long after its last work a worker keeps napping instead of sleeping until woken
/// (semantics 5).
pub const LINGER: Duration = Duration::from_millis(2);

#[derive(Debug, Default)]
struct EventState {
    recorded: u64,
    completed: u64,
    /// The stream of the latest record, rung by a blocking wait (semantics 5).
    stream: Weak<Shared>,
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

    fn mark_recorded(&self, stream: &Arc<Shared>) -> u64 {
        let mut s = self.inner.0.lock();
        s.recorded += 1;
        if !std::ptr::eq(s.stream.as_ptr(), Arc::as_ptr(stream)) {
            s.stream = Arc::downgrade(stream);
        }
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
        let s = self.inner.0.lock();
        if s.completed >= generation {
            return;
        }
        // Semantics 5: the recording stream's worker may be napping; ring it (outside this
        // lock: the worker takes it to complete the event).
        let stream = s.stream.upgrade();
        drop(s);
        if let Some(stream) = stream {
            stream.ring();
        }
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
}

impl Task {
    fn run(self) {
        match self {
            Task::Run(f) => f(),
            Task::Signal(e, g) => e.complete(g),
            Task::Wait(e, g) => e.wait_for(g),
        }
    }
}

/// A stream's queue, shared by the pushing threads and the worker.
#[derive(Default)]
struct Queue {
    /// Tasks not yet taken by the worker, in queue order.
    tasks: Vec<Task>,
    /// No more tasks: the stream is dropped, or the worker exited (a task panicked).
    closed: bool,
    /// The worker sleeps until notified (idle for [`LINGER`]); otherwise it is running or
    /// napping and finds new tasks itself (semantics 5).
    parked: bool,
}

/// The queue and the bell of one stream.
///
/// Invariant: a push onto a `parked` worker notifies it, and a worker only parks with an
/// empty queue, so every queued task is taken within one [`NAP`] of its push.
#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    bell: Condvar,
}

impl Shared {
    /// Queues `task`; wakes the worker only when it sleeps (semantics 5).
    fn push(&self, task: Task) -> Result<()> {
        let mut q = self.queue.lock();
        if q.closed {
            return Err(GpuError::StreamStopped("the worker thread exited".into()));
        }
        q.tasks.push(task);
        self.wake_if_parked(&mut q);
        Ok(())
    }

    /// Moves every task of `tasks` (a closed batch, in queue order) to the queue in one
    /// hand-off; `tasks` keeps its buffer for the next batch.
    fn push_all(&self, tasks: &mut Vec<Task>) -> Result<()> {
        let mut q = self.queue.lock();
        if q.closed {
            tasks.clear();
            return Err(GpuError::StreamStopped("the worker thread exited".into()));
        }
        q.tasks.append(tasks);
        self.wake_if_parked(&mut q);
        Ok(())
    }

    /// Semantics 5: only a sleeping worker is woken.
    fn wake_if_parked(&self, q: &mut Queue) {
        if q.parked {
            q.parked = false;
            self.bell.notify_one();
        }
    }

    /// Wakes a napping or sleeping worker now (someone blocks on its work).
    fn ring(&self) {
        let _q = self.queue.lock();
        self.bell.notify_one();
    }

    /// Takes the queued tasks into `out` (empty), waiting for some: naps while `warm`
    /// (the worker's last work ended less than [`LINGER`] ago), sleeps until notified after.
    /// `false` once the stream is closed and drained.
    fn take(&self, out: &mut Vec<Task>, idle_since: Instant) -> bool {
        let mut q = self.queue.lock();
        loop {
            if !q.tasks.is_empty() {
                std::mem::swap(&mut q.tasks, out);
                return true;
            }
            if q.closed {
                return false;
            }
            if idle_since.elapsed() < LINGER {
                self.bell.wait_for(&mut q, NAP);
            } else {
                q.parked = true;
                self.bell.wait(&mut q);
                q.parked = false;
            }
        }
    }

    /// The worker's loop: runs the queue in order until the stream is closed and drained.
    fn work(self: Arc<Self>) {
        /// Closes the queue when the worker exits, also by a panicking task, so pushes
        /// report it instead of queueing work that never runs.
        struct Exit<'a>(&'a Shared);
        impl Drop for Exit<'_> {
            fn drop(&mut self) {
                self.0.queue.lock().closed = true;
            }
        }
        let _exit = Exit(&self);
        let mut tasks = Vec::new();
        let mut idle_since = Instant::now();
        while self.take(&mut tasks, idle_since) {
            tasks.drain(..).for_each(Task::run);
            idle_since = Instant::now();
        }
    }
}

/// A sim stream: a worker thread running its queue in order.
pub struct SimStream {
    shared: Arc<Shared>,
    /// The open batch (semantics 4). Pushes take this lock and queue under it, so the queue
    /// order is the push order across threads.
    open: Mutex<Batch>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for SimStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStream")
            .field("batching", &self.open.lock().open)
            .finish_non_exhaustive()
    }
}

/// A stream's batch (semantics 4); its buffer is kept from batch to batch.
#[derive(Default)]
struct Batch {
    /// A [`SimStream::batch`] is running: pushes are held here until it closes.
    open: bool,
    /// The held tasks, in queue order (empty while no batch is open).
    tasks: Vec<Task>,
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
        let shared = Arc::new(Shared::default());
        let worker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("hicache-sim-{name}"))
                .spawn(move || shared.work())
                .map_err(|e| GpuError::StreamStopped(format!("cannot start a worker: {e}")))?
        };
        Ok(Self {
            shared,
            open: Mutex::new(Batch::default()),
            worker: Some(worker),
        })
    }

    fn send(&self, task: Task) -> Result<()> {
        self.shared.push(task)
    }

    fn push(&self, task: Task) -> Result<()> {
        let mut batch = self.open.lock();
        if batch.open {
            batch.tasks.push(task);
            Ok(())
        } else {
            self.send(task)
        }
    }

    fn close_batch(&self) -> Result<()> {
        let mut batch = self.open.lock();
        batch.open = false;
        if batch.tasks.is_empty() {
            return Ok(());
        }
        self.shared.push_all(&mut batch.tasks)
    }

    /// Runs `f`; what it queues on this stream reaches the worker as one hand-off when `f`
    /// returns (semantics 4), so the worker thread is woken once, not once per kernel and
    /// event. Inside an open batch (another `batch` call, on any thread) `f` joins it. `f`
    /// must not block on work it queues here.
    pub fn batch<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        {
            let mut batch = self.open.lock();
            if batch.open {
                drop(batch);
                return Ok(f());
            }
            batch.open = true;
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
        let g = event.mark_recorded(&self.shared);
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
        // Closing the queue lets the worker drain it and exit; joining makes the drop wait for
        // queued work, like destroying a CUDA stream after synchronising it.
        self.shared.queue.lock().closed = true;
        self.shared.ring();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::mpsc;

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
    fn queued_work_runs_unasked_whether_the_worker_naps_or_sleeps() {
        let s = SimStream::new("n").unwrap();
        let n = Arc::new(AtomicU32::new(0));
        // Poll only (no blocking wait rings the worker): a warm worker, then one idle for
        // longer than LINGER (asleep until the push wakes it), each finds the work itself.
        for pause in [Duration::ZERO, LINGER * 3] {
            std::thread::sleep(pause);
            let n2 = n.clone();
            s.run(move || {
                n2.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
            let e = SimEvent::new();
            s.record(&e).unwrap();
            let t0 = Instant::now();
            while !e.is_done() {
                assert!(t0.elapsed() < Duration::from_secs(10), "work never ran");
                std::thread::yield_now();
            }
        }
        assert_eq!(n.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_panicking_task_stops_the_stream() {
        let s = SimStream::new("p").unwrap();
        s.run(|| panic!("a kernel fault")).unwrap();
        let t0 = Instant::now();
        while s.run(|| ()).is_ok() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the stream kept queueing"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
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
