//! Whether memory a caller registers is memory of this process (`/proc/self/maps`).
//!
//! The fence of [`crate::regions`] is only as good as the regions it is given: a region that
//! covers the whole address space would let every pointer through. So a region is accepted
//! only when every byte of it lies in mappings of this process that are readable and
//! writable at the time it is registered.
//!
//! Invariants:
//! 1. A region is accepted exactly when the mappings listed in `/proc/self/maps` cover
//!    `start .. start + len` without a gap, each with `r` and `w` in its permissions.
//! 2. The answer holds when it is given: memory the caller unmaps or protects later is not
//!    seen (the caller promises to keep registered buffers alive as long as the store).

use crate::error::{BindingError, Result};

/// One line of `/proc/self/maps`: `start..end` and whether it is readable and writable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mapping {
    start: usize,
    end: usize,
    rw: bool,
}

/// Checks `(address, length)` regions (non-null, non-empty, not overflowing: already checked
/// by [`crate::regions::Regions::new`]) against this process's mappings (invariant 1).
pub fn check_mapped(regions: &[(usize, usize)]) -> Result<()> {
    let text = std::fs::read_to_string("/proc/self/maps").map_err(BindingError::Maps)?;
    check_against(&text, regions)
}

/// [`check_mapped`] against the text of a `/proc/<pid>/maps` file.
fn check_against(maps: &str, regions: &[(usize, usize)]) -> Result<()> {
    let mut mappings: Vec<Mapping> = maps.lines().filter_map(parse_line).collect();
    mappings.sort_unstable_by_key(|m| m.start);
    for (index, &(ptr, len)) in regions.iter().enumerate() {
        if let Some(why) = uncovered(&mappings, ptr, ptr.saturating_add(len)) {
            return Err(BindingError::NotMapped {
                index,
                ptr,
                len,
                why,
            });
        }
    }
    Ok(())
}

/// Why `start..end` is not covered by readable and writable mappings, or `None` when it is.
fn uncovered(mappings: &[Mapping], start: usize, end: usize) -> Option<String> {
    let mut at = start;
    while at < end {
        // The last mapping starting at or before `at` is the only one that can hold it.
        let after = mappings.partition_point(|m| m.start <= at);
        let m = match after.checked_sub(1).map(|i| mappings[i]) {
            Some(m) if at < m.end => m,
            _ => return Some(format!("address {at:#x} is not mapped")),
        };
        if !m.rw {
            return Some(format!(
                "address {at:#x} is in the mapping {:#x}..{:#x}, which is not readable and \
                 writable",
                m.start, m.end
            ));
        }
        at = m.end;
    }
    None
}

/// `start-end perms ...` in hex; `None` for a line that is not one.
fn parse_line(line: &str) -> Option<Mapping> {
    let mut words = line.split_whitespace();
    let (start, end) = words.next()?.split_once('-')?;
    let perms = words.next()?.as_bytes();
    Some(Mapping {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        rw: perms.len() >= 2 && perms[0] == b'r' && perms[1] == b'w',
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
00651000-00652000 rw-p 00051000 08:02 173521      /usr/bin/python3
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7f0000100000-7f0000200000 rw-s 00000000 00:05 12   /dev/zero (deleted)
7f0000200000-7f0000300000 ---p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0   [stack]
";

    #[test]
    fn regions_inside_rw_mappings_are_accepted_across_adjacent_ones() {
        assert!(check_against(MAPS, &[(0x7f0000000000, 0x100000)]).is_ok());
        // Two adjacent readable and writable mappings cover a region together.
        assert!(check_against(MAPS, &[(0x7f00000ff000, 0x2000)]).is_ok());
        assert!(check_against(MAPS, &[(0x651000, 0x1000), (0x7ffd00000010, 16)]).is_ok());
    }

    #[test]
    fn unmapped_or_protected_memory_is_refused_naming_the_address() {
        for (region, what) in [
            ((0x1000usize, 16usize), "0x1000 is not mapped"),
            ((0x400000, 16), "not readable and writable"),
            ((0x7f00001ff000, 0x2000), "0x7f0000200000"),
            ((0x7f00000ff000, 1 << 40), "not readable and writable"),
            ((0x652000 - 8, 16), "0x652000 is not mapped"),
            ((1, usize::MAX - 1), "0x1 is not mapped"),
        ] {
            let e = check_against(MAPS, &[(0x7f0000000000, 16), region])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("region 1") && e.contains(what),
                "{region:x?}: {e}"
            );
        }
    }

    #[test]
    fn this_processs_own_heap_is_mapped_and_a_huge_region_is_not() {
        let buf = vec![7u8; 1 << 20];
        assert!(check_mapped(&[(buf.as_ptr() as usize, buf.len())]).is_ok());
        assert!(check_mapped(&[(4096, 1 << 46)]).is_err());
    }
}
