//! What a backend crate implements to be opened by name: a [`BackendFactory`], given the
//! deployment's [`BackendContext`]. The [`Registry`](crate::Registry) maps names to factories;
//! backends (the in-memory one included) depend on this module only, never on the registry.

use std::sync::Arc;

use async_trait::async_trait;
use hicache_core::{LayoutKind, MemoryRegion, NamespaceId};

use crate::backend::Storage;
use crate::config::{CommonConfig, ConfigFields};
use crate::error::Result;

/// What the engine knows about the deployment when it opens a backend.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendContext {
    /// Bytes of one page in this deployment (all layers, K and V); 0 if not known or varied.
    pub page_bytes: usize,
    /// Host layout of pages.
    pub layout: LayoutKind,
    /// Namespace of this rank's pages, when it has one (backends may use it for placement).
    pub namespace: Option<NamespaceId>,
    /// Tensor-parallel rank.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// The pinned host pool, when the engine has one (also passed later to
    /// [`Storage::register_memory`]).
    pub memory: Option<MemoryRegion>,
}

impl Default for BackendContext {
    fn default() -> Self {
        Self {
            page_bytes: 0,
            layout: LayoutKind::PageFirst,
            namespace: None,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            memory: None,
        }
    }
}

/// Opens one kind of backend. Implement it in a backend crate and register it.
#[async_trait]
pub trait BackendFactory: Send + Sync + 'static {
    /// The registry name (`file`, `memory`, …).
    fn name(&self) -> &str;

    /// Opens a backend. `fields` are the backend's own extra-config fields: read them with the
    /// typed accessors and call [`ConfigFields::finish`] so unknown fields are refused.
    async fn open(
        &self,
        common: &CommonConfig,
        fields: ConfigFields,
        ctx: &BackendContext,
    ) -> Result<Arc<dyn Storage>>;
}
