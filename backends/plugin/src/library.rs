//! [`PluginLibrary`]: a loaded, checked plugin library.
//!
//! Loading (in this order; the first failure is the error):
//! 1. A path containing `/` must exist ([`PluginError::NotFound`]); a bare file name is left to
//!    the dynamic loader's search path.
//! 2. A file named by path must be an ELF shared object of this machine's class, byte order
//!    and architecture; otherwise it is refused before `dlopen` with what it is instead
//!    ([`PluginError::NotSharedObject`]: empty, text or a script, an executable, an object
//!    file, another architecture …).
//! 3. `dlopen` ([`PluginError::Load`]), then `dlsym` of the entry symbol
//!    ([`PluginError::MissingEntry`]); the entry function returns the vtable (null:
//!    [`PluginError::NullVtable`]).
//! 4. The three header fields are read first: another major version is refused
//!    ([`PluginError::AbiMismatch`]), a `struct_size` below the v1.0 vtable too
//!    ([`PluginError::VtableTooSmall`]). Then `min(struct_size, size_of::<Vtable>())` bytes are
//!    copied into a zeroed host-side vtable: a newer plugin is used through the common prefix,
//!    and fields an older plugin lacks read as absent.
//! 5. Every required function must be non-null, and every function a capability flag promises
//!    too (`HICACHE_CAP_BATCH_CONTEXT` counts only in a vtable of at least the 1.1 size,
//!    `HICACHE_CAP_CLEAR` only in one of at least the 1.2 size); name and version must be
//!    NUL-terminated within 255 bytes
//!    ([`PluginError::InvalidVtable`]).
//!
//! Invariants:
//! 1. **A library is never unloaded.** A loaded plugin lives in a leaked `Box` for the rest of
//!    the process, valid or not (`dlclose` of code that may have started threads or registered
//!    thread-local destructors is undefined behaviour waiting to happen), so every function
//!    pointer, static string and the log context stay valid forever.
//! 2. Loading the same path again returns the same `&'static PluginLibrary`
//!    (no second leak, one log context per library).

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::Library;
use parking_lot::Mutex;

use crate::abi::{self, Vtable, VtableHeader};
use crate::error::PluginError;
use crate::host_log::LogContext;

/// Longest accepted plugin name or version, in bytes.
const MAX_NAME: usize = 255;

/// A loaded plugin library whose vtable passed the checks. Obtained with
/// [`PluginLibrary::load`]; lives for the rest of the process.
pub struct PluginLibrary {
    path: PathBuf,
    vtable: Vtable,
    name: String,
    version: String,
    log: LogContext,
    _lib: Library,
}

impl std::fmt::Debug for PluginLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginLibrary")
            .field("path", &self.path)
            .field("name", &self.name)
            .field("version", &self.version)
            .field("abi", &(self.vtable.abi_major, self.vtable.abi_minor))
            .field("capabilities", &self.vtable.capabilities)
            .finish_non_exhaustive()
    }
}

// SAFETY: the vtable's raw pointers are to the plugin's immutable static data (header §2) and
// to thread-safe functions (header §3); nothing is written through them.
unsafe impl Send for PluginLibrary {}
// SAFETY: as above.
unsafe impl Sync for PluginLibrary {}

fn loaded() -> &'static Mutex<HashMap<PathBuf, &'static PluginLibrary>> {
    static LOADED: OnceLock<Mutex<HashMap<PathBuf, &'static PluginLibrary>>> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

impl PluginLibrary {
    /// Loads and checks the plugin at `path` (see the [module documentation](self)), or returns
    /// the library already loaded from it.
    pub fn load(path: impl AsRef<Path>) -> Result<&'static PluginLibrary, PluginError> {
        let path = path.as_ref();
        let is_bare_name = !path.as_os_str().as_encoded_bytes().contains(&b'/');
        let canonical = if is_bare_name {
            path.to_path_buf()
        } else {
            path.canonicalize().map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => PluginError::NotFound {
                    path: path.to_path_buf(),
                },
                _ => PluginError::Load {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                },
            })?
        };
        let mut map = loaded().lock();
        if let Some(lib) = map.get(&canonical) {
            return Ok(lib);
        }
        let lib = Self::open(path, &canonical)?;
        let lib: &'static PluginLibrary = Box::leak(Box::new(lib));
        map.insert(canonical, lib);
        tracing::info!(
            target: "hicache_plugin",
            plugin = %lib.name,
            version = %lib.version,
            path = %lib.path.display(),
            abi = %format!("{}.{}", lib.vtable.abi_major, lib.vtable.abi_minor),
            "loaded storage plugin"
        );
        Ok(lib)
    }

    fn open(path: &Path, canonical: &Path) -> Result<PluginLibrary, PluginError> {
        let path_buf = path.to_path_buf();
        if let Some(what) = canonical
            .is_absolute()
            .then(|| crate::elf::not_a_shared_object(canonical))
            .flatten()
        {
            return Err(PluginError::NotSharedObject {
                path: path_buf,
                what,
            });
        }
        // SAFETY: loading a library runs its initialisers; that is what configuring a plugin
        // asks for. The operator named this file as a hicache plugin.
        let lib = unsafe { Library::new(canonical) }.map_err(|e| PluginError::Load {
            path: path_buf.clone(),
            reason: e.to_string(),
        })?;
        let checked = Self::check(&lib, &path_buf);
        let (vtable, name, version) = match checked {
            Ok(v) => v,
            Err(e) => {
                // Invariant 1: even a library that is not a valid plugin stays loaded.
                std::mem::forget(lib);
                return Err(e);
            }
        };
        Ok(PluginLibrary {
            log: LogContext {
                plugin: name.clone(),
            },
            path: path_buf,
            vtable,
            name,
            version,
            _lib: lib,
        })
    }

    /// Reads the plugin's vtable and checks it: its required functions, the functions its
    /// capability bits promise, its name and version strings.
    fn check(lib: &Library, path: &Path) -> Result<(Vtable, String, String), PluginError> {
        let vt = Self::read_vtable(lib, path)?;
        let invalid = |what: String| PluginError::InvalidVtable {
            path: path.to_path_buf(),
            what,
        };
        if let Some(what) = missing_function(&vt) {
            return Err(invalid(what));
        }
        // SAFETY: the header requires static NUL-terminated strings; `bounded_str` reads at
        // most MAX_NAME + 1 bytes.
        let name = unsafe { bounded_str(vt.name) }.map_err(|e| invalid(format!("name {e}")))?;
        // SAFETY: as above.
        let version =
            unsafe { bounded_str(vt.version) }.map_err(|e| invalid(format!("version {e}")))?;
        if name.is_empty() {
            return Err(invalid("name is empty".into()));
        }
        Ok((vt, name, version))
    }

    /// Calls the entry function and copies the vtable it returns, after checking its ABI major
    /// version and minimal size; a vtable of an older minor version is zero-extended.
    fn read_vtable(lib: &Library, path: &Path) -> Result<Vtable, PluginError> {
        let path_buf = || path.to_path_buf();
        // SAFETY: the symbol's type is the header's `hicache_plugin_entry_fn`; a library that
        // exports this name with another type breaks the ABI, which no check can detect.
        let entry = unsafe { lib.get::<abi::EntryFn>(abi::ENTRY_SYMBOL) }.map_err(|e| {
            PluginError::MissingEntry {
                path: path_buf(),
                symbol: "hicache_storage_plugin",
                reason: e.to_string(),
            }
        })?;
        // SAFETY: the entry function takes no arguments and returns a pointer to static data.
        let ptr = unsafe { entry() };
        if ptr.is_null() {
            return Err(PluginError::NullVtable { path: path_buf() });
        }
        // SAFETY: every vtable of every ABI version starts with these three u32 fields.
        let header = unsafe { std::ptr::read(ptr.cast::<VtableHeader>()) };
        if header.abi_major != abi::ABI_MAJOR {
            return Err(PluginError::AbiMismatch {
                path: path_buf(),
                plugin_major: header.abi_major,
                plugin_minor: header.abi_minor,
                host_major: abi::ABI_MAJOR,
            });
        }
        if (header.struct_size as usize) < abi::VTABLE_V1_0_SIZE {
            return Err(PluginError::VtableTooSmall {
                path: path_buf(),
                size: header.struct_size,
                min: abi::VTABLE_V1_0_SIZE,
                major: abi::ABI_MAJOR,
            });
        }
        let common = (header.struct_size as usize).min(std::mem::size_of::<Vtable>());
        let mut vt = std::mem::MaybeUninit::<Vtable>::zeroed();
        // SAFETY: the plugin's vtable is `struct_size` readable bytes (it said so), we copy at
        // most that many and at most our own size; zero is a valid value of every field
        // (integers, null pointers, `None` function pointers), so the zero-extended copy is a
        // valid `Vtable`.
        let vt = unsafe {
            std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), vt.as_mut_ptr().cast::<u8>(), common);
            vt.assume_init()
        };
        Ok(vt)
    }

    /// The path the library was loaded from, as configured.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The plugin's name (from its vtable).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The plugin's version string.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The ABI version the plugin was built against: (major, minor).
    pub fn abi_version(&self) -> (u32, u32) {
        (self.vtable.abi_major, self.vtable.abi_minor)
    }

    /// The plugin's capability bits (`abi::CAP_*`), unknown bits included.
    pub fn capabilities(&self) -> u32 {
        self.vtable.capabilities
    }

    /// Whether the plugin takes batch contexts (ABI 1.1 `HICACHE_CAP_BATCH_CONTEXT`, its
    /// three entries checked non-null at load).
    pub fn batch_context(&self) -> bool {
        self.vtable.struct_size as usize >= abi::VTABLE_V1_1_SIZE
            && self.vtable.capabilities & abi::CAP_BATCH_CONTEXT != 0
    }

    /// Whether the plugin provides `clear` (ABI 1.2 `HICACHE_CAP_CLEAR`, the entry checked
    /// non-null at load). An instance supports it when its info also has `HICACHE_INFO_CLEAR`
    /// ([`BackendInfo::clear`](hicache_storage::BackendInfo::clear) of the storage).
    pub fn clear(&self) -> bool {
        self.vtable.struct_size as usize >= abi::VTABLE_V1_2_SIZE
            && self.vtable.capabilities & abi::CAP_CLEAR != 0
    }

    /// The checked, zero-extended vtable.
    pub(crate) fn vtable(&self) -> &Vtable {
        &self.vtable
    }

    /// The log context pointer handed to the plugin (invariant 1 of `host_log`).
    pub(crate) fn log_ctx(&'static self) -> *mut c_void {
        std::ptr::from_ref(&self.log).cast_mut().cast::<c_void>()
    }
}

/// Reads a NUL-terminated string of at most [`MAX_NAME`] bytes.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string, or to at least `MAX_NAME + 1` bytes.
unsafe fn bounded_str(p: *const c_char) -> Result<String, String> {
    if p.is_null() {
        return Err("is NULL".into());
    }
    let mut buf = Vec::with_capacity(32);
    for i in 0..=MAX_NAME {
        // SAFETY: the caller's guarantee: bytes up to the NUL (or MAX_NAME + 1) are readable.
        let b = unsafe { *p.add(i) } as u8;
        if b == 0 {
            return Ok(String::from_utf8_lossy(&buf).into_owned());
        }
        buf.push(b);
    }
    Err(format!("is not NUL-terminated within {MAX_NAME} bytes"))
}

/// The first function `vt` lacks that it must have: a required one, or one its capability bits
/// promise (a capability bit newer than the vtable's size is ignored: the plugin did not know
/// it).
fn missing_function(vt: &Vtable) -> Option<String> {
    let required = [
        ("create", vt.create.is_some()),
        ("destroy", vt.destroy.is_some()),
        ("get_info", vt.get_info.is_some()),
        ("batch_exists", vt.batch_exists.is_some()),
        ("batch_get", vt.batch_get.is_some()),
        ("batch_set", vt.batch_set.is_some()),
        ("batch_delete", vt.batch_delete.is_some()),
        ("get_stats", vt.get_stats.is_some()),
    ];
    if let Some((f, _)) = required.iter().find(|(_, present)| !present) {
        return Some(format!("required function `{f}` is NULL"));
    }
    if vt.capabilities & abi::CAP_REGISTER_MEMORY != 0 && vt.register_memory.is_none() {
        return Some("HICACHE_CAP_REGISTER_MEMORY is set but `register_memory` is NULL".into());
    }
    if vt.capabilities & abi::CAP_TEST_CORRUPT != 0 && vt.test_corrupt_page.is_none() {
        return Some("HICACHE_CAP_TEST_CORRUPT is set but `test_corrupt_page` is NULL".into());
    }
    // A vtable too small to hold the 1.1 entries did not know the bit: ignored there.
    if vt.struct_size as usize >= abi::VTABLE_V1_1_SIZE
        && vt.capabilities & abi::CAP_BATCH_CONTEXT != 0
    {
        let ctx = [
            ("batch_exists_ctx", vt.batch_exists_ctx.is_some()),
            ("batch_get_ctx", vt.batch_get_ctx.is_some()),
            ("batch_set_ctx", vt.batch_set_ctx.is_some()),
        ];
        if let Some((f, _)) = ctx.iter().find(|(_, present)| !present) {
            return Some(format!(
                "HICACHE_CAP_BATCH_CONTEXT is set but `{f}` is NULL"
            ));
        }
    }
    // Likewise a vtable too small to hold the 1.2 `clear` entry did not know its bit.
    if vt.struct_size as usize >= abi::VTABLE_V1_2_SIZE
        && vt.capabilities & abi::CAP_CLEAR != 0
        && vt.clear.is_none()
    {
        return Some("HICACHE_CAP_CLEAR is set but `clear` is NULL".into());
    }
    None
}
