mod l3_io;
mod l3_keys;
