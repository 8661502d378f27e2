"""The native module on its own: a real file backend in a temporary directory, pages read and
written in place through pointers, concurrent calls from several threads, bad input."""

import ctypes
import threading

import pytest

import hicache_rs

NS = hicache_rs.namespace_id("m", "bfloat16", "page_first", False, 8, 128, 32, 64)


def keys(n, start=0):
    return hicache_rs.sglang_page_hashes(list(range(start, start + n * 4)), 4)


def buffers(n, size, fill=None):
    bufs = [ctypes.create_string_buffer(size) for _ in range(n)]
    if fill is not None:
        for i, b in enumerate(bufs):
            ctypes.memmove(b, bytes([(fill + i) % 256]) * size, size)
    return bufs, [ctypes.addressof(b) for b in bufs], [size] * n


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path):
    cfg = '{"backend": "memory"}' if request.param == "memory" else '{"backend": "file", "dir": "%s"}' % tmp_path
    s = hicache_rs.Store(cfg, page_bytes=4096)
    yield s
    s.close()


def test_round_trip_in_place(store):
    ks = keys(8)
    _, ptrs, sizes = buffers(8, 4096, fill=7)
    assert store.batch_exists(NS, ks) == 0
    assert store.batch_set_from(NS, ks[:5], "page_first", ptrs[:5], sizes[:5]) == [True] * 5
    assert store.batch_exists(NS, ks) == 5
    dst, dptrs, dsizes = buffers(8, 4096)
    got = store.batch_get_into(NS, ks, "page_first", dptrs, dsizes)
    assert got == [True] * 5 + [False] * 3
    for i in range(5):
        assert dst[i].raw == bytes([(7 + i) % 256]) * 4096
    other = hicache_rs.namespace_id("other", "bfloat16", "page_first", False, 8, 128, 32, 64)
    assert store.batch_exists(other, ks) == 0
    assert store.get_bytes(NS, ks[0], "page_first", 4096) == bytes([7]) * 4096
    assert store.delete(NS, ks[:1]) == 1
    assert store.batch_exists(NS, ks) == 0
    assert store.stats()["set_stored"] == 5


def test_concurrent_threads(store):
    errors = []

    def worker(t):
        try:
            ks = keys(16, start=1000 * t)
            src, ptrs, sizes = buffers(16, 2048, fill=t)
            assert all(store.batch_set_from(NS, ks, "page_first", ptrs, sizes))
            dst, dptrs, dsizes = buffers(16, 2048)
            assert all(store.batch_get_into(NS, ks, "page_first", dptrs, dsizes))
            assert [d.raw for d in dst] == [s.raw for s in src]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_bad_input_raises(store, tmp_path):
    with pytest.raises(ValueError, match="key 0"):
        store.batch_exists(NS, ["zz"])
    _, ptrs, sizes = buffers(2, 64)
    with pytest.raises(ValueError, match="pieces"):
        store.batch_set_from(NS, keys(3), "page_first", ptrs, sizes)
    with pytest.raises(ValueError, match="overlap"):
        store.batch_get_into(NS, keys(2), "page_first", [ptrs[0], ptrs[0]], sizes)
    with pytest.raises(ValueError, match="page_head"):
        store.batch_get_into(NS, keys(2), "page_head", ptrs, sizes)
    with pytest.raises(ValueError, match="no_such_field"):
        hicache_rs.Store('{"backend": "file", "dir": "%s", "no_such_field": 1}' % tmp_path)
    with pytest.raises(ValueError, match="nodes"):
        hicache_rs.Store('{"backend": "redis"}')
    assert "redis" in hicache_rs.COMPILED_BACKENDS
    store.close()
    assert store.closed
    with pytest.raises(RuntimeError, match="closed"):
        store.batch_exists(NS, keys(1))


def test_sglang_hash_matches_hashlib():
    import hashlib

    toks = list(range(8))
    h1 = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in toks[:4])).hexdigest()
    h2 = hashlib.sha256(bytes.fromhex(h1) + b"".join(t.to_bytes(4, "little") for t in toks[4:])).hexdigest()
    assert hicache_rs.sglang_page_hashes(toks, 4) == [h1, h2]


def test_prefix_keys_reach_the_backend_with_every_batch():
    """Prefix keys given with a call arrive with each batch it is split into, extended by the
    call's own keys before that batch; a call without them passes none."""
    s = hicache_rs.Store('{"backend": "memory", "record_contexts": true, "max_batch": 128}', page_bytes=64)
    chain = keys(133)
    prefix, ks = chain[:3], chain[3:]
    _, ptrs, sizes = buffers(130, 64, fill=1)
    assert s.batch_set_from(NS, ks, "page_first", ptrs, sizes, prefix_keys=prefix, extra_info="x") == [True] * 130
    seen = s.contexts_seen()
    assert [(c["op"], len(c["keys"])) for c in seen] == [("batch_set", 128), ("batch_set", 2)]
    assert seen[0]["keys"] == ks[:128] and seen[0]["prefix_keys"] == prefix
    assert seen[1]["keys"] == ks[128:] and seen[1]["prefix_keys"] == prefix + ks[:128]
    assert all(c["extra_info"] == "x" for c in seen)
    assert s.batch_exists(NS, ks, prefix_keys=[]) == 130
    assert [c["prefix_keys"] for c in s.contexts_seen()] == [[], ks[:128]]
    dst, dptrs, dsizes = buffers(130, 64)
    assert s.batch_get_into(NS, ks, "page_first", dptrs, dsizes) == [True] * 130
    assert s.batch_exists(NS, ks) == 130
    assert s.contexts_seen() == []
    with pytest.raises(ValueError, match="prefix key 0"):
        s.batch_exists(NS, ks, prefix_keys=["not-a-hash"])
    s.close()
    other = hicache_rs.Store('{"backend": "memory"}', page_bytes=64)
    with pytest.raises(ValueError, match="record_contexts"):
        other.contexts_seen()
    other.close()


def test_clear_removes_one_namespace_only(store, tmp_path):
    other = hicache_rs.namespace_id("other", "bfloat16", "page_first", False, 8, 128, 32, 64)
    ks = keys(6)
    _, ptrs, sizes = buffers(6, 4096, fill=3)
    assert store.batch_set_from(NS, ks, "page_first", ptrs, sizes) == [True] * 6
    assert store.batch_set_from(other, ks[:2], "page_first", ptrs[:2], sizes[:2]) == [True] * 2
    assert store.info()["clear"] is True
    assert store.clear(NS) == 6
    assert store.batch_exists(NS, ks) == 0
    assert store.batch_exists(other, ks[:2]) == 2
    assert store.clear(NS) == 0
    assert store.batch_set_from(NS, ks[:1], "page_first", ptrs[:1], sizes[:1]) == [True]
    assert store.batch_exists(NS, ks) == 1
    with pytest.raises(ValueError):
        store.clear("not-hex")


def test_read_lengths_are_bounded_before_allocating(store):
    """A length no page can have is a ValueError naming it, never an abort (2**40 used to
    abort the interpreter on a failed allocation) or a PanicException (2**64-1)."""
    ks = keys(1)
    for length in (2**40, 2**64 - 1, 0, (1 << 30) + 1):
        with pytest.raises(ValueError, match=f"length {length} is not a page length"):
            store.get_bytes(NS, ks[0], "page_first", length)
        with pytest.raises(ValueError, match=f"length {length} is not a page length"):
            store.batch_get_bytes(NS, ks, "page_first", length)
    # The store is still usable, and a real page length works.
    assert store.set_bytes(NS, ks[0], "page_first", b"\x05" * 4096) is True
    assert store.get_bytes(NS, ks[0], "page_first", 4096) == b"\x05" * 4096


def test_batch_bytes_calls_round_trip(store):
    ks = keys(3, start=300)
    pages = [bytes([i + 1]) * 512 for i in range(2)]
    assert store.batch_set_bytes(NS, ks[:2], "page_first", pages) == [True, True]
    assert store.batch_get_bytes(NS, ks, "page_first", 512) == pages + [None]
    assert store.batch_get_bytes(NS, [], "page_first", 512) == []
    with pytest.raises(ValueError, match="pieces"):
        store.batch_set_bytes(NS, ks, "page_first", pages)
    with pytest.raises(ValueError, match="non-empty"):
        store.batch_set_bytes(NS, ks[2:], "page_first", [b""])


def test_registered_regions_bound_the_zero_copy_calls(store):
    """Defence in depth: once the caller's pool is registered, a piece not wholly inside it is a
    ValueError and nothing is read or written; the bytes calls use their own memory."""
    pool, pool_ptrs, _ = buffers(4, 256, fill=9)
    outside, out_ptrs, _ = buffers(1, 256, fill=1)
    assert store.allowed_regions is None
    store.set_allowed_regions([(p, 256) for p in pool_ptrs])
    assert sum(n for _, n in store.allowed_regions) == 4 * 256
    ks = keys(2, start=500)
    # Inside: works.
    assert store.batch_set_from(NS, ks[:1], "page_first", pool_ptrs[:1], [256]) == [True]
    # Outside, straddling the end of a buffer, or past it: refused, nothing stored or read.
    last = max(pool_ptrs)
    for ptr, size in [(out_ptrs[0], 256), (last + 128, 256), (last + 256, 1)]:
        with pytest.raises(ValueError, match="not wholly inside"):
            store.batch_set_from(NS, ks[1:], "page_first", [ptr], [size])
        with pytest.raises(ValueError, match="not wholly inside"):
            store.batch_get_into(NS, ks[:1], "page_first", [ptr], [size])
    assert store.batch_exists(NS, ks[1:]) == 0
    assert outside[0].raw == bytes([1]) * 256
    # The piece's position is named (the second page here).
    with pytest.raises(ValueError, match="piece 1"):
        store.batch_get_into(NS, ks, "page_first", [pool_ptrs[1], out_ptrs[0]], [256, 256])
    # Set once, never changed.
    with pytest.raises(ValueError, match="already has its regions"):
        store.set_allowed_regions([(out_ptrs[0], 256)])
    # The bytes calls are not bound by the regions.
    assert store.set_bytes(NS, ks[1], "page_first", b"\x02" * 256) is True
    assert store.get_bytes(NS, ks[1], "page_first", 256) == b"\x02" * 256


def test_regions_added_later_extend_the_bound_and_never_shrink(store):
    """Pools registered later (a hybrid model's sidecars) add their buffers; a bad addition
    changes nothing."""
    first, first_ptrs, _ = buffers(1, 256, fill=3)
    later, later_ptrs, _ = buffers(1, 512, fill=4)
    ks = keys(2, start=700)
    store.add_allowed_regions([(first_ptrs[0], 256)])
    with pytest.raises(ValueError, match="not wholly inside"):
        store.batch_set_from(NS, ks[1:], "page_first", later_ptrs, [512])
    with pytest.raises(ValueError, match="region 0"):
        store.add_allowed_regions([(0, 16)])
    store.add_allowed_regions([(later_ptrs[0], 512)])
    assert sorted(n for _, n in store.allowed_regions) == [256, 512]
    assert store.batch_set_from(NS, ks, "page_first", first_ptrs + later_ptrs, [256, 512]) == \
        [True, True]
    # The once-only call refuses once regions exist.
    with pytest.raises(ValueError, match="already has its regions"):
        store.set_allowed_regions([(first_ptrs[0], 256)])


def test_presence_per_key_answers_every_key(store):
    ks = keys(6, start=900)
    src, ptrs, sizes = buffers(6, 128, fill=5)
    assert store.batch_exists_each(NS, ks) == [False] * 6
    pick = [0, 2, 3, 5]
    assert all(store.batch_set_from(NS, [ks[i] for i in pick], "page_first",
                                    [ptrs[i] for i in pick], [128] * 4))
    assert store.batch_exists_each(NS, ks) == [True, False, True, True, False, True]
    assert store.batch_exists(NS, ks) == 1  # the leading run only
    assert store.batch_exists_each(NS, []) == []
    with pytest.raises(ValueError, match="key 1"):
        store.batch_exists_each(NS, [ks[0], "nope"])


def test_bad_regions_are_refused():
    s = hicache_rs.Store('{"backend": "memory"}')
    for regions, match in [([], "no region"), ([(0, 16)], "region 0"), ([(16, 0)], "region 0"),
                           ([(16, 16), (2**64 - 8, 16)], "region 1")]:
        with pytest.raises(ValueError, match=match):
            s.set_allowed_regions(regions)
    assert s.allowed_regions is None
    s.close()


def test_close_waits_for_calls_in_flight_and_releases_the_directory(tmp_path):
    """Issue 28 (low): a store closed while one of its calls was in flight kept its directory
    locked until that call returned, so reopening the directory at once failed with "in use by
    another process (pid <own pid>)". ``close`` now waits for the calls in flight: when it
    returns, the directory is free, and the call in flight still completes."""
    cfg = '{"backend": "file", "dir": "%s"}' % tmp_path
    size = 1 << 20
    for round_ in range(10):
        s = hicache_rs.Store(cfg, page_bytes=size)
        ks = keys(32, start=10_000 * round_)
        _, ptrs, sizes = buffers(32, size, fill=round_)
        started = threading.Event()
        result = {}

        def writer():
            started.set()
            try:
                result["ok"] = s.batch_set_from(NS, ks, "page_first", ptrs, sizes)
            except RuntimeError as e:  # closed before it began: also a clean outcome
                result["closed"] = str(e)

        t = threading.Thread(target=writer)
        t.start()
        started.wait(10)
        s.close()
        # The directory is ours again at once, whatever the writer was doing.
        again = hicache_rs.Store(cfg, page_bytes=size)
        t.join(60)
        assert not t.is_alive()
        assert "ok" in result or "closed" in result, result
        if "ok" in result:
            assert result["ok"] == [True] * 32
            assert again.batch_exists(NS, ks) == 32
        again.close()
