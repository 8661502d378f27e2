//! What this process may hold in memory, for bounding configuration values that size memory.
//!
//! A size given in a configuration (a memory backend's capacity, a server's pool, a client's
//! in-flight budget) is checked when the backend is opened against the memory this process
//! may use: the smallest of the machine's physical memory (`MemTotal`), the memory limit of
//! the process's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`, of its cgroup and every
//! ancestor), and its `RLIMIT_AS` and `RLIMIT_DATA` soft limits. A value above it is an error
//! naming the field, the value and the limit, never an allocation that aborts the process
//! when the store fills (or succeeds and starves the engine). Disk sizes are checked by the
//! local-disk backends against their file system.
//!
//! Invariants:
//! 1. Every limit is read from text the kernel publishes (`/proc/meminfo`, `/proc/self/limits`,
//!    `/proc/self/cgroup`, `/proc/self/mountinfo`, the cgroup files), so the crate stays free
//!    of `unsafe`; a limit that cannot be read, or reads "unlimited", bounds nothing.
//! 2. The check is necessary, not sufficient: it refuses a size no process under these
//!    limits can hold, and does not reserve anything (the engine's own memory shares them).

use std::path::{Path, PathBuf};

use crate::error::{Result, StorageError};

/// Values at or above this are "no limit" (cgroup v1 writes `PAGE_COUNTER_MAX` pages, about
/// 2^63, for an unlimited cgroup).
const UNLIMITED: u64 = 1 << 62;

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

/// The limits on what this process may hold in memory, each `None` where absent or
/// unreadable (invariant 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryLimits {
    /// The machine's physical memory (`MemTotal`).
    pub machine: Option<u64>,
    /// The smallest memory limit of the process's cgroup and its ancestors.
    pub cgroup: Option<u64>,
    /// `RLIMIT_AS`, the soft limit on the address space.
    pub address_space: Option<u64>,
    /// `RLIMIT_DATA`, the soft limit on the data segment (private writable mappings).
    pub data: Option<u64>,
}

impl MemoryLimits {
    /// The limits of this process now.
    pub fn of_this_process() -> Self {
        let (address_space, data) = std::fs::read_to_string("/proc/self/limits")
            .map(|t| parse_proc_limits(&t))
            .unwrap_or_default();
        Self {
            machine: memory_total_bytes(),
            cgroup: this_cgroup_limit(),
            address_space,
            data,
        }
    }

    /// The smallest limit and its name, or `None` when nothing bounds memory.
    pub fn smallest(&self) -> Option<(u64, &'static str)> {
        [
            (self.machine, "the machine's physical memory"),
            (self.cgroup, "the cgroup memory limit"),
            (self.address_space, "RLIMIT_AS (address space)"),
            (self.data, "RLIMIT_DATA (data segment)"),
        ]
        .into_iter()
        .filter_map(|(v, name)| v.map(|v| (v, name)))
        .min_by_key(|&(v, _)| v)
    }
}

/// The memory this process may hold: the smallest of its limits (see [`MemoryLimits`]).
pub fn process_memory_limit() -> Option<u64> {
    MemoryLimits::of_this_process().smallest().map(|(v, _)| v)
}

/// Refuses `bytes` for `field` (in `scope`) when it is more than this process may hold in
/// memory (the smallest of its [`MemoryLimits`]): the error names the field, the value and
/// the limit that bounds it.
pub fn check_memory_size(scope: &str, field: &str, bytes: u64) -> Result<()> {
    check_against(scope, field, bytes, &MemoryLimits::of_this_process())
}

/// [`check_memory_size`] against given limits (tests inject them).
pub fn check_against(scope: &str, field: &str, bytes: u64, limits: &MemoryLimits) -> Result<()> {
    match limits.smallest() {
        Some((limit, which)) if bytes > limit => Err(StorageError::config(
            scope,
            field,
            bytes.to_string(),
            format!(
                "more than this process may hold in memory: {which} is {limit} bytes \
                 ({:.1} GiB), the smallest of the machine's physical memory, the cgroup \
                 memory limit, RLIMIT_AS and RLIMIT_DATA; a size held in memory must fit in it",
                limit as f64 / (1u64 << 30) as f64
            ),
        )),
        _ => Ok(()),
    }
}

/// The soft `Max address space` and `Max data size` of a `/proc/<pid>/limits` text.
fn parse_proc_limits(text: &str) -> (Option<u64>, Option<u64>) {
    let soft = |name: &str| {
        let rest = text.lines().find_map(|l| l.strip_prefix(name))?;
        rest.split_whitespace()
            .next()?
            .parse::<u64>()
            .ok()
            .filter(|&v| v < UNLIMITED)
    };
    (soft("Max address space"), soft("Max data size"))
}

/// The limit of the cgroup this process is in, read from the live system.
fn this_cgroup_limit() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    cgroup_limit(&cgroup, &mountinfo, |p| std::fs::read_to_string(p).ok())
}

/// The smallest memory limit of the process's cgroup and every ancestor up to the
/// hierarchy's mount, v2 (`memory.max`) and v1 (`memory.limit_in_bytes`) alike; `read` reads
/// a file (tests inject one).
fn cgroup_limit(
    cgroup: &str,
    mountinfo: &str,
    read: impl Fn(&Path) -> Option<String>,
) -> Option<u64> {
    let mut best: Option<u64> = None;
    for line in cgroup.lines() {
        // `hierarchy-id:controllers:path`; v2 is `0::path`.
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (v2, file) = if controllers.is_empty() {
            (true, "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (false, "memory.limit_in_bytes")
        } else {
            continue;
        };
        let Some((mount_root, mount_point)) = cgroup_mount(mountinfo, v2) else {
            continue;
        };
        // The cgroup's path relative to the mounted part of its hierarchy.
        let Some(rel) = path
            .strip_prefix(mount_root.trim_end_matches('/'))
            .filter(|r| r.is_empty() || r.starts_with('/'))
        else {
            continue;
        };
        let mut dir = mount_point.clone();
        dir.extend(rel.split('/').filter(|s| !s.is_empty()));
        loop {
            let limit = read(&dir.join(file))
                .and_then(|t| t.trim().parse::<u64>().ok())
                .filter(|&v| v < UNLIMITED);
            if let Some(v) = limit {
                best = Some(best.map_or(v, |b| b.min(v)));
            }
            if dir == mount_point || !dir.pop() {
                break;
            }
        }
    }
    best
}

/// The root (inside the hierarchy) and mount point of the cgroup v2 mount (`v2`), or of the
/// v1 mount carrying the memory controller.
fn cgroup_mount(mountinfo: &str, v2: bool) -> Option<(String, PathBuf)> {
    mountinfo.lines().find_map(|line| {
        // `id parent major:minor root mount-point options [optional...] - fstype source super`
        let (left, right) = line.split_once(" - ")?;
        let left: Vec<&str> = left.split_whitespace().collect();
        let mut right = right.split_whitespace();
        let fstype = right.next()?;
        let _source = right.next();
        let super_opts = right.next().unwrap_or("");
        let ok = if v2 {
            fstype == "cgroup2"
        } else {
            fstype == "cgroup" && super_opts.split(',').any(|o| o == "memory")
        };
        (ok && left.len() >= 5).then(|| (left[3].to_string(), PathBuf::from(left[4])))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn mem_total_is_read_in_bytes() {
        let text = "MemTotal:       24592204 kB\nMemFree:  100 kB\n";
        assert_eq!(parse_mem_total(text), Some(24_592_204 * 1024));
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: lots kB\n"), None);
        assert!(memory_total_bytes().is_some_and(|t| t > 0));
    }

    fn machine(total: u64) -> MemoryLimits {
        MemoryLimits {
            machine: Some(total),
            ..MemoryLimits::default()
        }
    }

    #[test]
    fn sizes_above_the_memory_are_refused_with_what_the_machine_has() {
        assert!(check_against("backend memory", "capacity", 1 << 30, &machine(2 << 30)).is_ok());
        let none = MemoryLimits::default();
        assert!(check_against("backend memory", "capacity", u64::MAX, &none).is_ok());
        let e = check_against("backend memory", "capacity", 3 << 30, &machine(2 << 30))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`capacity` = 3221225472")
                && e.contains("2.0 GiB")
                && e.contains("physical memory"),
            "{e}"
        );
        assert!(check_memory_size("backend memory", "capacity", u64::MAX).is_err());
    }

    #[test]
    fn the_smallest_process_limit_bounds_a_size_and_is_named() {
        // 8 GiB under a 1.5 GiB limit, on a machine of 64 GiB: refused, the limit named.
        for (limits, named) in [
            (
                MemoryLimits {
                    cgroup: Some(3 << 29),
                    ..machine(64 << 30)
                },
                "the cgroup memory limit is 1610612736 bytes",
            ),
            (
                MemoryLimits {
                    address_space: Some(3 << 29),
                    ..machine(64 << 30)
                },
                "RLIMIT_AS (address space) is 1610612736",
            ),
            (
                MemoryLimits {
                    data: Some(3 << 29),
                    address_space: Some(4 << 30),
                    ..machine(64 << 30)
                },
                "RLIMIT_DATA (data segment) is 1610612736",
            ),
        ] {
            let e = check_against("backend memory", "capacity", 8 << 30, &limits)
                .unwrap_err()
                .to_string();
            assert!(e.contains(named) && e.contains("1.5 GiB"), "{e}");
            assert!(check_against("backend memory", "capacity", 1 << 30, &limits).is_ok());
        }
    }

    #[test]
    fn proc_limits_give_the_soft_values_and_unlimited_is_none() {
        let text = "\
Limit                     Soft Limit           Hard Limit           Units
Max data size             1610612736           unlimited            bytes
Max stack size            8388608              unlimited            bytes
Max address space         unlimited            unlimited            bytes
";
        assert_eq!(parse_proc_limits(text), (None, Some(1_610_612_736)));
        assert_eq!(parse_proc_limits(""), (None, None));
    }

    const MOUNTINFO: &str = "\
22 1 0:20 / /proc rw,nosuid - proc proc rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 /kubepods /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw
";

    fn files(entries: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let map: HashMap<PathBuf, String> = entries
            .iter()
            .map(|(p, t)| (PathBuf::from(p), t.to_string()))
            .collect();
        move |p: &Path| map.get(p).cloned()
    }

    #[test]
    fn a_v1_cgroup_limit_is_the_smallest_of_the_cgroup_and_its_ancestors() {
        let cgroup = "4:memory:/jobs/a/b\n3:cpu:/jobs/a/b\n";
        let read = files(&[
            (
                "/sys/fs/cgroup/memory/jobs/a/b/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            (
                "/sys/fs/cgroup/memory/jobs/a/memory.limit_in_bytes",
                "1610612736\n",
            ),
            (
                "/sys/fs/cgroup/memory/jobs/memory.limit_in_bytes",
                "4294967296\n",
            ),
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
        ]);
        assert_eq!(cgroup_limit(cgroup, MOUNTINFO, read), Some(1_610_612_736));
        assert_eq!(cgroup_limit(cgroup, MOUNTINFO, files(&[])), None);
    }

    fn read_all() -> impl Fn(&Path) -> Option<String> {
        |_: &Path| Some("1\n".to_string())
    }

    #[test]
    fn a_v2_cgroup_limit_is_read_below_the_mounted_root() {
        // The v2 hierarchy is mounted from `/kubepods`: the process's path is under it.
        let cgroup = "0::/kubepods/pod1/ctr\n";
        let read = files(&[
            ("/sys/fs/cgroup/unified/pod1/ctr/memory.max", "max\n"),
            ("/sys/fs/cgroup/unified/pod1/memory.max", "2147483648\n"),
            ("/sys/fs/cgroup/unified/memory.max", "1073741824\n"),
            ("/sys/fs/cgroup/memory.max", "1\n"),
        ]);
        assert_eq!(cgroup_limit(cgroup, MOUNTINFO, read), Some(1 << 30));
        // A path outside the mounted root, or no memory controller: nothing is read.
        assert_eq!(cgroup_limit("0::/other\n", MOUNTINFO, files(&[])), None);
        assert_eq!(cgroup_limit("0::/kubepodsx\n", MOUNTINFO, read_all()), None);
        assert_eq!(cgroup_limit("3:cpu:/x\n", MOUNTINFO, files(&[])), None);
    }

    #[test]
    fn this_process_has_a_limit_no_larger_than_the_machine() {
        let l = MemoryLimits::of_this_process();
        let (smallest, _) = l.smallest().expect("MemTotal is readable on Linux");
        assert!(smallest <= l.machine.unwrap());
        assert_eq!(process_memory_limit(), Some(smallest));
    }
}
