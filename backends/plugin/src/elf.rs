//! A look at a plugin file's first bytes before the dynamic loader sees it, so a file that is
//! not a loadable shared object is refused with what it is instead (the loader itself says
//! little more than "invalid ELF header").

use std::io::Read;
use std::path::Path;

/// ELF identification and header fields read (e_ident, e_type, e_machine).
const HEAD: usize = 20;
const ET_REL: u16 = 1;
const ET_EXEC: u16 = 2;
const ET_DYN: u16 = 3;
const ELFCLASS32: u8 = 1;
const ELFCLASS64: u8 = 2;
const ELFDATA2LSB: u8 = 1;

/// This build's ELF class, byte order and machine (`e_machine`), where known.
fn host() -> (u8, u8, Option<u16>) {
    let class = if cfg!(target_pointer_width = "64") {
        ELFCLASS64
    } else {
        ELFCLASS32
    };
    let data = if cfg!(target_endian = "little") {
        ELFDATA2LSB
    } else {
        2
    };
    let machine = if cfg!(target_arch = "x86_64") {
        Some(62)
    } else if cfg!(target_arch = "aarch64") {
        Some(183)
    } else if cfg!(target_arch = "x86") {
        Some(3)
    } else if cfg!(target_arch = "riscv64") {
        Some(243)
    } else {
        None
    };
    (class, data, machine)
}

/// `None` if `path` looks like a shared object this process can load (or cannot be read, which
/// `dlopen` then reports); otherwise what the file is instead.
pub fn not_a_shared_object(path: &Path) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.is_dir() {
        return Some("it is a directory".into());
    }
    if !meta.is_file() {
        return Some("it is not a regular file (a device, FIFO or socket)".into());
    }
    let mut head = Vec::with_capacity(HEAD);
    std::fs::File::open(path)
        .ok()?
        .take(HEAD as u64)
        .read_to_end(&mut head)
        .ok()?;
    describe(&head, meta.len())
}

/// What the first bytes `head` of a file of `len` bytes say it is, if not a loadable shared
/// object.
fn describe(head: &[u8], len: u64) -> Option<String> {
    if len == 0 {
        return Some("the file is empty".into());
    }
    if !head.starts_with(b"\x7fELF") {
        let kind = if head.starts_with(b"#!") {
            "a script".to_string()
        } else if head.starts_with(b"!<arch>") {
            "a static library archive (.a)".to_string()
        } else if head
            .iter()
            .all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace())
        {
            format!(
                "a text file (starts with {:?})",
                String::from_utf8_lossy(head)
            )
        } else {
            format!(
                "not an ELF file (first bytes {})",
                head.iter()
                    .take(8)
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            )
        };
        return Some(format!("it is {kind}, {len} bytes"));
    }
    if head.len() < HEAD {
        return Some(format!("a truncated ELF file ({len} bytes)"));
    }
    let (class, data, machine) = host();
    if head[4] != class {
        let bits = if head[4] == ELFCLASS32 { 32 } else { 64 };
        return Some(format!(
            "a {bits}-bit ELF file; this process is not {bits}-bit"
        ));
    }
    if head[5] != data {
        return Some("an ELF file of the other byte order".into());
    }
    let u16_at = |i: usize| {
        let b = [head[i], head[i + 1]];
        if data == ELFDATA2LSB {
            u16::from_le_bytes(b)
        } else {
            u16::from_be_bytes(b)
        }
    };
    match u16_at(16) {
        ET_DYN => {}
        ET_EXEC => return Some("an ELF executable, not a shared object".into()),
        ET_REL => return Some("an ELF object file (.o), not a linked shared object".into()),
        t => return Some(format!("an ELF file of type {t}, not a shared object")),
    }
    match machine {
        Some(m) if u16_at(18) != m => Some(format!(
            "an ELF shared object for another architecture (e_machine {}, this machine {m})",
            u16_at(18)
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elf(ty: u16, machine: u16) -> Vec<u8> {
        let (class, data, _) = host();
        let mut h = vec![0x7f, b'E', b'L', b'F', class, data, 1, 0];
        h.resize(16, 0);
        h.extend_from_slice(&ty.to_le_bytes());
        h.extend_from_slice(&machine.to_le_bytes());
        h
    }

    #[test]
    fn says_what_a_refused_file_is() {
        let d = |h: &[u8]| describe(h, 1000).unwrap_or_default();
        assert!(describe(b"", 0).unwrap().contains("empty"));
        assert!(d(b"#!/bin/sh\necho hi\n").contains("a script"));
        assert!(d(b"hello, I am text\n").contains("a text file"));
        assert!(d(&[0, 1, 2, 3, 0xff, 0xfe, 9, 9]).contains("00010203"));
        assert!(d(b"\x7fELF").contains("truncated") || describe(b"\x7fELF", 4).is_some());
        if let (_, _, Some(m)) = host() {
            assert_eq!(describe(&elf(ET_DYN, m), 1000), None);
            assert!(d(&elf(ET_EXEC, m)).contains("executable"));
            assert!(d(&elf(ET_REL, m)).contains("object file"));
            assert!(d(&elf(ET_DYN, m.wrapping_add(1))).contains("another architecture"));
        }
    }

    #[test]
    fn this_test_binary_is_refused_as_an_executable_or_accepted_as_pie() {
        // A PIE executable is ET_DYN (loadable); a non-PIE one ET_EXEC: either way the check
        // does not misfire on a real ELF file of this machine.
        let exe = std::env::current_exe().unwrap();
        if let Some(why) = not_a_shared_object(&exe) {
            assert!(why.contains("executable"), "{why}");
        }
    }
}
