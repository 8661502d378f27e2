//! One module per subcommand.

pub mod controller;
pub mod hash;
pub mod loadback;
pub mod multiturn;
pub mod plugin;
pub mod redis_benchmark;
pub mod storage;
pub mod storage_check;
pub mod storage_clear;
pub mod storage_common;
pub mod storage_raw;
pub mod storage_write;
pub mod tcp_loopback;
pub mod transfer;
pub mod tree;
