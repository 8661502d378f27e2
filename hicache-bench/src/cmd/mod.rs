//! One module per subcommand.

pub mod hash;
pub mod plugin;
pub mod transfer;
pub mod tree;
