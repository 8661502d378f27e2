//! One module per subcommand.

pub mod hash;
pub mod transfer;
pub mod tree;
