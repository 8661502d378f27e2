//! # hicache-index
//!
//! The fleet's KV index: which instance holds each prefix in device memory (L1) or pinned host
//! memory (L2), and which L3 store holds it, so that a router can send a request where its
//! prefix is cheapest to serve.
//!
//! - [`chain`]: the index's own page-hash chain, computed from the tokens a `BlockStored`
//!   event carries (engine-agnostic: a query by tokens needs no engine hash).
//! - [`table`]: the [`Index`] itself: holders (instances and L3 stores), the blocks each holds
//!   per tier, prefix queries answered per instance with every tier cumulative through the
//!   faster ones.
//! - [`ingest`]: applying an engine's KV events (by its own block hashes) to the index.
//! - [`decode`]: `KVEventBatch` payloads (SGLang's, vLLM's, ours) into engine events.
//! - [`stream`]: one event stream's sequence bookkeeping (gaps, replays, restarts, death) as a
//!   pure state machine.
//! - [`registry`], [`service`], [`metrics`]: registered instances, one index per model, shared
//!   stores, queries, counters.
//! - [`transport`], [`driver`], [`http`], [`snapshot`]: the service around them: subscriptions
//!   and replays, the HTTP API, the checksummed snapshot of a `--data-dir`.
//! - [`router`]: the routing policies a gateway links (ours and the peers' documented rules).
//! - [`routing`]: the service's one router per model, over its registered instances, behind
//!   `POST /route`, `/finished` and `/load`.
//! - [`reference`]: a naive model of the same semantics, the oracle of the model tests.
//!
//! Terms: a *block* is one page of tokens, named by its chained [`BlockHash`]; a *holder* is an
//! instance (one dp rank of one engine) or an L3 store; a *holder-block* is one (holder, tier,
//! block) residency, the unit of the index's capacity and accounting.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod chain;
pub mod decode;
pub mod driver;
pub mod error;
pub mod http;
pub mod ingest;
pub mod metrics;
pub mod reference;
pub mod registry;
pub mod router;
pub mod routing;
pub mod service;
pub mod snapshot;
pub mod stream;
pub mod table;
pub mod transport;

pub use chain::{BlockHash, ChainHasher};
pub use error::{IndexError, Result};
pub use ingest::{EngineEvent, IngestCounts, InstanceFeed, tier_of_medium};
pub use table::{Answer, HolderId, HolderKind, Index, IndexStats, QueryMatch, Tier};
