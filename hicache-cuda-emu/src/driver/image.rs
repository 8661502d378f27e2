//! Module images handed to `cuModuleLoadData`: what the emulated driver reads from them.
//!
//! - **PTX** (NUL-terminated text): `.entry NAME(` and the declared parameter block
//!   `.param .align 8 .b8 NAME_param_0[112]`.
//! - **cubin** (an ELF file of the NVIDIA CUDA machine): the target SM from `e_flags` (bits
//!   8..16, e.g. 90 for `sm_90`), each kernel's code section `.text.NAME`, and its parameter
//!   block size from the attribute `EIATTR_CBANK_PARAM_SIZE` (0x19, a 16-bit value) in the
//!   section `.nv.info.NAME`.

/// What an image declares about one entry point.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Kernel name.
    pub name: String,
    /// Declared parameter block bytes, when the image says.
    pub param_bytes: Option<usize>,
}

/// A parsed image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Image {
    /// PTX text.
    Ptx(String),
    /// A cubin for `sm`.
    Cubin {
        /// Target SM (major·10 + minor).
        sm: u32,
        /// Entry points with code in the image.
        entries: Vec<Entry>,
    },
}

impl Image {
    /// Whether the image is a cubin.
    pub fn is_cubin(&self) -> bool {
        matches!(self, Image::Cubin { .. })
    }

    /// What the image declares about entry point `name` (`None`: not in the image).
    pub fn entry(&self, name: &str) -> Option<Entry> {
        match self {
            Image::Ptx(ptx) => ptx.contains(&format!(".entry {name}(")).then(|| Entry {
                name: name.to_string(),
                param_bytes: ptx_param_bytes(ptx, name),
            }),
            Image::Cubin { entries, .. } => entries.iter().find(|e| e.name == name).cloned(),
        }
    }
}

/// Parses the declared parameter block size of `entry` from PTX.
fn ptx_param_bytes(ptx: &str, entry: &str) -> Option<usize> {
    let key = format!("{entry}_param_0[");
    let at = ptx.find(&key)? + key.len();
    ptx[at..].split(']').next()?.trim().parse().ok()
}

const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
/// `EM_CUDA`.
const EM_CUDA: u16 = 190;
/// `EIATTR_CBANK_PARAM_SIZE`.
const EIATTR_CBANK_PARAM_SIZE: u8 = 0x19;

/// Reads the image at `image`.
///
/// # Safety
/// `image` must point to a PTX string (NUL-terminated) or a complete ELF file, as
/// `cuModuleLoadData` requires.
pub unsafe fn read(image: *const u8) -> Result<Image, String> {
    // SAFETY: both kinds of image are at least 4 bytes (a PTX string here is far longer; a
    // shorter NUL-terminated one is not an ELF and is read as text below).
    let head = unsafe { std::slice::from_raw_parts(image, 4) };
    if head != ELF_MAGIC {
        // SAFETY: NUL-terminated text per the contract.
        let text = unsafe { std::ffi::CStr::from_ptr(image.cast()) };
        return Ok(Image::Ptx(text.to_string_lossy().into_owned()));
    }
    // SAFETY: an ELF64 header is 64 bytes.
    let header = unsafe { std::slice::from_raw_parts(image, 64) };
    let shoff = u64_at(header, 0x28)? as usize;
    let shentsize = u16_at(header, 0x3a)? as usize;
    let shnum = u16_at(header, 0x3c)? as usize;
    let len = shoff + shentsize * shnum;
    // SAFETY: the section header table ends the file (the ELF layout NVRTC and nvcc write).
    let elf = unsafe { std::slice::from_raw_parts(image, len.max(64)) };
    parse_cubin(elf)
}

/// Parses a cubin held in `elf`.
pub fn parse_cubin(elf: &[u8]) -> Result<Image, String> {
    if elf.get(..4) != Some(ELF_MAGIC) || elf.get(4) != Some(&2) {
        return Err("not a 64-bit ELF image".into());
    }
    let machine = u16_at(elf, 0x12)?;
    if machine != EM_CUDA {
        return Err(format!(
            "ELF machine {machine}, not NVIDIA CUDA ({EM_CUDA})"
        ));
    }
    let flags = u32_at(elf, 0x30)?;
    let sm = (flags >> 8) & 0xff;
    let shoff = u64_at(elf, 0x28)? as usize;
    let shentsize = u16_at(elf, 0x3a)? as usize;
    let shnum = u16_at(elf, 0x3c)? as usize;
    let shstrndx = u16_at(elf, 0x3e)? as usize;
    let section = |i: usize| -> Result<(u32, usize, usize), String> {
        let h = shoff + i * shentsize;
        Ok((
            u32_at(elf, h)?,
            u64_at(elf, h + 0x18)? as usize,
            u64_at(elf, h + 0x20)? as usize,
        ))
    };
    let (_, str_off, str_len) = section(shstrndx)?;
    let strtab = elf
        .get(str_off..str_off + str_len)
        .ok_or("section name table outside the image")?;
    let name_of = |at: u32| -> String {
        let s = strtab.get(at as usize..).unwrap_or_default();
        let end = s.iter().position(|&b| b == 0).unwrap_or(s.len());
        String::from_utf8_lossy(&s[..end]).into_owned()
    };
    let mut code = Vec::new();
    let mut info = Vec::new();
    for i in 0..shnum {
        let (name_at, off, size) = section(i)?;
        let name = name_of(name_at);
        if let Some(k) = name.strip_prefix(".text.") {
            code.push(k.to_string());
        } else if let Some(k) = name.strip_prefix(".nv.info.") {
            let body = elf
                .get(off..off + size)
                .ok_or_else(|| format!("section {name} outside the image"))?;
            info.push((k.to_string(), param_size(body)));
        }
    }
    let entries = code
        .into_iter()
        .map(|name| Entry {
            param_bytes: info.iter().find(|(k, _)| *k == name).and_then(|(_, p)| *p),
            name,
        })
        .collect();
    Ok(Image::Cubin { sm, entries })
}

/// `EIATTR_CBANK_PARAM_SIZE` of one `.nv.info.NAME` section: records of (format, attribute)
/// then a value: format 1 none, 2 one byte, 3 a 16-bit value, 4 a 16-bit size and that many
/// bytes.
fn param_size(mut b: &[u8]) -> Option<usize> {
    while b.len() >= 2 {
        let (format, attr) = (b[0], b[1]);
        let (value, used) = match format {
            1 => (None, 2),
            2 => (None, 4),
            3 => (Some(u16::from_le_bytes([*b.get(2)?, *b.get(3)?])), 4),
            4 => (
                None,
                4 + u16::from_le_bytes([*b.get(2)?, *b.get(3)?]) as usize,
            ),
            _ => return None,
        };
        if attr == EIATTR_CBANK_PARAM_SIZE {
            return value.map(usize::from);
        }
        b = b.get(used..)?;
    }
    None
}

fn u16_at(b: &[u8], at: usize) -> Result<u16, String> {
    b.get(at..at + 2)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
        .ok_or_else(|| format!("ELF image truncated at {at}"))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, String> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
        .ok_or_else(|| format!("ELF image truncated at {at}"))
}

fn u64_at(b: &[u8], at: usize) -> Result<u64, String> {
    b.get(at..at + 8)
        .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
        .ok_or_else(|| format!("ELF image truncated at {at}"))
}
