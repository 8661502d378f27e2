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
