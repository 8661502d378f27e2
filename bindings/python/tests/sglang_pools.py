"""SGLang's real host KV pools (MHA and MLA, every layout) on CPU memory, and its real
storage config, for the tests and the bench. Sizes are small: the point is SGLang's own
pointer arithmetic (``get_page_buffer_meta``) and page views (``get_data_page``)."""

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
CPU = torch.device("cpu")


def _ptrs(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(layout, layers=3, heads=2, head_dim=8, page_size=4, device_tokens=64,
             ratio=2.0, dtype=torch.bfloat16):
    """SGLang's MHATokenToKVPoolHost over CPU 'device' buffers (pin_memory=False)."""
    k = tuple(torch.zeros(device_tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=CPU,
    )
    pool = MHATokenToKVPoolHost(
        info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
    )
    pool._test_device_buffers = (k, v)
    return pool


def mla_pool(layout, layers=3, width=24, page_size=4, device_tokens=64, ratio=2.0,
             dtype=torch.bfloat16):
    """SGLang's MLATokenToKVPoolHost over CPU 'device' buffers (pin_memory=False)."""
    bufs = tuple(torch.zeros(device_tokens + page_size, 1, width, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(layers)),
        device_layer_num=layers, page_size=page_size, kv_lora_rank=width - 8,
        qk_rope_head_dim=8, kv_cache_dim=width, dtype=dtype, device=CPU,
    )
    pool = MLATokenToKVPoolHost(
        info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
        target_layer_num=layers,
    )
    pool._test_device_buffers = bufs
    return pool


def make_pool(kind, layout, **kw):
    return (mha_pool if kind == "mha" else mla_pool)(layout, **kw)


def storage_config(extra_config, mla=False, layout="page_first", model="test-model",
                   tp=(0, 1), pp=(0, 1), metrics=False):
    """SGLang's HiCacheStorageConfig as its controller builds it."""
    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1],
        attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=metrics, is_page_first_layout=layout == "page_first",
        model_name=model, extra_config=extra_config,
    )


def fill_pages(pool, host_indices, seed):
    """Random bytes in the given token slots (whole pages) of every layer; returns them as
    flat data pages, one per page."""
    g = torch.Generator().manual_seed(seed)
    pages = []
    for start in host_indices[:: pool.page_size].tolist():
        flat = pool.get_dummy_flat_data_page()
        flat.view(torch.int16).copy_(
            torch.randint(-2**15, 2**15, (flat.numel(),), generator=g, dtype=torch.int32).to(torch.int16)
        )
        pool.set_from_flat_data_page(start, flat)
        pages.append(flat.clone())
    return pages


def read_pages(pool, host_indices):
    return [pool.get_data_page(s, flat=True).clone() for s in host_indices[:: pool.page_size].tolist()]


def same(a, b):
    """Byte equality (random bits include NaN patterns, which torch.equal calls unequal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---- hybrid models' host pools (SGLang's v2 multi-pool interface) --------------------------
#
# Each builder returns SGLang 0.5.23's own host pool class, constructed on CPU memory
# (pin_memory=False). Where SGLang's device-side pool cannot be built without a GPU, the
# builder says which piece was replaced and why.

import ctypes  # noqa: E402
import types  # noqa: E402


def set_parallel(tp=(0, 1), pp=(0, 1)):
    """SGLang's parallel state (read by its DSA device pool): set once per process."""
    from sglang.srt import runtime_context

    runtime_context.get_parallel().override_permanently(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1],
        attn_dcp_rank=0, attn_dcp_size=1,
    )


def mamba_pool(layout="page_first", layers=2, slots=8, temporal=(4, 8), convs=((6, 3), (5,)),
               temporal_dtype=torch.float32, conv_dtype=torch.bfloat16, ratio=2.0,
               side_state=None):
    """SGLang's real MambaPoolHost (page_size 1: one state slot per page). Its device-side
    input is SGLang's own MambaStateBufferInfo over CPU tensors ([layer, slot, *shape]):
    nothing replaced. Pages are several pieces of different sizes: the temporal (SSM) state,
    then each conv state. ``side_state``: the shape of one slot's registered side state
    (``extra_checkpoint_buffers``), for which SGLang gives no zero-copy pieces."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    extra = () if side_state is None else (
        torch.zeros((slots + 1,) + tuple(side_state), dtype=torch.float32),)
    info = MambaStateBufferInfo(
        temporal=torch.zeros((layers, slots + 1) + tuple(temporal), dtype=temporal_dtype),
        conv=tuple(torch.zeros((layers, slots + 1) + tuple(c), dtype=conv_dtype) for c in convs),
        extra_checkpoint_buffers=extra,
    )
    pool = MambaPoolHost(info, ratio, 0, device_capacity=slots, pin_memory=False,
                         device="cpu", layout=layout)
    pool._test_device_buffers = info
    return pool


def swa_pool(layout="page_first", layers=2, heads=1, head_dim=16, page_size=4,
             device_tokens=32, ratio=2.0, dtype=torch.bfloat16):
    """A sliding-window side pool: SGLang uses an MHATokenToKVPoolHost of its own geometry
    (fewer layers and tokens than the full KV pool) for the "swa" pool."""
    return mha_pool(layout, layers=layers, heads=heads, head_dim=head_dim, page_size=page_size,
                    device_tokens=device_tokens, ratio=ratio, dtype=dtype)


#: DSA needs 64-token physical pages (SGLang's DSATokenToKVPool asserts it).
DSA_PAGE_SIZE = 64


def dsa_pools(layout="page_first", layers=2, device_tokens=128, ratio=2.0):
    """DeepSeek DSA on CPU: ``(kv, indexer)``: the MLA KV host pool (the anchor) and SGLang's
    real DSAIndexerPoolHost built from its real DSATokenToKVPool on the CPU device (nothing
    replaced). Index pages (index_k + fp32 scales, uint8) ride on the KV pool's host indices
    (``indices_from_pool == kv``); zero-copy needs a page_first layout."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl

    set_parallel()
    device = DSATokenToKVPool(
        device_tokens, DSA_PAGE_SIZE, 16, torch.bfloat16, 8, layers, "cpu", 128, False, 24,
    )
    kv = mla_pool(layout, layers=layers, width=24, page_size=DSA_PAGE_SIZE,
                  device_tokens=device_tokens, ratio=ratio)
    indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(device), kv, pin_memory=False,
                                 device="cpu")
    indexer._test_device_pool = device
    return kv, indexer


def logical_anchor(size=64, page_size=4, layout="page_first"):
    """SGLang's LogicalHostPool: the hybrid controller's allocation-only anchor (no
    kv_buffer), handed to ``register_mem_pool_host`` before the real pools arrive via v2."""
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    return LogicalHostPool(size, page_size, layout)


def v4_paged_pool(name="deepseek_v4_c4", layout="page_first", layers=2, item_bytes=96,
                  pages=9, slot_page_size=4):
    """SGLang's real DeepSeekV4PagedHostPool (compressed KV / indexer sub-pools of DeepSeek
    V4) over CPU 'device' page rows (one uint8 tensor per layer): nothing replaced."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool

    dev = [torch.zeros(pages, item_bytes, dtype=torch.uint8) for _ in range(layers)]
    pool = DeepSeekV4PagedHostPool(name, dev, item_bytes, pages, slot_page_size,
                                   layout=layout, device="cpu", pin_memory=False)
    pool._test_device_buffers = dev
    return pool


def v4_state_pool(name="deepseek_v4_c4_state", layout="page_first", layers=2, ring=2,
                  slot_shape=(3, 8), pages=9, swa_page_size=4):
    """SGLang's real DeepSeekV4StateHostPool. Replaced: its device-side CompressStatePool
    objects (CUDA-only), by stand-ins with the two attributes the host pool reads
    (``kv_score_buffer.kv_score``, a contiguous CPU tensor [slots, ...], and ``ring_size``)."""
    from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4StateHostPool

    states = [
        types.SimpleNamespace(
            kv_score_buffer=types.SimpleNamespace(
                kv_score=torch.zeros((ring * 4,) + tuple(slot_shape), dtype=torch.float32)),
            ring_size=ring,
        )
        for _ in range(layers)
    ]
    return DeepSeekV4StateHostPool(name, states, pages, swa_page_size, layout=layout,
                                   device="cpu", pin_memory=False)


def mxfp8_pool(layout="page_first"):
    """An MHATokenToKVPoolMXFP8Host whose storage-page methods are SGLang's own (they raise:
    a page's scales live outside kv_buffer). Replaced: its constructor, which needs CUDA's
    staged JIT write-back kernel; the object is made with ``object.__new__`` and given the
    plain attributes a backend reads before asking for pages."""
    from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host

    pool = object.__new__(MHATokenToKVPoolMXFP8Host)
    pool.layout, pool.page_size, pool.size, pool.dtype = layout, 128, 1024, torch.uint8
    pool.layer_num, pool.head_num, pool.head_dim = 2, 1, 16
    pool.kv_buffer = torch.zeros(2, 1024, 2, 1, 16, dtype=torch.uint8)
    return pool


def fill_pool_pages(pool, host_indices, seed):
    """Random bytes in whole pages of any host pool (through SGLang's own
    ``set_from_flat_data_page``); returns the flat pages written."""
    g = torch.Generator().manual_seed(seed)
    pages = []
    for start in host_indices[:: pool.page_size].tolist():
        flat = pool.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, (flat.numel() * flat.element_size(),), generator=g,
                            dtype=torch.int32).to(torch.uint8)
        flat.view(torch.uint8).reshape(-1).copy_(raw)
        pool.set_from_flat_data_page(start, flat)
        pages.append(flat.clone())
    return pages


def read_pool_pages(pool, host_indices):
    """The flat pages (SGLang's ``get_data_page``) at whole-page host indices."""
    return [pool.get_data_page(s, flat=True).clone()
            for s in host_indices[:: pool.page_size].tolist()]


def page_pieces(pool, host_indices):
    """The bytes of every piece SGLang's ``get_page_buffer_meta`` names for these host
    indices, in its order: what a zero-copy backend reads and writes."""
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    return [ctypes.string_at(p, s) for p, s in zip(ptrs, sizes)]


def page_indices(pool, pages):
    """Host indices (int64, whole pages) of the given page numbers of ``pool``."""
    ps = pool.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in pages])


def nvfp4_index_pool(anchor, layout="page_first", layers=2, row_bytes=80, device_pages=8):
    """SGLang's real MiniMaxM3Nvfp4IndexKPoolHost (packed NVFP4 index K page rows) riding on
    ``anchor``'s host indices, over SGLang's PageRowBufferInfo of a CPU slab: nothing
    replaced. SGLang's zero-copy page meta exists only for the page_first layouts (layer_first
    raises there)."""
    from sglang.srt.mem_cache.device_pool_info import PageRowBufferInfo
    from sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4 import MiniMaxM3Nvfp4IndexKPoolHost

    slab = torch.zeros(layers, device_pages, row_bytes, dtype=torch.uint8)
    info = PageRowBufferInfo(slab=slab, rows=tuple(slab[i] for i in range(layers)),
                             row_bytes=row_bytes, page_size=anchor.page_size,
                             num_pages=device_pages)
    return MiniMaxM3Nvfp4IndexKPoolHost(info, anchor, layout, pin_memory=False, device="cpu",
                                        start_layer=0, end_layer=layers)


class DevicePool:
    """What SGLang's cache controllers read from the device KV pool (no GPU memory here):
    its device, layer range and the layer-transfer counter it is given."""

    device = torch.device("cpu")

    def __init__(self, layers):
        self.layer_num = layers
        self.start_layer = 0
        self.end_layer = layers

    def register_layer_transfer_counter(self, counter):
        self.counter = counter


class Allocator:
    """What SGLang's cache controllers read from the device token allocator: its KV pool."""

    def __init__(self, device_pool):
        self.device_pool = device_pool

    def get_kvcache(self):
        return self.device_pool
