//! One module per subcommand.

pub mod controller;
pub mod fleet;
pub mod index;
pub mod index_churn;
pub mod index_gen;
pub mod loadback;
pub mod multiturn;
pub mod plugin;
pub mod redis_benchmark;
pub mod storage;
pub mod storage_raw;
pub mod tcp_loopback;
pub mod transfer;
pub mod tree;
