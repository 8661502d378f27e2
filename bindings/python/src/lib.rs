//! The `hicache-rs` Python package's native module, `hicache_rs._native`.
//!
//! SGLang loads third-party L3 backends with `--hicache-storage-backend dynamic` and a Python
//! class named in the extra-config. This crate exposes our L3 backends to Python so that the
//! package's pure-Python class `hicache_rs.sglang.HiCacheRsStorage` (a subclass of SGLang's
//! `HiCacheStorage`) can serve SGLang's zero-copy calls from our backends:
//!
//! - [`store::Store`]: an opened backend (`file`, `uring`, `rdma`, `plugin`, `memory`, by cargo
//!   feature), whose batch calls read and write pages in place in caller memory (pointer and
//!   length per piece, as SGLang's host pool describes them) with the GIL released, inside
//!   the pool memory registered with it ([`regions`]) when there is one;
//! - [`namespace_id`]: the namespace SGLang's bare content hashes are paired with (model, dtype,
//!   layout, geometry, TP/PP rank, tenant: see [`identity`]);
//! - [`sglang_page_hashes`]: our SGLang-compatible page hash chain, for tools;
//! - [`jobs`]: the asynchronous loads and stores (`Store.submit_job`) and their completion
//!   queue, behind vLLM's secondary tier `hicache_rs.vllm.HiCacheRsTier`.
//!
//! `cargo test` checks the Rust side; the package's pytest suite runs it against SGLang's own
//! code (see the crate README).

pub mod backends;
pub mod error;
pub mod hit_policy;
pub mod host_pools;
pub mod identity;
pub mod jobs;
pub mod maps;
pub mod pages;
pub mod regions;
pub mod store;
pub mod tensor_indices;

use hicache_core::{PageHash, PageHasher, tokens_from_i64};
use hicache_storage::{StorageConfig, StorageError};
use pyo3::prelude::*;

use crate::error::BindingError;
use crate::identity::Identity;

/// The 32-hex namespace id of one rank's pages: every SGLang key is paired with it.
#[pyfunction]
#[pyo3(signature = (model, dtype, layout, mla, heads, head_dim, layers, page_size, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, extra_key=None, cache_salt=None))]
#[allow(clippy::too_many_arguments)]
pub fn namespace_id(
    model: String,
    dtype: String,
    layout: String,
    mla: bool,
    heads: u32,
    head_dim: u32,
    layers: u32,
    page_size: u32,
    tp_rank: u32,
    tp_size: u32,
    pp_rank: u32,
    pp_size: u32,
    extra_key: Option<&str>,
    cache_salt: Option<&str>,
) -> PyResult<String> {
    let id = Identity {
        model,
        dtype,
        layout,
        mla,
        heads,
        head_dim,
        layers,
        page_size,
        tp: (tp_rank, tp_size),
        pp: (pp_rank, pp_size),
    };
    Ok(id.namespace_id(extra_key, cache_salt)?)
}

/// SGLang's page hashes (`hash_mode=sglang`) of every whole page of `tokens`, chained from
/// `prior` (a 64-hex hash) when given: SHA-256 over the prior's 32 bytes and each token as
/// u32 little-endian, lowercase hex.
#[pyfunction]
#[pyo3(signature = (tokens, page_size, prior=None))]
pub fn sglang_page_hashes(
    tokens: Vec<i64>,
    page_size: u32,
    prior: Option<&str>,
) -> PyResult<Vec<String>> {
    let hasher = PageHasher::sglang(page_size).map_err(BindingError::from)?;
    let tokens = tokens_from_i64(&tokens).map_err(BindingError::from)?;
    let prior = prior
        .map(|p| {
            PageHash::from_hex(p).map_err(|_| BindingError::BadKey {
                index: 0,
                key: p.chars().take(80).collect(),
            })
        })
        .transpose()?;
    Ok(hasher
        .hash_pages(prior, &tokens)
        .iter()
        .map(PageHash::to_hex)
        .collect())
}

/// Checks an extra-config (our own: `{"backend": "file", ...}`) without opening the backend:
/// the JSON, the common fields, and that the backend is compiled into this build. Returns the
/// backend's name. The backend's own fields are checked when a [`store::Store`] opens it.
#[pyfunction]
pub fn check_extra_config(extra_config: &str) -> PyResult<String> {
    let config = StorageConfig::parse(None, Some(extra_config)).map_err(BindingError::from)?;
    let registry = backends::registry()?;
    backends::check_compiled(&registry, &config.backend)?;
    if !registry.contains(&config.backend) {
        return Err(BindingError::from(StorageError::UnknownBackend {
            name: config.backend.clone(),
            known: registry.names(),
        })
        .into());
    }
    Ok(config.backend)
}

/// The module `hicache_rs._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<store::Store>()?;
    m.add_function(wrap_pyfunction!(namespace_id, m)?)?;
    m.add_function(wrap_pyfunction!(sglang_page_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(check_extra_config, m)?)?;
    m.add("COMPILED_BACKENDS", backends::registry()?.names())?;
    m.add("MAX_CALL_BYTES", store::MAX_CALL_BYTES)?;
    m.add("JOB_WORKERS", jobs::JOB_WORKERS)?;
    m.add("JOB_QUEUE_CAPACITY", jobs::JOB_QUEUE_CAPACITY)?;
    Ok(())
}
