//! The thin async driver: one task per registered stream carries a [`Transport`]'s events into
//! the [`Service`] (whose stream state machine decides) and runs the replays it asks for; one
//! task sweeps the shared stores and ticks every stream's clock.
//!
//! Invariants:
//! 1. The service lock is held only for one step of one stream (decode and apply one batch),
//!    never across an await.
//! 2. A stream's task owns its subscription and its replays; unregistering aborts it, and with
//!    it every socket it opened.
//! 3. Replays run in tasks of their own; their items reach the stream's task through a bounded
//!    channel, tagged with the request id (a late answer to an old request is ignored).

use crate::registry::Registration;
use crate::service::{Service, ServiceError};
use crate::stream::Input;
use crate::transport::{ReplayItem, SubEvent, Transport};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// How often every stream's clock ticks (replay timeouts, dead instances).
pub const TICK: Duration = Duration::from_millis(50);

/// The service, shared by the driver's tasks and the HTTP server.
pub struct Hub<T: Transport> {
    svc: Arc<Mutex<Service>>,
    transport: Arc<T>,
    start: Instant,
    tasks: Mutex<HashMap<String, JoinHandle<()>>>,
}

impl<T: Transport> std::fmt::Debug for Hub<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("streams", &self.tasks.lock().len())
            .finish()
    }
}

impl<T: Transport> Hub<T> {
    /// A hub over `svc` (which may hold streams restored from a snapshot: call
    /// [`start_all`](Self::start_all)).
    pub fn new(svc: Service, transport: T) -> Arc<Self> {
        Arc::new(Self {
            svc: Arc::new(Mutex::new(svc)),
            transport: Arc::new(transport),
            start: Instant::now(),
            tasks: Mutex::new(HashMap::new()),
        })
    }

    /// The service clock: milliseconds since the hub started.
    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// The service.
    pub fn service(&self) -> &Arc<Mutex<Service>> {
        &self.svc
    }

    /// Starts a task for every stream of the service that has none, and the sweeper.
    pub fn start_all(self: &Arc<Self>) {
        let ids = self.svc.lock().stream_ids();
        for id in ids {
            self.spawn_stream(id);
        }
        let hub = Arc::clone(self);
        let period = (self.svc.lock().config().store_ttl / 8).max(Duration::from_millis(100));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let now = hub.now_ms();
                hub.svc.lock().sweep(now);
            }
        });
    }

    /// Registers a stream and starts its task; returns its id and whether it is new.
    pub fn register(self: &Arc<Self>, reg: Registration) -> Result<(String, bool), ServiceError> {
        let now = self.now_ms();
        let (id, new) = self.svc.lock().register(reg, now)?;
        if new {
            if let Some(old) = self.tasks.lock().remove(&id) {
                old.abort();
            }
            self.spawn_stream(id.clone());
        }
        Ok((id, new))
    }

    /// Unregisters an instance (every dp rank) and stops its tasks.
    pub fn unregister(&self, instance: &str) -> Result<Vec<String>, ServiceError> {
        let ids = self.svc.lock().unregister(instance)?;
        let mut tasks = self.tasks.lock();
        for id in &ids {
            if let Some(t) = tasks.remove(id) {
                t.abort();
            }
        }
        Ok(ids)
    }

    fn spawn_stream(self: &Arc<Self>, id: String) {
        let Some(reg) = self.svc.lock().registration(&id).cloned() else {
            return;
        };
        let hub = Arc::clone(self);
        let key = id.clone();
        let task = tokio::spawn(async move { hub.run_stream(id, reg).await });
        if let Some(old) = self.tasks.lock().insert(key, task) {
            old.abort();
        }
    }

    async fn run_stream(self: Arc<Self>, id: String, reg: Registration) {
        let (sub_tx, mut sub_rx) = mpsc::channel::<SubEvent>(1024);
        let (rep_tx, mut rep_rx) = mpsc::channel::<(u64, ReplayItem)>(1024);
        let (fail_tx, mut fail_rx) = mpsc::channel::<u64>(16);
        let transport = Arc::clone(&self.transport);
        let (endpoint, topic) = (reg.endpoint.clone(), reg.topic.clone().unwrap_or_default());
        let sub = tokio::spawn(async move { transport.subscribe(endpoint, topic, sub_tx).await });
        let _guard = AbortOnDrop(sub);
        let mut replays: Vec<AbortOnDrop> = Vec::new();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let input = tokio::select! {
                ev = sub_rx.recv() => match ev {
                    Some(SubEvent::Connected) => Input::Connected,
                    Some(SubEvent::Disconnected) => Input::Disconnected,
                    Some(SubEvent::Batch { seq, payload }) => Input::Live { seq, payload },
                    Some(SubEvent::Garbage) => {
                        tracing::warn!(id, "a message that is not a KV-event batch was dropped");
                        self.svc.lock().metrics.bad_payloads.inc();
                        continue;
                    }
                    None => return,
                },
                item = rep_rx.recv() => match item {
                    Some((rid, ReplayItem::Batch { seq, payload })) => Input::ReplayBatch { id: rid, seq, payload },
                    Some((rid, ReplayItem::End)) => Input::ReplayEnd { id: rid },
                    None => return,
                },
                rid = fail_rx.recv() => match rid {
                    Some(rid) => Input::ReplayFailed { id: rid },
                    None => return,
                },
                _ = tick.tick() => Input::Tick,
            };
            let now = self.now_ms();
            let wanted = self.svc.lock().step(&id, input, now);
            for (rid, start) in wanted {
                let Some(endpoint) = reg.replay_endpoint.clone() else {
                    continue;
                };
                tracing::debug!(id, start, "replay requested");
                let transport = Arc::clone(&self.transport);
                let (rep_tx, fail_tx) = (rep_tx.clone(), fail_tx.clone());
                let timeout = self.svc.lock().config().replay_timeout;
                replays.retain(|r| !r.0.is_finished());
                replays.push(AbortOnDrop(tokio::spawn(async move {
                    let (tx, mut rx) = mpsc::channel(256);
                    let forward = async {
                        while let Some(item) = rx.recv().await {
                            if rep_tx.send((rid, item)).await.is_err() {
                                break;
                            }
                        }
                    };
                    let run = transport.replay(endpoint, start, tx);
                    let both = async { tokio::join!(run, forward).0 };
                    match tokio::time::timeout(timeout, both).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::warn!("replay failed: {e}");
                            let _ = fail_tx.send(rid).await;
                        }
                        Err(_) => {
                            let _ = fail_tx.send(rid).await;
                        }
                    }
                })));
            }
        }
    }
}

/// Aborts a task when dropped (invariant 2).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
