"""hicache-rs L3 storage from Python: the native ``Store`` (an opened backend), the
namespace ids that pair with SGLang's page hashes, and SGLang-compatible page hashes.
SGLang's ``dynamic`` backend class is ``hicache_rs.sglang.HiCacheRsStorage`` (imported on
its own: it needs SGLang and torch)."""

from hicache_rs._native import (
    COMPILED_BACKENDS,
    Store,
    check_extra_config,
    namespace_id,
    sglang_page_hashes,
)

__all__ = ["COMPILED_BACKENDS", "Store", "check_extra_config", "namespace_id", "sglang_page_hashes"]
