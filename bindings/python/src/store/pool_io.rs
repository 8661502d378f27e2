//! SGLang's batch calls in one native call each: the storage class hands a whole call (every
//! pool transfer of a v2 call, or the one KV transfer of a v1 call) to [`Store::pool_io`] or
//! [`Store::pool_exists`], which check the host indices, make the pages' pieces from the
//! registered pool geometry ([`crate::host_pools`]), and run every backend call of the batch
//! with the GIL released once.
//!
//! Invariants:
//! 1. Everything is checked before any I/O: every transfer's pool, keys, host indices and
//!    pieces (the registered regions included). A call this path does not take on (a pool not
//!    registered here, a pool named twice, indices that are not whole pages, a count that
//!    does not match, an unknown hit policy, anything that is not a list of strings where
//!    one is expected) is answered `None` before any I/O, and the Python class then takes
//!    its own path, which raises or answers exactly as it always did.
//! 2. Outcomes are the Python path's: bad input (a malformed key, a piece outside the
//!    regions) raises `ValueError`, a closed store `RuntimeError`; a failing backend fails
//!    only the transfer (or the presence) it served, answered as misses / failed writes, and
//!    its message is handed back for the class to log.
//! 3. Transfers run in the order given, each as the class would have run it alone.

use std::collections::HashSet;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use super::{Call, Store};
use crate::error::{BindingError, Result};
use crate::hit_policy::{Policy, Walk};
use crate::host_pools::HostPool;
use crate::pages::Pieces;
use crate::tensor_indices;

/// A backend failure answered as misses or failed writes: `(pool, message)` (invariant 2).
pub type Failure = (String, String);

/// What a call's outcome becomes when the backend fails: raised, or answered (invariant 2).
fn answered(e: BindingError) -> Result<String> {
    match e {
        BindingError::Closed(_) | BindingError::Cancelled(_) | BindingError::OutOfMemory { .. } => {
            Err(e)
        }
        e if e.is_bad_input() => Err(e),
        e => Ok(e.to_string()),
    }
}

/// The strings of a list or tuple of `str`, else `None`.
fn strings(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<String>>> {
    let items = if let Ok(l) = obj.cast::<PyList>() {
        l.iter().collect::<Vec<_>>()
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(items.len());
    for i in items {
        match i.cast::<PyString>() {
            Ok(s) => out.push(s.to_str()?.to_owned()),
            Err(_) => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// A transfer's keys: `None` is no keys (as the class's `list(t.keys or [])`).
fn keys_of(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<String>>> {
    if obj.is_none() {
        return Ok(Some(Vec::new()));
    }
    strings(obj)
}

/// SGLang's `prefix_keys`: a list (or tuple) of key strings, else no prefix (the class's
/// `_context`: some SGLang versions default the field to `(None,)`).
pub fn prefix_keys(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<String>>> {
    match obj {
        Some(o) if !o.is_none() => strings(o),
        _ => Ok(None),
    }
}

/// The items of a list or tuple, else `None`.
fn items<'py>(obj: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    if let Ok(l) = obj.cast::<PyList>() {
        Some(l.iter().collect())
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        Some(t.iter().collect())
    } else {
        None
    }
}

/// `name`, `keys`, `host_indices` of a transfer: SGLang's `PoolTransfer` (attributes) or a
/// `(name, keys, host_indices)` tuple (the v1 calls).
fn transfer_fields<'py>(
    t: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    if let Ok(tuple) = t.cast::<PyTuple>()
        && tuple.len() == 3
    {
        return Ok((tuple.get_item(0)?, tuple.get_item(1)?, tuple.get_item(2)?));
    }
    let py = t.py();
    Ok((
        t.getattr(pyo3::intern!(py, "name"))?,
        t.getattr(pyo3::intern!(py, "keys"))?,
        t.getattr(pyo3::intern!(py, "host_indices"))?,
    ))
}

/// One checked transfer of a get or set: its pool, keys and pieces (`None`: no keys).
struct Planned {
    pool: Arc<HostPool>,
    keys: usize,
    io: Option<(Call, Pieces)>,
}

/// One checked transfer of an exists: its pool, policy and the keys it may ask.
struct Asked {
    pool: Arc<HostPool>,
    policy: Policy,
    /// Every key the pool may be asked (the query's, or a `block_groups` pool's own).
    call: Call,
}

impl Store {
    fn pool(&self, name: &Bound<'_, PyAny>) -> PyResult<Option<Arc<HostPool>>> {
        let Ok(name) = name.cast::<PyString>() else {
            return Ok(None);
        };
        Ok(self.pools.read().get(name.to_str()?).cloned())
    }

    /// Checks every transfer (invariant 1); `None` when this path does not take the call.
    fn plan_io(
        &self,
        op: &'static str,
        transfers: &Bound<'_, PyAny>,
        prefix: &Option<Vec<String>>,
        extra_info: &Option<String>,
    ) -> PyResult<Option<Vec<Planned>>> {
        let Some(list) = items(transfers) else {
            return Ok(None);
        };
        let mut seen = HashSet::with_capacity(list.len());
        let mut planned = Vec::with_capacity(list.len());
        for t in &list {
            let (name, keys, indices) = transfer_fields(t)?;
            let Some(pool) = self.pool(&name)? else {
                return Ok(None);
            };
            if pool.pieces.is_empty() || !seen.insert(pool.name.clone()) {
                return Ok(None);
            }
            let Some(keys) = keys_of(&keys)? else {
                return Ok(None);
            };
            let Some(indices) = tensor_indices::read(&indices)? else {
                return Ok(None);
            };
            if indices.len() != keys.len() * pool.page_size {
                return Ok(None);
            }
            let Some(starts) = pool.page_starts(&indices) else {
                return Ok(None);
            };
            if keys.is_empty() {
                planned.push(Planned {
                    pool,
                    keys: 0,
                    io: None,
                });
                continue;
            }
            let call = Call::new(
                &pool.namespace_hex,
                &keys,
                prefix.clone(),
                extra_info.clone(),
            )?;
            let (ptrs, sizes) = pool.pieces_of(&starts);
            let pieces = Pieces::new(
                op,
                keys.len(),
                ptrs,
                sizes,
                pool.kv_interleaved,
                self.regions.read().as_ref(),
            )?;
            planned.push(Planned {
                pool,
                keys: keys.len(),
                io: Some((call, pieces)),
            });
        }
        Ok(Some(planned))
    }

    /// Reads (`write` false) or writes every transfer's pages in place: one bool per key and
    /// pool, and the backend failures answered as misses / failed writes (invariant 2).
    pub(super) fn pool_io_call<'py>(
        &self,
        py: Python<'py>,
        write: bool,
        transfers: &Bound<'py, PyAny>,
        prefix: Option<Vec<String>>,
        extra_info: Option<String>,
    ) -> PyResult<Option<(Bound<'py, PyDict>, Vec<Failure>)>> {
        let op = if write { "batch_set" } else { "batch_get" };
        let Some(planned) = self.plan_io(op, transfers, &prefix, &extra_info)? else {
            return Ok(None);
        };
        let outcomes = py.detach(|| -> Result<Vec<std::result::Result<Vec<bool>, String>>> {
            let mut out = Vec::with_capacity(planned.len());
            for p in &planned {
                let Some((call, pieces)) = &p.io else {
                    out.push(Ok(Vec::new()));
                    continue;
                };
                let r = if write {
                    self.set_from(call, p.pool.layout, pieces)
                } else {
                    self.get_into(call, p.pool.layout, pieces)
                };
                out.push(match r {
                    Ok(v) => Ok(v),
                    Err(e) => Err(answered(e)?),
                });
            }
            Ok(out)
        })?;
        let results = PyDict::new(py);
        let mut failures = Vec::new();
        for (p, o) in planned.iter().zip(outcomes) {
            let flags = match o {
                Ok(v) => v,
                Err(msg) => {
                    failures.push((p.pool.name.clone(), msg));
                    vec![false; p.keys]
                }
            };
            results.set_item(&p.pool.name, PyList::new(py, flags)?)?;
        }
        Ok(Some((results, failures)))
    }

    /// Checks an exists call's transfers (invariant 1); `None` when this path does not take it.
    fn plan_exists(
        &self,
        transfers: &Bound<'_, PyAny>,
        query: &[String],
        prefix: &Option<Vec<String>>,
        extra_info: &Option<String>,
    ) -> PyResult<Option<Vec<Asked>>> {
        let Some(list) = items(transfers) else {
            return Ok(None);
        };
        let py = transfers.py();
        let mut seen = HashSet::with_capacity(list.len());
        let mut asked = Vec::with_capacity(list.len());
        for t in &list {
            let Some(pool) = self.pool(&t.getattr(pyo3::intern!(py, "name"))?)? else {
                return Ok(None);
            };
            if !seen.insert(pool.name.clone()) {
                return Ok(None);
            }
            let Some(own) = keys_of(&t.getattr(pyo3::intern!(py, "keys"))?)? else {
                return Ok(None);
            };
            let policy = t.getattr(pyo3::intern!(py, "hit_policy"))?;
            let Ok(policy) = policy.cast::<PyString>() else {
                return Ok(None);
            };
            let int = |attr: &Bound<'_, PyString>| -> PyResult<Option<i64>> {
                let v = t.getattr(attr)?;
                if v.is_none() {
                    return Ok(Some(0));
                }
                Ok(v.extract::<i64>().ok())
            };
            let (Some(block), Some(group)) = (
                int(pyo3::intern!(py, "block_pages"))?,
                int(pyo3::intern!(py, "group_pages"))?,
            ) else {
                return Ok(None);
            };
            let Some(policy) = Policy::parse(policy.to_str()?, own.len(), block, group) else {
                return Ok(None);
            };
            let keys = match policy {
                Policy::BlockGroups { .. } if !own.is_empty() => &own[..],
                _ => query,
            };
            let call = Call::new(
                &pool.namespace_hex,
                keys,
                prefix.clone(),
                extra_info.clone(),
            )?;
            asked.push(Asked { pool, policy, call });
        }
        Ok(Some(asked))
    }

    /// `batch_exists_v2` with the KV pool `kv`: `(kv_hit_pages, extra_pool_hit_pages,
    /// restorable_prefix_pages, failures)` (the hit policies of [`crate::hit_policy`]; pools
    /// asked only as the walk reaches them; a failing backend counts as absent pages).
    #[allow(clippy::type_complexity)]
    pub(super) fn pool_exists_call<'py>(
        &self,
        py: Python<'py>,
        kv: &str,
        keys: &Bound<'py, PyAny>,
        transfers: &Bound<'py, PyAny>,
        prefix: Option<Vec<String>>,
        extra_info: Option<String>,
    ) -> PyResult<Option<(usize, Bound<'py, PyDict>, Vec<usize>, Vec<Failure>)>> {
        let Some(kv_pool) = self.pools.read().get(kv).cloned() else {
            return Ok(None);
        };
        let Some(query) = strings(keys)? else {
            return Ok(None);
        };
        let Some(asked) = self.plan_exists(transfers, &query, &prefix, &extra_info)? else {
            return Ok(None);
        };
        if query.is_empty() {
            return Ok(Some((0, PyDict::new(py), Vec::new(), Vec::new())));
        }
        let kv_call = Call::new(&kv_pool.namespace_hex, &query, prefix, extra_info)?;
        let (hit, report, restorable, failures) = py.detach(|| -> Result<_> {
            let mut failures = Vec::new();
            let kv_pages = match self.exists(&kv_call) {
                Ok(n) => n,
                Err(e) => {
                    failures.push((kv_pool.name.clone(), answered(e)?));
                    0
                }
            };
            let mut walk = Walk::new(kv_pages);
            for a in &asked {
                if walk.done() {
                    break;
                }
                let n = a.call.keys().len().min(a.policy.keys_to_ask(kv_pages));
                let flags = if n == 0 {
                    Vec::new()
                } else {
                    match self.exists_each(&a.call.truncated(n)) {
                        Ok(f) => f,
                        Err(e) => {
                            failures.push((a.pool.name.clone(), answered(e)?));
                            vec![false; n]
                        }
                    }
                };
                walk.apply(&a.pool.name, a.policy, &flags);
            }
            let (hit, report, restorable) = walk.finish();
            Ok((hit, report, restorable, failures))
        })?;
        let d = PyDict::new(py);
        for (name, pages) in report {
            d.set_item(name, pages)?;
        }
        Ok(Some((hit, d, restorable, failures)))
    }
}
