//! # hicache
//!
//! The crate an inference engine depends on.
#![warn(missing_docs)]

pub mod metrics;
pub mod rank;
