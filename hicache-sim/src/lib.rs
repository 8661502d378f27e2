//! # hicache-sim
//!
//! A simulated serving engine that drives a KV cache through a workload on a simulated clock,
//! so the whole `hicache` stack can be measured (hits, time to first token, bytes moved per
//! tier) on a machine without a GPU, deterministically.
//!
//! - [`workload`] and [`trace`]: the conversations (multi-turn chat, long context, replayed
//!   traces) and the rules that release their requests (arrival process, parallelism).
//! - [`model`] and [`links`]: the compute model (prefill, attention, decode costs of a model
//!   shape on an H100) and the links background copies take (D2H, H2D, L3).
//! - [`cache`]: the contract a cache under test implements ([`CacheUnderTest`]);
//!   [`nocache`] is the baseline without prefix caching.
//! - [`engine`]: the scheduler loop that runs a workload through a cache.
//! - [`setup`], [`adapter`] and [`copy_gate`]: the cache configuration in SGLang's names and
//!   the adapter that runs the real `hicache` controller as the cache under test, with its
//!   background copies held back until they complete in simulated time.
//! - [`hybrid_adapter`]: the same for the hybrid controller (`hicache::HybridCache`) and a
//!   hybrid model of [`model`] (Full-attention KV plus sliding-window KV or Mamba states).
//! - [`fleet`]: a fleet of engines (each its own `hicache::HiCache`) publishing KV events
//!   into a real `hicache_index::Index`, behind a router, on one simulated clock.
//! - [`plan`]: the main job's parameters validated into a runnable [`Plan`].
//! - [`presence`]: the L3 of a run without payload ([`setup::Payload::Counted`]), which
//!   records which pages it holds and no bytes.
#![warn(missing_docs)]

pub mod adapter;
pub mod cache;
pub mod copy_gate;
pub mod engine;
pub mod error;
pub mod fleet;
pub mod hybrid_adapter;
pub mod links;
pub mod model;
pub mod nocache;
pub mod plan;
pub mod poll;
pub mod presence;
pub mod setup;
pub mod trace;
pub mod workload;

pub use cache::{
    Admission, CacheError, CacheResult, CacheStats, CacheUnderTest, ComponentMoves, DeviceSlot,
    HybridMoves, KvEventsState, PrefetchStatus, RequestId, TransferStats,
};
pub use engine::{EngineConfig, RequestRecord, RunResult, Scheduler, Step, StepKind, StepRecord};
pub use error::{Result, SimError};
pub use hybrid_adapter::{HybridAdapter, HybridFactory};
pub use links::{CopyTime, Link, Links};
pub use model::{ComputeModel, HybridModel, LinearAttention, ModelShape};
pub use nocache::NoCache;
pub use plan::{MultiturnArgs, Plan};
pub use setup::{CacheFactory, CacheSetup};
