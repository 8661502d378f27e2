"""HiCacheRsStorage with the KV layouts beyond plain pages, against SGLang's own code:
``page_head`` pools shared head for head between instances of different TP sizes
(``tp_lcm_size``), asymmetric K/V head dims, and decode-side offload in PD disaggregation.

SGLang's own parts: its host pools (``MHATokenToKVPoolHost`` with layout ``page_head``,
``AsymmetricMHATokenToKVPoolHost``), its extra-config parser and storage backend factory, its
cache controller's storage config (``_generate_storage_config``: where ``tp_lcm_size`` is
popped and ``should_split_heads`` decided), its split-heads page meta, its page hashes, its
``HiCacheController`` with its backup thread and its ``DecodeKVCacheOffloadManager`` methods.
What is replaced, and why, is said where it happens: the GPU copies (no GPU here), the TP
process group (the ranks of one instance are separate objects in one process), the scheduler.
"""

import json
import threading
import types
from weakref import WeakKeyDictionary

import pytest

from conftest import require_sglang

require_sglang()

import torch  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import hicache_rs  # noqa: E402
from hicache_rs.sglang import HiCacheRsStorage  # noqa: E402
from sglang_pools import (  # noqa: E402
    CPU,
    Allocator,
    DevicePool,
    mha_pool,
    same,
    storage_config,
)

TIMEOUT = 120
DYNAMIC = {
    "backend_name": "hicache_rs",
    "module_path": "hicache_rs.sglang",
    "class_name": "HiCacheRsStorage",
    "interface_v1": 1,
}
# The model: 4 KV heads in all, head dim 8, 3 layers, pages of 4 tokens.
GLOBAL_HEADS, PS, LAYERS, DIM = 4, 4, 3, 8


def keys(n, start=0):
    return hicache_rs.sglang_page_hashes(list(range(start, start + n * PS)), PS)


def set_parallel(tp_rank=0, tp_size=1):
    runtime_context.get_parallel().override_permanently(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_dcp_rank=0, attn_dcp_size=1
    )


@pytest.fixture(autouse=True)
def single_rank_afterwards():
    yield
    set_parallel()


class ControllerView:
    """What SGLang's ``HiCacheController._generate_storage_config`` reads from its controller:
    the host pool (its layout), the device pool (MLA or not: MHA here) and the CP group (none).
    The rest of a controller (GPU streams, threads) is not needed to build the config."""

    def __init__(self, pool):
        self.mem_pool_host = pool
        self.storage_host_pool = pool
        self.mem_pool_device = object()
        self.enable_storage_metrics = False
        self.page_size = pool.page_size

    def get_attn_cp_rank_and_size(self):
        return 0, 1


def sglang_config(pool, ours, tp_rank, tp_size):
    """The storage config exactly as SGLang builds it for TP rank ``tp_rank`` of ``tp_size``:
    its extra-config parser, then its cache controller's ``_generate_storage_config`` (which
    pops ``tp_lcm_size`` and decides ``should_split_heads``)."""
    from sglang.srt.managers.cache_controller import HiCacheController

    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(
        json.dumps({**DYNAMIC, **ours})
    )
    set_parallel(tp_rank, tp_size)
    return HiCacheController._generate_storage_config(ControllerView(pool), "org/model", extra)


def open_backend(config, pool):
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def tp_instance(tp_size, ours):
    """One instance of TP ``tp_size``: a page_head host pool and a backend per rank, each
    rank holding its ``GLOBAL_HEADS / tp_size`` KV heads (the ranks of a real instance are
    processes; here they are objects in one process, sharing the backend's storage)."""
    ranks = []
    for r in range(tp_size):
        pool = mha_pool("page_head", layers=LAYERS, heads=GLOBAL_HEADS // tp_size,
                        head_dim=DIM, page_size=PS)
        cfg = sglang_config(pool, ours, r, tp_size)
        ranks.append((open_backend(cfg, pool), pool))
    return ranks


def global_pages(n, seed):
    """``n`` pages of the whole model, every head: ``[K|V][head][token][layer][dim]``."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-2**15, 2**15, (2, GLOBAL_HEADS, PS, LAYERS, DIM), generator=g,
                      dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        for _ in range(n)
    ]


def rank_heads(tp_rank, tp_size):
    """The KV heads SGLang gives TP rank ``tp_rank`` of ``tp_size`` (heads >= ranks)."""
    per = GLOBAL_HEADS // tp_size
    return slice(tp_rank * per, (tp_rank + 1) * per)


def write_rank(backend, pool, tp_rank, tp_size, ks, pages):
    """Puts this rank's heads of ``pages`` into its host pool and backs them up."""
    src = pool.alloc(len(ks) * PS)
    for start, page in zip(src[::PS].tolist(), pages):
        pool.kv_buffer[:, start // PS] = page[:, rank_heads(tp_rank, tp_size)]
    assert backend.batch_set_v1(ks, src) == [True] * len(ks)


def check_rank_reads(backend, pool, tp_rank, tp_size, ks, pages):
    """This rank finds every page and reads exactly its own heads of it, into other slots."""
    pool.alloc(3 * PS)  # different host slots than any writer used
    dst = pool.alloc(len(ks) * PS)
    assert backend.batch_exists(ks) == len(ks)
    assert backend.batch_get_v1(ks, dst) == [True] * len(ks)
    for start, page in zip(dst[::PS].tolist(), pages):
        assert same(pool.kv_buffer[:, start // PS], page[:, rank_heads(tp_rank, tp_size)])


@pytest.fixture(params=["file-shared", "redis"])
def shared_ours(request, tmp_path):
    """A backend several instances share: the file backend in `shared` mode (one directory,
    many openers) or a real redis-server (the memory backend is per store, not shared)."""
    if request.param == "redis":
        return {"backend": "redis", "nodes": [request.getfixturevalue("redis_server")],
                "cluster": False, "key_prefix": f"kv{id(tmp_path)}:"}
    return {"backend": "file", "dir": str(tmp_path / "l3"), "shared": True}


@pytest.mark.parametrize("writer_tp,reader_tp", [(2, 4), (4, 2)])
def test_page_head_pages_are_shared_head_for_head_across_tp_sizes(writer_tp, reader_tp,
                                                                  shared_ours):
    ours = {**shared_ours, "tp_lcm_size": 4}
    writers = tp_instance(writer_tp, ours)
    readers = tp_instance(reader_tp, ours)
    # SGLang's controller popped tp_lcm_size and split only the smaller TP's pages.
    for backend, _ in writers + readers:
        cfg = backend.storage_config
        assert "tp_lcm_size" not in cfg.extra_config and cfg.tp_lcm_size == 4
        assert cfg.should_split_heads == (cfg.tp_size < 4)
    # The stored parts are named by global head slice, never by this instance's TP size:
    # the TP-2 ranks' slices are the TP-4 ranks' pages, in rank order.
    tp2 = writers if writer_tp == 2 else readers
    tp4 = writers if writer_tp == 4 else readers
    assert [ns for b, _ in tp2 for ns in b.namespaces] == [b.namespace for b, _ in tp4]

    ks = keys(5)
    pages = global_pages(5, seed=3)
    for r, (backend, pool) in enumerate(writers):
        write_rank(backend, pool, r, writer_tp, ks, pages)
    for r, (backend, pool) in enumerate(readers):
        check_rank_reads(backend, pool, r, reader_tp, ks, pages)
    for backend, _ in writers + readers:
        backend.close()


def test_a_page_head_page_is_present_only_when_all_its_slices_are(tmp_path):
    ours = {"backend": "file", "dir": str(tmp_path / "l3"), "shared": True, "tp_lcm_size": 4}
    writers = tp_instance(4, ours)
    (r0, p0), (r1, p1) = tp_instance(2, ours)
    ks = keys(3)
    pages = global_pages(3, seed=5)
    # TP-4 ranks 0, 1 and 2 write; rank 3 (global slice 3) does not.
    for r, (backend, pool) in enumerate(writers[:3]):
        write_rank(backend, pool, r, 4, ks, pages)
    # TP-2 rank 0 needs slices 0 and 1: present. Rank 1 needs 2 and 3: absent, not half read.
    assert r0.batch_exists(ks) == 3
    assert r1.batch_exists(ks) == 0
    dst = p1.alloc(3 * PS)
    assert r1.batch_get_v1(ks, dst) == [False] * 3
    # Rank 3 writes its slice of the first two pages only: two leading pages now.
    write_rank(*writers[3], 3, 4, ks[:2], pages[:2])
    assert r1.batch_exists(ks) == 2
    assert r1.batch_get_v1(ks, dst) == [True, True, False]
    for start, page in zip(dst[::PS].tolist()[:2], pages):
        assert same(p1.kv_buffer[:, start // PS], page[:, rank_heads(1, 2)])
    for b, _ in writers + [(r0, p0), (r1, p1)]:
        b.close()


def test_page_head_without_tp_lcm_size_is_one_part_per_rank_and_meets_a_split_writer(tmp_path):
    """A TP-4 instance without ``tp_lcm_size`` stores whole rank pages as global slice
    ``rank`` of 4: the same objects a TP-2 writer with ``tp_lcm_size`` 4 splits into."""
    base = {"backend": "file", "dir": str(tmp_path / "l3"), "shared": True}
    writers = tp_instance(2, {**base, "tp_lcm_size": 4})
    readers = tp_instance(4, base)
    for backend, _ in readers:
        assert backend.storage_config.tp_lcm_size is None and len(backend.namespaces) == 1
    ks = keys(2, start=100)
    pages = global_pages(2, seed=9)
    for r, (backend, pool) in enumerate(writers):
        write_rank(backend, pool, r, 2, ks, pages)
    for r, (backend, pool) in enumerate(readers):
        check_rank_reads(backend, pool, r, 4, ks, pages)
    for b, _ in writers + readers:
        b.close()


def test_page_head_legacy_tensor_methods_share_pages_with_zero_copy(tmp_path):
    """SGLang's generic path (no interface_v1) hands flat data pages; they are cut into the
    same head slices, so the two paths read each other's pages."""
    ours = {"backend": "file", "dir": str(tmp_path / "l3"), "shared": True, "tp_lcm_size": 4}
    (b0, p0), (b1, p1) = tp_instance(2, ours)
    ks = keys(2, start=50)
    pages = global_pages(2, seed=13)
    write_rank(b0, p0, 0, 2, ks, pages)
    # Rank 1 writes through the legacy path, one flat data page per key.
    flats = [page[:, rank_heads(1, 2)].contiguous().flatten() for page in pages]
    assert b1.batch_set(ks, flats)
    # A TP-4 rank 3 reads its head (slice 3) through zero copy.
    readers = tp_instance(4, ours)
    check_rank_reads(*readers[3], 3, 4, ks, pages)
    # Rank 0 reads its flat pages back through the legacy path.
    got = b0.batch_get(ks)
    assert all(same(g, page[:, rank_heads(0, 2)].flatten()) for g, page in zip(got, pages))
    assert b1.exists(ks[0]) and not b1.exists(keys(1, start=999)[0])
    for b, _ in [(b0, p0), (b1, p1)] + readers:
        b.close()


def test_page_head_bad_configurations_are_clear_errors(tmp_path):
    ours = {"backend": "file", "dir": str(tmp_path / "l3"), "shared": True}
    pool = mha_pool("page_head", heads=2, page_size=PS)
    # tp_lcm_size not a multiple of tp_size. SGLang's controller asserts this itself; a
    # config built another way (tp_lcm_size set directly, or left in the extra-config) is
    # refused by us, naming both numbers.
    cfg = storage_config({**DYNAMIC, **ours}, layout="page_head", tp=(0, 2),
                         model="org/model")
    cfg.tp_lcm_size = 3
    with pytest.raises(ValueError, match="tp_lcm_size 3 is not a multiple of .* tp_size 2"):
        open_backend(cfg, pool)
    cfg = storage_config({**DYNAMIC, **ours, "tp_lcm_size": 3}, layout="page_head", tp=(1, 2),
                         model="org/model")
    with pytest.raises(ValueError, match="tp_lcm_size 3 is not a multiple"):
        open_backend(cfg, mha_pool("page_head", heads=2, page_size=PS))
    cfg = storage_config({**DYNAMIC, **ours, "tp_lcm_size": "4"}, layout="page_head", tp=(1, 2),
                         model="org/model")
    with pytest.raises(ValueError, match="tp_lcm_size.*positive integer"):
        open_backend(cfg, mha_pool("page_head", heads=2, page_size=PS))
    # tp_lcm_size left in the extra-config is honoured, not refused as an unknown field:
    # the same namespaces as SGLang's own path.
    cfg = storage_config({**DYNAMIC, **ours, "tp_lcm_size": 4}, layout="page_head", tp=(1, 2),
                         model="org/model")
    direct = open_backend(cfg, mha_pool("page_head", heads=2, page_size=PS))
    via_sglang = open_backend(
        sglang_config(pool, {**ours, "tp_lcm_size": 4}, 1, 2),
        mha_pool("page_head", heads=2, page_size=PS),
    )
    assert direct.namespaces == via_sglang.namespaces and len(direct.namespaces) == 2
    # Heads that do not split into tp_lcm_size / tp_size slices.
    cfg = sglang_config(pool, {**ours, "tp_lcm_size": 8}, 0, 2)
    with pytest.raises(ValueError, match="2 KV heads on this rank do not split into 4"):
        open_backend(cfg, mha_pool("page_head", heads=2, page_size=PS))
    # Sharing slices between instances needs storage they share.
    cfg = sglang_config(pool, {"backend": "file", "dir": str(tmp_path / "own"),
                               "tp_lcm_size": 4}, 0, 2)
    with pytest.raises(ValueError, match='"shared": true'):
        open_backend(cfg, mha_pool("page_head", heads=2, page_size=PS))
    direct.close()
    via_sglang.close()


def test_page_head_bad_host_indices_write_nothing(tmp_path):
    ours = {"backend": "file", "dir": str(tmp_path / "l3"), "shared": True, "tp_lcm_size": 4}
    (b0, p0), (b1, p1) = tp_instance(2, ours)
    ks = keys(2, start=300)
    n = p0.size
    for bad in (torch.arange(n - PS, n + PS),            # past the pool's end
                torch.arange(1, 1 + 2 * PS),             # not page-aligned
                torch.arange(0, 2 * PS).flip(0),         # a page's run broken
                torch.arange(0, PS)):                    # too few for two keys
        with pytest.raises(ValueError):
            b0.batch_set_v1(ks, bad)
        with pytest.raises(ValueError):
            b0.batch_get_v1(ks, bad)
    assert b0.batch_exists(ks) == 0
    for b in (b0, b1):
        b.close()


# ---- asymmetric K/V head dims -------------------------------------------------------------


def asym_pool(layout, heads=2, k_dim=12, v_dim=4, device_tokens=64):
    """SGLang's AsymmetricMHATokenToKVPoolHost over CPU 'device' buffers."""
    k = tuple(torch.zeros(device_tokens + PS, heads, k_dim, dtype=torch.bfloat16)
              for _ in range(LAYERS))
    v = tuple(torch.zeros(device_tokens + PS, heads, v_dim, dtype=torch.bfloat16)
              for _ in range(LAYERS))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=PS, head_num=heads, head_dim=k_dim, v_head_dim=v_dim,
        dtype=torch.bfloat16, device=CPU,
    )
    pool = AsymmetricMHATokenToKVPoolHost(
        info, 2.0, 0, PS, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=LAYERS,
    )
    pool._test_device_buffers = (k, v)
    return pool


def asym_page(pool, start):
    """The K and V views of the page starting at token slot ``start``."""
    if pool.layout == "page_first":
        return pool.k_buffer[start:start + PS], pool.v_buffer[start:start + PS]
    return pool.k_buffer[start // PS], pool.v_buffer[start // PS]


def fill_random(t, g):
    t.view(torch.int16).copy_(
        torch.randint(-2**15, 2**15, t.shape, generator=g, dtype=torch.int32).to(torch.int16))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("backend_name", ["memory", "file", "redis"])
def test_asymmetric_kv_round_trip(layout, backend_name, tmp_path, request):
    ours = {
        "memory": {"backend": "memory"},
        "file": {"backend": "file", "dir": str(tmp_path / "l3")},
    }.get(backend_name)
    if backend_name == "redis":
        ours = {"backend": "redis", "nodes": [request.getfixturevalue("redis_server")],
                "cluster": False, "key_prefix": f"a{id(tmp_path)}:"}
    pool = asym_pool(layout)
    backend = open_backend(sglang_config(pool, ours, 0, 1), pool)
    # Both buffers are the memory the native store may touch (listed by address).
    assert backend._store.allowed_regions == sorted(
        (b.data_ptr(), b.numel() * b.element_size()) for b in (pool.k_buffer, pool.v_buffer)
    )
    assert backend.page_bytes == PS * LAYERS * 2 * (12 + 4) * 2
    g = torch.Generator().manual_seed(21)
    src = pool.alloc(4 * PS)
    written = []
    for start in src[::PS].tolist():
        k, v = asym_page(pool, start)
        fill_random(k, g)
        fill_random(v, g)
        written.append((k.clone(), v.clone()))
    ks = keys(5, start=400)
    assert backend.batch_set_v1(ks[:4], src) == [True] * 4
    assert backend.batch_exists(ks) == 4
    dst = pool.alloc(5 * PS)
    assert backend.batch_get_v1(ks, dst) == [True] * 4 + [False]
    for start, (k, v) in zip(dst[::PS].tolist(), written):
        gk, gv = asym_page(pool, start)
        assert same(gk, k) and same(gv, v)
    # SGLang's asymmetric pool has no flat data page, so the legacy path says what to use.
    with pytest.raises(ValueError, match="interface_v1"):
        backend.batch_get(ks[:1])
    # Bad indices: refused before any pointer exists, nothing written.
    with pytest.raises(ValueError, match="outside the host pool"):
        backend.batch_set_v1(keys(1, start=900), torch.arange(pool.size, pool.size + PS))
    assert backend.batch_exists(keys(1, start=900)) == 0
    backend.close()


def test_asymmetric_namespaces_carry_both_head_dims():
    sym = mha_pool("page_first", layers=LAYERS, heads=2, head_dim=8, page_size=PS)
    a = asym_pool("page_first", k_dim=12, v_dim=4)
    b = asym_pool("page_first", k_dim=4, v_dim=12)
    backends = [open_backend(sglang_config(p, {"backend": "memory"}, 0, 1), p)
                for p in (sym, a, b)]
    # Same bytes per page (2 heads x (8 + 8) = 2 heads x (12 + 4)), three namespaces.
    assert len({x.page_bytes for x in backends}) == 1
    assert len({x.namespace for x in backends}) == 3
    for x in backends:
        x.close()


# ---- decode-side offload in PD disaggregation ---------------------------------------------


class Done:
    """A finished device event: the stand-in for the CUDA event of a device-to-host copy."""

    def synchronize(self):
        pass


def put_rows(pool, host_indices, layer, k_rows, v_rows):
    """Token rows (``[token, head, dim]``) of one layer into the host pool's slots, in
    ``page_first`` (SGLang's per-layer views) or ``page_head`` (``[K|V][page][head][token]
    [layer][dim]``)."""
    if pool.layout == "page_head":
        pages, toks = host_indices // pool.page_size, host_indices % pool.page_size
        pool.kv_buffer[0, pages, :, toks, layer, :] = k_rows
        pool.kv_buffer[1, pages, :, toks, layer, :] = v_rows
    else:
        pool.k_data_refs[layer][host_indices] = k_rows
        pool.v_data_refs[layer][host_indices] = v_rows


def get_rows(pool, host_indices, layer):
    """The inverse of :func:`put_rows`: ``(k_rows, v_rows)`` of one layer."""
    if pool.layout == "page_head":
        pages, toks = host_indices // pool.page_size, host_indices % pool.page_size
        return (pool.kv_buffer[0, pages, :, toks, layer, :],
                pool.kv_buffer[1, pages, :, toks, layer, :])
    return pool.k_data_refs[layer][host_indices], pool.v_data_refs[layer][host_indices]


def cpu_device_to_host(cc, pool):
    """Replaces the controller's ``start_writing`` (a GPU kernel copying device KV into the
    host pool) with the same copy on the CPU: each layer's K and V rows of the device indices
    into the host pool's rows of the host indices, then the ack SGLang's copy would post."""

    def start_writing():
        dev_k, dev_v = pool._test_device_buffers
        node_ids = []
        for op in cc.write_queue:
            for layer in range(pool.layer_num):
                put_rows(pool, op.host_indices, layer, dev_k[layer][op.device_indices],
                         dev_v[layer][op.device_indices])
            node_ids.extend(op.node_ids)
        cc.write_queue.clear()
        from sglang.srt.managers.cache_controller import HiCacheAck

        cc.ack_write_queue.append(HiCacheAck(Done(), Done(), node_ids))

    cc.start_writing = start_writing


class Req:
    """The fields of SGLang's ``Req`` the offload manager reads."""

    def __init__(self, rid, prompt, output, req_pool_idx):
        self.rid = rid
        self.origin_input_ids = prompt
        self.output_ids = output
        self.extra_key = None
        self.cache_salt = None
        self.kv = types.SimpleNamespace(req_pool_idx=req_pool_idx)

    def finished(self):
        return False


def decode_offload_manager(cc, pool, req_to_token):
    """SGLang's ``DecodeKVCacheOffloadManager`` without its constructor (which needs a TP
    process group, the server's global args and a GPU KV pool): the attributes its offload
    and backup methods read, set as its constructor sets them for one rank."""
    from sglang.srt.disaggregation.decode_kvcache_offload_manager import (
        DecodeKVCacheOffloadManager,
    )

    m = object.__new__(DecodeKVCacheOffloadManager)
    m.page_size = pool.page_size
    m.offload_stride = pool.page_size
    m.request_counter = 0
    m.tp_world_size = 1
    m.cache_controller = cc
    m.decode_host_mem_pool = pool
    m.kv_cache = object()  # not a UnifiedSWAKVPool: no sidecar transfers
    m.req_to_token_pool = types.SimpleNamespace(req_to_token=req_to_token)
    m.ongoing_offload = {}
    m.ongoing_backup = {}
    m.offloaded_state = WeakKeyDictionary()
    m.offload_inflight = WeakKeyDictionary()
    return m


def prefill_controller(pool, raw):
    """A prefill instance's real HybridCacheController over ``pool`` (the KV pool alone) and
    the extra-config ``raw`` (JSON), as SGLang builds it."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    return HybridCacheController(
        Allocator(DevicePool(LAYERS)),
        HostPoolGroup([PoolEntry(name=PoolName.KV, host_pool=pool, device_pool=None,
                                 layer_mapper=lambda i: i, is_primary_index_anchor=True)]),
        PS, tp_group=None, load_cache_event=threading.Event(), io_backend="direct",
        storage_backend="dynamic", prefetch_threshold=PS, model_name="org/model",
        storage_backend_extra_config=HybridCacheController.parse_storage_backend_extra_config(
            raw)[0],
    )


def test_decode_side_offload_pages_are_hits_for_a_later_prefill(tmp_path):
    """PD disaggregation: a prefill instance backs up the prompt's whole pages; the decode
    instance (``--disaggregation-decode-enable-offload-kvcache``) offloads what it generated
    (the prompt's partial last page and the output), continuing SGLang's hash chain; a later
    prefill on another instance, for the next turn (prompt + output), hits all of it."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    set_parallel()
    ours = {"backend": "file", "dir": str(tmp_path / "l3"), "shared": True}
    # The decode side reads the extra-config with json.loads, not SGLang's parser: SGLang's
    # own prefetch fields stay in it and must not trip our strict parsing.
    raw = json.dumps({**DYNAMIC, **ours, "prefetch_threshold": PS,
                      "hicache_storage_pass_prefix_keys": False})

    prompt = list(range(1000, 1000 + 2 * PS + 2))       # 2 whole pages and 2 tokens
    output = list(range(5000, 5000 + 2 * PS + 2))       # the last output has no KV yet
    all_tokens = prompt + output[:-1]                   # 4 whole pages and 3 tokens

    # The "device" KV of the decode instance: every token's K and V per layer, random.
    dpool = mha_pool("page_first", layers=LAYERS, heads=2, head_dim=DIM, page_size=PS,
                     device_tokens=256)
    dev_k, dev_v = dpool._test_device_buffers
    g = torch.Generator().manual_seed(31)
    for t in (*dev_k, *dev_v):
        fill_random(t, g)
    req_to_token = torch.zeros((1, 64), dtype=torch.int32)
    req_to_token[0, : len(all_tokens)] = torch.arange(10, 10 + len(all_tokens))

    # 1. The prefill instance backed up the prompt's whole pages (its own KV: the same
    #    tokens, so the same rows the decode instance received over the PD transfer).
    ppool = mha_pool("page_first", layers=LAYERS, heads=2, head_dim=DIM, page_size=PS,
                     device_tokens=256)
    prefill = prefill_controller(ppool, raw)
    decode = None
    try:
        host = ppool.alloc(2 * PS)
        for layer in range(LAYERS):
            put_rows(ppool, host, layer, dev_k[layer][10:10 + 2 * PS],
                     dev_v[layer][10:10 + 2 * PS])
        prompt_hashes = get_storage_hash_str(prompt[: 2 * PS], None, page_size=PS)
        prefill.write_storage(host, prompt[: 2 * PS], hash_value=prompt_hashes)
        assert prefill.ack_backup_queue.get(timeout=TIMEOUT).completed_tokens == 2 * PS

        # 2. The decode instance: SGLang's HiCacheController as the offload manager builds it.
        decode = HiCacheController(
            token_to_kv_pool_allocator=Allocator(DevicePool(LAYERS)), mem_pool_host=dpool,
            page_size=PS, tp_group=None, io_backend="direct",
            load_cache_event=threading.Event(), storage_backend="dynamic",
            model_name="org/model", storage_backend_extra_config=json.loads(raw),
        )
        assert isinstance(decode.storage_backend, HiCacheRsStorage)
        assert decode.page_set_func.__name__ == "_page_set_zero_copy"
        cpu_device_to_host(decode, dpool)
        manager = decode_offload_manager(decode, dpool, req_to_token)
        req = Req("r1", prompt, output, req_pool_idx=0)
        # SGLang's offload: the incremental part after the prompt's page-aligned prefix.
        assert manager.offload_kv_cache(req)
        manager.check_offload_progress()  # the D2H ack: triggers the storage backup
        op = decode.ack_backup_queue.get(timeout=TIMEOUT)
        assert op.completed_tokens == 2 * PS
        decode_hashes = op.hash_value
        decode.ack_backup_queue.put(op)
        manager.check_offload_progress()  # the backup ack: host pages freed
        assert not manager.ongoing_backup
        # SGLang's chain: continued from the last prompt page's hash.
        assert prompt_hashes + decode_hashes == get_storage_hash_str(
            all_tokens[: 4 * PS], None, page_size=PS)

        # 3. A later prefill on another instance (a fresh controller and backend, the same
        #    storage), for the next turn: its hit query finds all four pages.
        later_pool = mha_pool("page_first", layers=LAYERS, heads=2, head_dim=DIM,
                              page_size=PS, device_tokens=256)
        later = prefill_controller(later_pool, raw)
        try:
            next_turn = all_tokens + [output[-1]] + list(range(9000, 9000 + PS))
            later.prefetch(CacheRequestHandle(rid="r2", attempt_id=0), next_turn, None)
            pop = later.prefetch_hit_queue.get(timeout=TIMEOUT)
            assert pop.storage_hit_count == 4 * PS
            assert pop.hash_value == prompt_hashes + decode_hashes
            # The scheduler's part: host pages for the hit; the I/O thread reads into them.
            dst = later_pool.alloc(pop.storage_hit_count)
            pop.host_indices = dst
            later.prefetch_buffer.put(pop)
            acks = []
            while not acks or not acks[-1].completed_req:
                acks.append(later.ack_prefetch_queue.get(timeout=TIMEOUT))
            assert sum(a.completed_tokens or 0 for a in acks) == 4 * PS
            # Token for token, layer for layer: the decode instance's device KV.
            rows = torch.arange(10, 10 + 4 * PS)
            for layer in range(LAYERS):
                k, v = get_rows(later_pool, dst, layer)
                assert same(k, dev_k[layer][rows]) and same(v, dev_v[layer][rows])
        finally:
            later.detach_storage_backend()
    finally:
        prefill.detach_storage_backend()
        if decode is not None:
            decode.detach_storage_backend()


def test_decode_offload_with_page_head_is_hit_by_a_prefill_of_another_tp_size(tmp_path):
    """The PD pair of heterogeneous TP: a TP-4 prefill instance and a TP-2 decode instance,
    ``page_head`` with ``tp_lcm_size`` 4. The decode ranks (SGLang's controller and offload
    manager, one per rank) offload their generated pages; a later TP-4 prefill finds the
    prompt's and the decode's pages and reads each of its heads, token for token."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    ours = {"backend": "file", "dir": str(tmp_path / "l3"), "shared": True, "tp_lcm_size": 4}
    raw = json.dumps({**DYNAMIC, **ours, "prefetch_threshold": PS})
    prompt = list(range(2000, 2000 + 2 * PS + 1))
    output = list(range(7000, 7000 + 2 * PS + 1))
    all_tokens = prompt + output[:-1]                   # 4 whole pages and 1 token
    rows = torch.arange(10, 10 + 4 * PS)
    # The whole model's "device" KV per layer, every head; each rank holds its heads of it.
    g = torch.Generator().manual_seed(41)
    model_k = [torch.zeros(64, GLOBAL_HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    model_v = [torch.zeros(64, GLOBAL_HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    for t in (*model_k, *model_v):
        fill_random(t, g)

    # 1. The TP-4 prefill instance backed up the prompt's two whole pages.
    prompt_hashes = get_storage_hash_str(prompt[: 2 * PS], None, page_size=PS)
    for r, (backend, pool) in enumerate(tp_instance(4, ours)):
        host = pool.alloc(2 * PS)
        for layer in range(LAYERS):
            put_rows(pool, host, layer, model_k[layer][rows[: 2 * PS], rank_heads(r, 4)],
                     model_v[layer][rows[: 2 * PS], rank_heads(r, 4)])
        assert backend.batch_set_v1(prompt_hashes, host) == [True, True]
        backend.close()

    # 2. The TP-2 decode instance, rank by rank: SGLang's controller (its config pops
    #    tp_lcm_size from the extra-config it json.loads) and offload manager.
    decode_hashes = None
    controllers = []
    try:
        for r in range(2):
            dpool = mha_pool("page_head", layers=LAYERS, heads=2, head_dim=DIM, page_size=PS,
                             device_tokens=256)
            dev_k, dev_v = dpool._test_device_buffers
            for layer in range(LAYERS):
                dev_k[layer][:64] = model_k[layer][:, rank_heads(r, 2)]
                dev_v[layer][:64] = model_v[layer][:, rank_heads(r, 2)]
            set_parallel(r, 2)
            cc = HiCacheController(
                token_to_kv_pool_allocator=Allocator(DevicePool(LAYERS)), mem_pool_host=dpool,
                page_size=PS, tp_group=None, io_backend="direct",
                load_cache_event=threading.Event(), storage_backend="dynamic",
                model_name="org/model", storage_backend_extra_config=json.loads(raw),
            )
            controllers.append(cc)
            assert cc.storage_config.should_split_heads and cc.storage_backend.plan.slices == 2
            cpu_device_to_host(cc, dpool)
            req_to_token = torch.zeros((1, 64), dtype=torch.int32)
            req_to_token[0, : len(all_tokens)] = torch.arange(10, 10 + len(all_tokens))
            manager = decode_offload_manager(cc, dpool, req_to_token)
            req = Req("r1", prompt, output, req_pool_idx=0)
            assert manager.offload_kv_cache(req)
            manager.check_offload_progress()
            op = cc.ack_backup_queue.get(timeout=TIMEOUT)
            assert op.completed_tokens == 2 * PS
            assert decode_hashes in (None, op.hash_value)  # every rank: the same chain
            decode_hashes = op.hash_value
            cc.ack_backup_queue.put(op)
            manager.check_offload_progress()
            assert not manager.ongoing_backup
    finally:
        for cc in controllers:
            cc.detach_storage_backend()
    assert prompt_hashes + decode_hashes == get_storage_hash_str(
        all_tokens[: 4 * PS], None, page_size=PS)

    # 3. A later TP-4 prefill: every rank finds the four pages and reads its own head.
    ks = prompt_hashes + decode_hashes
    for r, (backend, pool) in enumerate(tp_instance(4, ours)):
        assert backend.batch_exists(ks + keys(1, start=777)) == 4
        dst = pool.alloc(4 * PS)
        assert backend.batch_get_v1(ks, dst) == [True] * 4
        for layer in range(LAYERS):
            k, v = get_rows(pool, dst, layer)
            assert same(k, model_k[layer][rows, rank_heads(r, 4)])
            assert same(v, model_v[layer][rows, rank_heads(r, 4)])
        backend.close()


def test_page_head_slices_through_the_v2_methods(tmp_path):
    """The v2 calls on a split page_head KV pool store and read the same head slices as the
    v1 calls: TP-4 ranks write through ``batch_set_v2`` (the pool registered again through
    ``register_mem_host_pool_v2``, as SGLang's hybrid controller does), TP-2 ranks find the
    pages with ``batch_exists_v2`` and read their heads with ``batch_get_v2`` and v1 alike."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    ours = {"backend": "file", "dir": str(tmp_path / "l3"), "shared": True, "tp_lcm_size": 4}
    writers = tp_instance(4, ours)
    readers = tp_instance(2, ours)
    for backend, pool in writers + readers:
        backend.register_mem_host_pool_v2(pool, PoolName.KV)
        backend.on_host_pools_registered()
    ks = keys(3)
    pages = global_pages(3, seed=11)
    for r, (backend, pool) in enumerate(writers):
        src = pool.alloc(len(ks) * PS)
        for start, page in zip(src[::PS].tolist(), pages):
            pool.kv_buffer[:, start // PS] = page[:, rank_heads(r, 4)]
        done = backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=src, keys=ks)])
        assert done == {"kv": [True] * 3}
    for r, (backend, pool) in enumerate(readers):
        result = backend.batch_exists_v2(ks, [])
        assert result.kv_hit_pages == 3 and result.restorable_prefix_pages == [1, 2, 3]
        pool.alloc(2 * PS)
        dst = pool.alloc(len(ks) * PS)
        got = backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=dst, keys=ks)])
        assert got == {"kv": [True] * 3}
        for start, page in zip(dst[::PS].tolist(), pages):
            assert same(pool.kv_buffer[:, start // PS], page[:, rank_heads(r, 2)])
        assert backend.batch_get_v1(ks, pool.alloc(len(ks) * PS)) == [True] * 3
    for b, _ in writers + readers:
        b.close()
