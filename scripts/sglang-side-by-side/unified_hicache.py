"""The host tier of ``unified_replay.py --host-capacity-pages N``: SGLang 0.5.23's own
hierarchical cache (``UnifiedRadixCache.init_hicache``: its ``HybridCacheController`` and its
host pools, assembled by its ``attach_hybrid_pool_to_unified_cache``) on CPU, every copy
completed before the replay goes on. UNIFIED_PROTOCOL.md §10 states the rules.

What runs on CPU that SGLang wrote for an accelerator (the only things this module changes,
each a registry entry or a module attribute SGLang looks up at run time; no cache, pool,
controller or tree function is replaced):

- ``pool_host.common.ALLOC_MEMORY_FUNCS["cpu"]``: host buffers are allocated by SGLang's own
  ``alloc_with_host_register`` with ``pin_memory=False``. Page-locking
  (``cudaHostRegister``) needs a CUDA driver and only changes copy speed.
- The copy kernels: with ``io_backend="direct"`` and the ``page_first_direct`` host layout,
  SGLang's host pools call two ops of the CUDA wheel ``sgl_kernel.kvcacheio``, which a CPU
  install lacks: ``transfer_kv_all_layer_direct_lf_pf`` (device to host, every layer) and
  ``transfer_kv_per_layer_direct_pf_lf`` (host to device, one layer). They are bound here,
  as the module globals ``pool_host.mha`` and ``pool_host.mamba`` import them into on CUDA,
  to ``torch`` CPU copies of the same rows (token ``t`` of host page ``t // P`` at slot
  ``t % P``). The bytes copied do not change any column of the log; the copies run so that
  SGLang's controller, its queues and its acknowledgements run as they do on a GPU.
- Streams and events: SGLang's ``get_device_module()`` returns ``torch.cpu`` without an
  accelerator; its ``Stream`` and ``Event`` are used unchanged. CPU copies finish before
  the call returns.
"""

import torch

from sglang.srt.mem_cache.pool_host import common as pool_host_common
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.runtime_context import get_server_args

# The columns a replay with a host tier adds (UNIFIED_PROTOCOL.md §10).
HOST_COLUMNS = "\thost_hit\tev_host_full\tev_host_aux"

# The column a replay with a host tier adds before `refused` (§10 step 1a): the match's Full
# host hit, which the admission budget counted.
HOST_MATCH_COLUMN = "\thost_match"


def _cpu_host_alloc(dims, *, dtype, device, pin_memory, allocator,
                    registration_granularity_bytes=None):
    """SGLang's own host allocation without page-locking (no CUDA driver on CPU)."""
    return pool_host_common.alloc_with_host_register(
        dims,
        dtype=dtype,
        device=device,
        pin_memory=False,
        allocator=allocator,
        registration_granularity_bytes=registration_granularity_bytes,
    )


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices,
                                      page_size):
    """Device (layer first: one tensor per layer, for each of ``dst_ptrs`` in turn) to host
    (page first: ``[page, layer, slot in page, ...]``), every layer."""
    layers = len(src_ptrs) // len(dst_ptrs)
    src_indices = src_indices.to(torch.int64)
    pages = torch.div(dst_indices, page_size, rounding_mode="floor").to(torch.int64)
    slots = (dst_indices % page_size).to(torch.int64)
    for j, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[j * layers + layer]
            dst[pages, layer, slots] = src.index_select(0, src_indices).to(dst.dtype)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices,
                                       layer_id, page_size):
    """Host (page first) to device (one layer's tensor per entry of ``dst_ptrs``)."""
    pages = torch.div(src_indices, page_size, rounding_mode="floor").to(torch.int64)
    slots = (src_indices % page_size).to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst.index_copy_(0, dst_indices, src[pages, layer_id, slots].to(dst.dtype))


def install_cpu_seams():
    """The registry entry and the two copy ops bound for CPU (module documentation)."""
    from sglang.srt.mem_cache.pool_host import mamba, mha

    pool_host_common.ALLOC_MEMORY_FUNCS["cpu"] = _cpu_host_alloc
    for module in (mha, mamba):
        module.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
        module.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf


def host_ratio(a):
    """``hicache_ratio`` giving exactly ``--host-capacity-pages`` host Full pages: SGLang
    sizes a host pool as ``int(device_tokens * ratio) // P + 1`` pages (the last one its
    padding page, usable like the others)."""
    p = a.page_size
    return ((a.host_capacity_pages - 1) * p + p / 2) / (a.capacity_pages * p)


def server_fields(a):
    """The ServerArgs fields of the hierarchical cache (write-through, direct copies)."""
    return {
        "enable_hierarchical_cache": True,
        "hicache_ratio": host_ratio(a),
        "hicache_size": 0,
        "hicache_write_policy": "write_through",
        "hicache_io_backend": "direct",
        "hicache_mem_layout": "page_first_direct",
    }


def derived_sizes(a):
    """(SWA host pages, Mamba host slots) SGLang derives from the one ratio."""
    r = host_ratio(a)
    swa = int(a.swa_capacity_pages * a.page_size * r) // a.page_size + 1
    mamba = int(a.mamba_slots * r) + 1
    return swa, mamba


def attach(cache, params, a):
    """SGLang's own ``init_hicache`` on the built cache, then a check that its host pools
    have the sizes the options name."""
    cache.init_hicache(get_server_args(), params)
    group = cache.host_pool_group
    sizes = {e.name.value: e.host_pool.size for e in group.entries}
    want = {"kv": a.host_capacity_pages * a.page_size}
    if "swa" in a.components:
        want["swa"] = a.swa_host_capacity_pages * a.page_size
    if "mamba" in a.components:
        want["mamba"] = a.host_mamba_slots
    for name, n in want.items():
        if sizes.get(name) != n:
            swa, mamba = derived_sizes(a)
            raise SystemExit(
                f"SGLang's {name} host pool holds {sizes.get(name)} (wanted {n}); with one "
                f"hicache_ratio it derives --swa-host-capacity-pages {swa} "
                f"--host-mamba-slots {mamba} from --host-capacity-pages "
                f"{a.host_capacity_pages}"
            )


class HostRecorder:
    """Counts host evictions per component: every host eviction goes through the tree
    core's ``drive_host_eviction`` (wrapped on the instance; the class is untouched), whose
    result tracks what it freed per component, cascades included (host Full tokens, host
    SWA tokens, host Mamba states)."""

    def __init__(self, cache):
        self.ev = {ComponentType.FULL: 0, ComponentType.SWA: 0, ComponentType.MAMBA: 0}
        core = cache.tree_core
        drive = core.drive_host_eviction

        def counted(component_type, num_tokens):
            result = drive(component_type, num_tokens)
            for ct, n in result.tracker.items():
                if ct in self.ev:
                    self.ev[ct] += n
            return result

        core.drive_host_eviction = counted

    def start(self):
        for k in self.ev:
            self.ev[k] = 0


def complete_loads(cache):
    """Starts the queued host-to-device copies and retires every finished one."""
    cache.ready_to_load_host_cache()
    cc = cache.cache_controller
    cache.loading_check(finish_count=len(cc.ack_load_queue))


def complete_writes(cache):
    """Starts the queued device-to-host backups and retires all of them (SGLang's own
    blocking ``writing_check(write_back=True)``)."""
    cache.writing_check(write_back=True)
