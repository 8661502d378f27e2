//! The simulated engine that drives a cache through a workload on a simulated clock: the
//! cache contract ([`cache`]), the model and its costs ([`model`]), the links background copies
//! take ([`links`]), the scheduler loop ([`engine`]) and the baseline without prefix caching
//! ([`nocache`]).

pub mod cache;
pub mod engine;
pub mod links;
pub mod model;
pub mod nocache;

pub use cache::{
    Admission, CacheError, CacheResult, CacheStats, CacheUnderTest, DeviceSlot, PrefetchStatus,
    RequestId, TransferStats,
};
pub use engine::{EngineConfig, RequestRecord, RunResult, StepKind, StepRecord};
pub use links::{CopyTime, Link, Links};
pub use model::{ComputeModel, ModelShape};
pub use nocache::NoCache;
