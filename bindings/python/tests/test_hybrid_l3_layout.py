"""The L3 layout an engine on our Rust core uses for hybrid models (`hicache/src/hybrid/
l3_keys.rs`, `HybridL3Layout`) names the same namespaces as this package does for SGLang's
pools, so the two read each other's pages. The Rust test
`hybrid::l3_keys::tests::namespaces_match_the_python_package` pins the values below; here
they come from the package itself, attached the way SGLang's hybrid controller attaches it."""

from conftest import require_sglang

require_sglang()

from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402

from sglang_pools import mamba_pool, mha_pool, swa_pool  # noqa: E402
from test_sglang_v2 import attach  # noqa: E402

#: KV: 3 layers of 1 head of 16, page 4, page_first; SWA: the tests' layer_first
#: `swa_pool`; Mamba: the tests' `mamba_pool`; Qwen/Qwen3.5-9B, TP rank 1 of 2, tenant acme.
RUST_NAMESPACES = {
    "kv": "d418d5b0ffc2e83b1c0b2c20862a7954",
    "swa": "dde7e3b89038695b4901b90235b068f4",
    "mamba": "82c392ffd696994da8ce503c75a01b81",
}


def test_namespaces_are_those_of_the_rust_hybrid_layout():
    kv = mha_pool("page_first", layers=3, heads=1, head_dim=16, page_size=4)
    sidecars = {PoolName.SWA: swa_pool(layout="layer_first"), PoolName.MAMBA: mamba_pool()}
    b = attach({"backend": "memory", "tenant": "acme"}, kv, sidecars,
               model="Qwen/Qwen3.5-9B", tp=(1, 2))
    try:
        got = {"kv": b.namespace, "swa": b._pools["swa"].namespace,
               "mamba": b._pools["mamba"].namespace}
        assert got == RUST_NAMESPACES
    finally:
        b.close()
