//! What this machine has, for bounding configuration values that size memory.
//!
//! A size given in a configuration (a memory backend's capacity, a server's pool, a client's
//! in-flight budget) is checked against the machine's physical memory when the backend is
//! opened: a value no machine of this size can honour is an error naming the field, the value
//! and what the machine has, never an allocation that fails later (or succeeds and starves the
//! engine). Disk sizes are checked by the local-disk backends against their file system.

use crate::error::{Result, StorageError};

/// Physical memory of this machine in bytes (`MemTotal` of `/proc/meminfo`), or `None` where it
/// cannot be read (then nothing is bounded by it).
pub fn memory_total_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_total(&text)
}

fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// Refuses `bytes` for `field` (in `scope`) when it is more than this machine's physical
/// memory: `{scope}: field `{field}` = {bytes}: more than this machine's memory (...)`.
pub fn check_memory_size(scope: &str, field: &str, bytes: u64) -> Result<()> {
    check_against(scope, field, bytes, memory_total_bytes())
}

fn check_against(scope: &str, field: &str, bytes: u64, total: Option<u64>) -> Result<()> {
    match total {
        Some(total) if bytes > total => Err(StorageError::config(
            scope,
            field,
            bytes.to_string(),
            format!(
                "more than this machine's physical memory ({total} bytes, {:.1} GiB); \
                 a size held in memory must fit in it",
                total as f64 / (1u64 << 30) as f64
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_total_is_read_in_bytes() {
        let text = "MemTotal:       24592204 kB\nMemFree:  100 kB\n";
        assert_eq!(parse_mem_total(text), Some(24_592_204 * 1024));
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: lots kB\n"), None);
        assert!(memory_total_bytes().is_some_and(|t| t > 0));
    }

    #[test]
    fn sizes_above_the_memory_are_refused_with_what_the_machine_has() {
        assert!(check_against("backend memory", "capacity", 1 << 30, Some(2 << 30)).is_ok());
        assert!(check_against("backend memory", "capacity", u64::MAX, None).is_ok());
        let e = check_against("backend memory", "capacity", 3 << 30, Some(2 << 30))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`capacity` = 3221225472") && e.contains("2.0 GiB"),
            "{e}"
        );
        assert!(check_memory_size("backend memory", "capacity", u64::MAX).is_err());
    }
}
