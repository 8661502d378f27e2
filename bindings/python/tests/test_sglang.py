"""HiCacheRsStorage against SGLang's own code: its storage backend factory loading the class
from the extra-config (`dynamic`), its config parser, its real MHA and MLA host pools in all
three layouts, and the exact calls its cache controller makes."""

import json
import threading

import pytest

from backend_configs import ours_config
from conftest import require_sglang, start_redis

require_sglang()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import hicache_rs  # noqa: E402
from hicache_rs.sglang import HiCacheRsStorage  # noqa: E402
from sglang_pools import (  # noqa: E402
    LAYOUTS,
    fill_pages,
    make_pool,
    read_pages,
    same,
    storage_config,
)

DYNAMIC = {
    "backend_name": "hicache_rs",
    "module_path": "hicache_rs.sglang",
    "class_name": "HiCacheRsStorage",
    "interface_v1": 1,
}


def extra_config_json(**ours):
    return json.dumps({**DYNAMIC, **ours})


def create(ours, pool, mla=False, **cfg):
    """Exactly SGLang's path: its parser strips its own fields, its factory imports our class
    and calls ``cls(storage_config, {})``, its controller registers the host pool."""
    extra, *_ = HybridCacheController.parse_storage_backend_extra_config(extra_config_json(**ours))
    config = storage_config(extra, mla=mla, layout=pool.layout, **cfg)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def keys(n, start=0, page_size=4):
    return hicache_rs.sglang_page_hashes(list(range(start, start + n * page_size)), page_size)


@pytest.fixture(params=["memory", "file", "uring", "rdma", "redis"])
def ours(request, tmp_path):
    # A real redis-server / an in-process hicache-rdma-server on loopback (TCP); each test its
    # own redis key prefix.
    return ours_config(request.param, request, tmp_path, subdir="l3", uring_capacity="256MiB",
                       grow="4MiB")


def test_the_factory_loads_our_class_from_the_extra_config(ours):
    pool = make_pool("mha", "page_first")
    backend = create(ours, pool)
    assert type(backend) is HiCacheRsStorage
    assert isinstance(backend, HiCacheStorage)
    assert backend.backend_name == ours["backend"]
    backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_zero_copy_round_trip_through_real_host_pools(kind, layout, ours):
    pool = make_pool(kind, layout)
    backend = create(ours, pool, mla=kind == "mla")
    ps = pool.page_size
    src = pool.alloc(6 * ps)
    dst = pool.alloc(8 * ps)
    written = fill_pages(pool, src, seed=1)
    ks = keys(8)
    # The backup thread: one batch_set_v1 per batch, all(result) is the ack.
    assert backend.batch_set_v1(ks[:6], src) == [True] * 6
    # The prefetch query thread: leading run of present pages.
    assert backend.batch_exists(ks) == 6
    assert backend.batch_exists(ks[1:]) == 5
    assert backend.batch_exists(ks[6:]) == 0
    # The prefetch I/O thread: pages land in place in other host slots.
    got = backend.batch_get_v1(ks, dst)
    assert got == [True] * 6 + [False] * 2
    assert all(same(a, b) for a, b in zip(read_pages(pool, dst)[:6], written))
    # Setting again is idempotent and successful.
    assert backend.batch_set_v1(ks[:6], src) == [True] * 6
    backend.close()


def test_prefix_keys_from_sglangs_extra_info_reach_the_backend():
    """With ``hicache_storage_pass_prefix_keys`` SGLang's controller passes each batch's
    prefix keys in ``HiCacheStorageExtraInfo``; the Rust backend receives them (and the extra
    info, as JSON) with every call, and nothing when SGLang passes none."""
    pool = make_pool("mha", "page_first")
    # SGLang's parser takes its own flag out; the memory backend records what it receives.
    backend = create(
        {"backend": "memory", "record_contexts": True, "hicache_storage_pass_prefix_keys": True},
        pool,
    )
    store = backend._store
    ps = pool.page_size
    src = pool.alloc(3 * ps)
    fill_pages(pool, src, seed=5)
    chain = keys(6, start=5000)
    prefix, ks = chain[:3], chain[3:]
    info = HiCacheStorageExtraInfo(prefix_keys=list(prefix), extra_info={"rid": "r1"})
    assert backend.batch_set_v1(ks, src, info) == [True] * 3
    assert backend.batch_exists(ks, info) == 3
    dst = pool.alloc(3 * ps)
    assert backend.batch_get_v1(ks, dst, info) == [True] * 3
    seen = store.contexts_seen()
    assert [c["op"] for c in seen] == ["batch_set", "batch_exists", "batch_get"]
    for c in seen:
        assert c["keys"] == ks
        assert c["prefix_keys"] == prefix
        assert json.loads(c["extra_info"]) == {"rid": "r1"}
    # A batch at the start of a request: an empty prefix arrives as one.
    assert backend.batch_exists(prefix, HiCacheStorageExtraInfo(prefix_keys=[])) == 0
    assert store.contexts_seen()[0]["prefix_keys"] == []
    # Without the flag SGLang passes no prefix keys (None, or `(None,)` in some versions):
    # nothing reaches the backend, and the answers are the same.
    for none in (None, HiCacheStorageExtraInfo(prefix_keys=None), HiCacheStorageExtraInfo(prefix_keys=(None,))):
        assert backend.batch_exists(ks, none) == 3
        assert backend.batch_get_v1(ks, dst, none) == [True] * 3
    assert store.contexts_seen() == []
    # A prefix key that is not a page hash is bad input, named.
    with pytest.raises(ValueError, match="prefix key 1"):
        backend.batch_exists(ks, HiCacheStorageExtraInfo(prefix_keys=[prefix[0], "zz"]))
    backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_legacy_tensor_methods_share_pages_with_zero_copy(kind, layout, ours):
    pool = make_pool(kind, layout)
    backend = create(ours, pool, mla=kind == "mla")
    ps = pool.page_size
    a = pool.alloc(3 * ps)
    written = fill_pages(pool, a, seed=2)
    ks = keys(4, start=1000)
    # SGLang's generic set path: flat data pages (copies) from get_data_page.
    data = [pool.get_data_page(a[i * ps]) for i in range(3)]
    assert backend.batch_set(ks[:3], data) is True
    assert backend.exists(ks[0]) and not backend.exists(ks[3])
    # ... read back through the zero-copy path into other slots.
    b = pool.alloc(3 * ps)
    assert backend.batch_get_v1(ks[:3], b) == [True] * 3
    assert all(same(x, y) for x, y in zip(read_pages(pool, b), written))
    # SGLang's generic get path: dummy flat pages, then set_from_flat_data_page.
    dummies = [pool.get_dummy_flat_data_page() for _ in ks]
    pages = backend.batch_get(ks, dummies)
    assert pages[3] is None
    assert all(same(p, w) for p, w in zip(pages[:3], written))
    assert same(backend.get(ks[1]), written[1])
    assert backend.get(ks[3]) is None
    assert backend.set(ks[3], written[0]) is True
    assert backend.batch_exists(ks) == 4
    backend.close()


def test_mla_non_writer_rank_writes_nothing():
    pool = make_pool("mla", "page_first")
    backend = create({"backend": "memory"}, pool, mla=True, tp=(1, 2))
    assert not backend.storage_config.is_storage_writer
    idx = pool.alloc(2 * pool.page_size)
    fill_pages(pool, idx, seed=3)
    ks = keys(2)
    assert backend.batch_set_v1(ks, idx) == [True, True]
    assert backend.batch_set(ks, [pool.get_data_page(idx[0])] * 2) is True
    assert backend.batch_exists(ks) == 0
    assert backend.backend_stats()["set_pages"] == 0
    backend.close()


def test_mla_ranks_share_pages_and_mha_ranks_do_not():
    # Same namespace for every MLA TP rank (the writer's pages serve all), distinct per MHA rank.
    mla0 = create({"backend": "memory"}, make_pool("mla", "page_first"), mla=True, tp=(0, 2))
    mla1 = create({"backend": "memory"}, make_pool("mla", "page_first"), mla=True, tp=(1, 2))
    assert mla0.namespace == mla1.namespace
    mha0 = create({"backend": "memory"}, make_pool("mha", "page_first"), tp=(0, 2))
    mha1 = create({"backend": "memory"}, make_pool("mha", "page_first"), tp=(1, 2))
    assert mha0.namespace != mha1.namespace
    for b in (mla0, mla1, mha0, mha1):
        b.close()


def test_two_models_never_see_each_others_pages(tmp_path):
    ours = {"backend": "file", "dir": str(tmp_path / "shared")}
    ks = keys(3)
    pool_a = make_pool("mha", "page_first")
    a = create(ours, pool_a, model="org/model-a")
    ia = pool_a.alloc(3 * pool_a.page_size)
    pages_a = fill_pages(pool_a, ia, seed=4)
    assert a.batch_set_v1(ks, ia) == [True] * 3
    a.close()
    # A second instance on the same directory, another model: the same hashes are misses.
    pool_b = make_pool("mha", "page_first")
    b = create(ours, pool_b, model="org/model-b")
    ib = pool_b.alloc(3 * pool_b.page_size)
    assert b.batch_exists(ks) == 0
    assert b.batch_get_v1(ks, ib) == [False] * 3
    pages_b = fill_pages(pool_b, ib, seed=5)
    assert b.batch_set_v1(ks, ib) == [True] * 3
    b.close()
    # Model A, reopened (its pages persisted), reads its own bytes, not B's.
    pool_a2 = make_pool("mha", "page_first")
    a2 = create(ours, pool_a2, model="org/model-a")
    d = pool_a2.alloc(3 * pool_a2.page_size)
    assert a2.batch_get_v1(ks, d) == [True] * 3
    got = read_pages(pool_a2, d)
    assert all(same(x, y) for x, y in zip(got, pages_a))
    assert not any(same(x, y) for x, y in zip(got, pages_b))
    a2.close()


def test_concurrent_controller_threads(ours):
    # SGLang's prefetch query, prefetch I/O and backup threads call at once.
    pool = make_pool("mha", "layer_first", device_tokens=512)
    backend = create(ours, pool)
    ps = pool.page_size
    errors = []

    def worker(t):
        try:
            src = pool.alloc(16 * ps)
            dst = pool.alloc(16 * ps)
            pages = fill_pages(pool, src, seed=100 + t)
            ks = keys(16, start=10_000 * (t + 1))
            for _ in range(5):
                assert all(backend.batch_set_v1(ks, src))
                assert backend.batch_exists(ks) == 16
                assert all(backend.batch_get_v1(ks, dst))
            assert all(same(x, y) for x, y in zip(read_pages(pool, dst), pages))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert errors == []
    backend.close()


def test_stats_clear_and_close(tmp_path):
    pool = make_pool("mha", "page_first")
    backend = create({"backend": "file", "dir": str(tmp_path / "l3")}, pool, metrics=True)
    idx = pool.alloc(4 * pool.page_size)
    fill_pages(pool, idx, seed=6)
    ks = keys(4)
    assert all(backend.batch_set_v1(ks, idx))
    assert backend.batch_get_v1(ks, idx) == [True] * 4
    from sglang.srt.observability.metrics_collector import StorageMetrics

    m = backend.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [4] and m.prefetch_pgs == [4]
    assert len(m.backup_bandwidth) == 1 and m.backup_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []  # drained, as SGLang's own backends do
    assert backend.backend_stats()["set_stored"] == 4
    backend.clear()
    assert backend.batch_exists(ks) == 0
    backend.close()
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        backend.batch_exists(ks)
    with pytest.raises(RuntimeError, match="closed"):
        backend.batch_get_v1(ks, idx)
    with pytest.raises(RuntimeError, match="closed"):
        backend.batch_set_v1(ks, idx)


def test_without_metrics_get_stats_is_none():
    backend = create({"backend": "memory"}, make_pool("mla", "page_first"), mla=True)
    assert backend.get_stats() is None
    backend.close()


def test_bad_input_is_an_exception_naming_it(tmp_path):
    pool = make_pool("mha", "page_first")
    with pytest.raises(ValueError, match="no_such_field"):
        create({"backend": "file", "dir": str(tmp_path / "x"), "no_such_field": 1}, pool)
    with pytest.raises(ValueError, match="backend"):
        create({}, pool)
    with pytest.raises(ValueError, match="nope"):
        create({"backend": "nope"}, pool)
    # SGLang's own check: the dynamic loader needs module_path.
    extra = {"backend_name": "x", "class_name": "HiCacheRsStorage", "backend": "memory"}
    with pytest.raises(ValueError, match="module_path"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), pool)
    backend = create({"backend": "memory"}, pool)
    idx = pool.alloc(2 * pool.page_size)
    with pytest.raises(ValueError, match="3 keys need 12 host indices"):
        backend.batch_set_v1(keys(3), idx)
    with pytest.raises(ValueError, match="3 keys need 12 host indices"):
        backend.batch_get_v1(keys(3), idx)
    with pytest.raises(ValueError, match="key 0"):
        backend.batch_exists(["not-a-hash"])
    with pytest.raises(ValueError, match="bytes"):
        backend.set(keys(1)[0], torch.zeros(3))
    backend.close()
    # A hybrid model's pool SGLang itself cannot store fails the attach, naming the pool.
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang_pools import mxfp8_pool

    b = create({"backend": "memory"}, make_pool("mha", "page_first"))
    b.register_mem_host_pool_v2(b.mem_pool_host, PoolName.KV)
    with pytest.raises(ValueError, match="'swa'"):
        b.register_mem_host_pool_v2(mxfp8_pool(), PoolName.SWA)
    b.close()
    # A dtype our namespaces do not know is named.
    with pytest.raises(ValueError, match="float64"):
        create({"backend": "memory"}, make_pool("mha", "page_first", dtype=torch.float64))
    # A pool we cannot serve: its layout is named.
    head_pool = make_pool("mha", "page_first")
    head_pool.layout = "page_head"
    with pytest.raises(ValueError, match="page_head"):
        create({"backend": "memory"}, head_pool)
    # A local directory has one owner unless `shared`: MLA with TP > 1 must say so.
    with pytest.raises(ValueError, match='"shared": true'):
        create({"backend": "file", "dir": str(tmp_path / "y")}, make_pool("mla", "page_first"),
               mla=True, tp=(0, 2))


def test_file_storage_path_becomes_dir_and_ranks_get_their_own_directory(tmp_path):
    # SGLang adds `file_storage_path` from --file-storage-path; with TP 2 each rank owns a
    # subdirectory (one owner per directory), so both ranks open side by side.
    base = tmp_path / "kv"
    r0 = create({"backend": "file", "file_storage_path": str(base)}, make_pool("mha", "page_first"),
                tp=(0, 2))
    r1 = create({"backend": "file", "file_storage_path": str(base)}, make_pool("mha", "page_first"),
                tp=(1, 2))
    assert sorted(p.name for p in base.iterdir()) == ["tp0-pp0-cp0", "tp1-pp0-cp0"]
    r0.close()
    r1.close()


def test_mla_ranks_share_one_shared_directory(tmp_path):
    # The file backend's `shared` mode: one directory, several openers. The MLA writer rank's
    # pages serve the other TP rank (same namespace), which itself writes nothing.
    ours = {"backend": "file", "dir": str(tmp_path / "mla"), "shared": True}
    p0, p1 = make_pool("mla", "page_first"), make_pool("mla", "page_first")
    r0 = create(ours, p0, mla=True, tp=(0, 2))
    r1 = create(ours, p1, mla=True, tp=(1, 2))
    ks = keys(3)
    i0 = p0.alloc(3 * p0.page_size)
    written = fill_pages(p0, i0, seed=21)
    assert r0.batch_set_v1(ks, i0) == [True] * 3
    i1 = p1.alloc(3 * p1.page_size)
    assert r1.batch_exists(ks) == 3
    assert r1.batch_get_v1(ks, i1) == [True] * 3
    assert all(same(a, b) for a, b in zip(read_pages(p1, i1), written))
    assert r1.backend_stats()["set_pages"] == 0
    r0.close()
    r1.close()


def test_fp8_pools_stored_as_uint8_get_their_own_namespace():
    # SGLang keeps fp8 KV caches in uint8 buffers; they get a namespace of their own.
    u8 = create({"backend": "memory"}, make_pool("mha", "page_first", dtype=torch.uint8))
    bf = create({"backend": "memory"}, make_pool("mha", "page_first"))
    assert u8.namespace != bf.namespace
    idx = u8.mem_pool_host.alloc(2 * u8.page_size)
    u8.mem_pool_host.kv_buffer.view(-1)[:].fill_(7)
    assert u8.batch_set_v1(keys(2), idx) == [True, True]
    assert u8.batch_exists(keys(2)) == 2
    u8.close()
    bf.close()


def test_a_failing_backend_is_misses_and_failed_writes_not_exceptions(tmp_path):
    # The redis server dies under a running SGLang: its I/O threads get misses and failed
    # writes (and a log line), never an exception.
    proc, addr = start_redis(tmp_path)
    try:
        pool = make_pool("mha", "page_first")
        b = create({"backend": "redis", "nodes": [addr], "cluster": False, "timeout_ms": 500},
                   pool)
        idx = pool.alloc(2 * pool.page_size)
        fill_pages(pool, idx, seed=31)
        ks = keys(2)
        assert b.batch_set_v1(ks, idx) == [True, True]
        assert b.batch_exists(ks) == 2
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert b.batch_exists(ks) == 0
    assert b.batch_get_v1(ks, idx) == [False, False]
    assert b.batch_set_v1(keys(2, start=50), idx) == [False, False]
    assert b.batch_get(ks) == [None, None]
    assert b.exists(ks[0]) is False
    b.close()


def _outside_cases(pool):
    """Host indices SGLang's ``get_page_buffer_meta`` would turn into addresses unchecked: each
    with the message naming it (one key's page each)."""
    ps, n = pool.page_size, pool.size
    a = torch.arange
    return [
        # The page just past the end (reads another page of the pool, or past the buffer).
        (a(n, n + ps), f"host index {n} at position 0 \\(key 0, .*outside the host pool of {n} token slots"),
        # Far past the end (used to SIGSEGV in the file writer's checksum).
        (a(10**9, 10**9 + ps), "host index 1000000000 at position 0 .*outside the host pool"),
        # One index far out in the middle of a page (get_page_buffer_meta ignores it).
        (torch.cat([a(0, 1), torch.tensor([10**9]), a(2, ps)]), "host index 1000000000 at position 1 "),
        # Negative.
        (a(-ps, 0), f"host index {-ps} at position 0 .*outside the host pool"),
        # Inside the pool but off a page boundary.
        (a(1, ps + 1), f"host index 1 at position 0 .*does not start a page.*page size \\({ps}\\)"),
        # A page whose run is broken.
        (torch.cat([a(0, ps - 2), a(ps - 1, ps + 1)]), f"host index {ps - 1} at position {ps - 2} .*consecutive"),
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_host_indices_outside_the_pool_are_refused(kind, layout, tmp_path):
    """Issue 28 item 1: bad host indices are a ValueError naming them, before any pointer is
    made: nothing is read into the pool, nothing is stored, the process lives."""
    pool = make_pool(kind, layout)
    backend = create({"backend": "file", "dir": str(tmp_path / "l3")}, pool, mla=kind == "mla")
    ps = pool.page_size
    good = pool.alloc(2 * ps)
    fill_pages(pool, good, seed=41)
    stored = keys(2, start=7000)
    assert backend.batch_set_v1(stored, good) == [True, True]
    fresh = keys(2, start=8000)
    before = pool.kv_buffer.clone()
    for idx, match in _outside_cases(pool):
        for op, ks in (("batch_get_v1", stored[:1]), ("batch_set_v1", fresh[:1])):
            with pytest.raises(ValueError, match=f"{op}: {match}"):
                getattr(backend, op)(ks, idx)
        # The bad page second in a batch: its key and position are named.
        both = torch.cat([good[:ps], idx])
        with pytest.raises(ValueError, match="key 1, "):
            backend.batch_set_v1(fresh, both)
        with pytest.raises(ValueError, match="key 1, "):
            backend.batch_get_v1(stored, both)
    assert backend.batch_exists(fresh) == 0
    assert same(pool.kv_buffer, before)
    # Good indices still work after all that.
    assert backend.batch_get_v1(stored, good) == [True, True]
    backend.close()


def test_host_indices_of_the_wrong_kind_are_refused():
    pool = make_pool("mha", "page_first")
    backend = create({"backend": "memory"}, pool)
    ps = pool.page_size
    idx = pool.alloc(2 * ps)
    ks = keys(2)
    cases = [
        (idx.float(), "integer tensor, got dtype torch.float32"),
        (idx.bool(), "integer tensor, got dtype torch.bool"),
        (idx.view(2, ps), "1-D tensor, got shape \\(2, 4\\)"),
        (idx.tolist(), "torch.Tensor, got list"),
        (torch.empty(2 * ps, dtype=torch.int64, device="meta"), "on the CPU, got meta"),
    ]
    for bad, match in cases:
        for op in ("batch_get_v1", "batch_set_v1"):
            with pytest.raises(ValueError, match=match):
                getattr(backend, op)(ks, bad)
    assert backend.batch_exists(ks) == 0
    # int32 indices (a dtype SGLang could use) are fine.
    fill_pages(pool, idx, seed=42)
    assert backend.batch_set_v1(ks, idx.to(torch.int32)) == [True, True]
    assert backend.batch_get_v1(ks, idx.to(torch.int32)) == [True, True]
    # A strided (non-contiguous) view of good indices is fine; of bad ones, named.
    strided = torch.stack([idx, idx], dim=1)[:, 0]
    assert not strided.is_contiguous()
    assert backend.batch_get_v1(ks, strided) == [True, True]
    bad = torch.stack([idx + 1, idx], dim=1)[:, 0]
    with pytest.raises(ValueError, match="does not start a page"):
        backend.batch_get_v1(ks, bad)
    backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_the_native_store_refuses_pieces_outside_the_pool(kind, layout):
    """Defence in depth: the host pool's buffer is registered with the native store, which
    refuses what SGLang's ``get_page_buffer_meta`` makes of an index past the end, even from a
    caller that skips the Python checks."""
    pool = make_pool(kind, layout)
    backend = create({"backend": "memory"}, pool, mla=kind == "mla")
    store = backend._store
    kv = pool.kv_buffer
    assert store.allowed_regions == [(kv.data_ptr(), kv.numel() * kv.element_size())]
    ps, n = pool.page_size, pool.size
    ks = keys(1, start=9000)
    for start in (n, 10**9):
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(start, start + ps))
        for call in (store.batch_get_into, store.batch_set_from):
            with pytest.raises(ValueError, match="not wholly inside the memory registered"):
                call(backend.namespace, ks, backend.layout, ptrs, sizes, backend.kv_interleaved)
    assert backend.batch_exists(ks) == 0
    with pytest.raises(ValueError, match="already has its regions"):
        store.set_allowed_regions([(kv.data_ptr(), 16)])
    backend.close()


def test_the_small_and_large_index_checks_agree():
    """``_check_host_indices`` checks few indices as a Python list and many with numpy: on
    seeded random batches (whole pages, shifted, broken, out of the pool) both answer alike,
    and a batch either passes both or raises."""
    import random

    import numpy

    from hicache_rs import sglang as ours

    def numpy_rule(v, page_size, pool_tokens):
        a = numpy.asarray(v, dtype=numpy.int64).reshape(-1, page_size)
        starts = a[:, 0]
        return bool(
            starts.min() >= 0
            and starts.max() <= pool_tokens - page_size
            and not (starts % page_size).any()
            and (a == starts[:, None] + numpy.arange(page_size)).all()
        )

    rng = random.Random(7)
    for _ in range(2000):
        page_size = rng.choice([1, 2, 4, 64])
        pool_tokens = page_size * rng.randint(1, 40)
        pages = rng.randint(1, 6)
        v = []
        for _ in range(pages):
            s = rng.randrange(pool_tokens // page_size) * page_size
            v.extend(range(s, s + page_size))
        kind = rng.randrange(5)
        if kind == 1:
            v[rng.randrange(len(v))] += rng.choice([-1, 1])
        elif kind == 2:
            v[rng.randrange(len(v))] = rng.choice([-1, pool_tokens, pool_tokens + 5])
        elif kind == 3:
            v = [x + 1 for x in v]
        want = numpy_rule(v, page_size, pool_tokens)
        assert ours._pages_ok(v, page_size, pool_tokens) == want, (v, page_size, pool_tokens)
        keys = [f"{i:064x}" for i in range(pages)]
        t = torch.tensor(v, dtype=torch.int64)
        if want:
            ours._check_host_indices("t", keys, t, page_size, pool_tokens)
        else:
            with pytest.raises(ValueError):
                ours._check_host_indices("t", keys, t, page_size, pool_tokens)
