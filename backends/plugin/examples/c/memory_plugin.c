/*
 * An example hicache-rs storage plugin in plain C11: an in-memory page store that obeys the
 * whole storage contract (it passes hicache-storage's conformance suite through the loader).
 *
 *   cc -std=c11 -O2 -fPIC -shared -I backends/plugin/include \
 *      -o libhicache_c_memory.so backends/plugin/examples/c/memory_plugin.c -lpthread
 *
 * plugin_config: {} or {"max_batch": N} (N >= 1); any other field is refused with
 * HICACHE_ERR_CONFIG. The capacity comes from the host (hicache_host.capacity_bytes), 1 GiB
 * when not configured.
 *
 * Design:
 *  - A chained hash table of entries keyed by the 48 key bytes, plus an LRU list, both under
 *    one mutex. An entry holds the page's metadata (layout, length), a checksum and a copy of
 *    the bytes; it is immutable once published and reference-counted, so readers copy and
 *    verify outside the lock, and a replaced or evicted entry stays valid for them.
 *  - set copies and checksums the page before taking the lock, then publishes it: a page is
 *    visible only once complete. get verifies the checksum before reporting a hit; a mismatch
 *    drops the copy and reports HICACHE_PAGE_CORRUPT.
 *  - Capacity: stored bytes never exceed the capacity; the least recently used entries are
 *    evicted to make room.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "hicache_storage.h"

#define DEFAULT_CAPACITY (1ull << 30)
#define DEFAULT_MAX_BATCH 256u

typedef struct entry {
    hicache_key key;
    uint32_t layout;
    uint32_t refs; /* guarded by the store's mutex; the table holds one */
    uint64_t len;
    uint64_t checksum;
    struct entry *hnext;             /* hash chain */
    struct entry *lprev, *lnext;     /* LRU list, most recent first */
    uint8_t data[];
} entry;

struct hicache_plugin {
    pthread_mutex_t mu;
    entry **buckets;
    size_t nbuckets;
    entry *lru_head, *lru_tail;
    uint64_t capacity, max_batch;
    uint64_t pages, bytes;
    hicache_stats st; /* counters, guarded by mu */
    hicache_log_fn log;
    void *log_ctx;
    int32_t max_log_level;
};

/* ---- helpers ------------------------------------------------------------------------------- */

static void plugin_log(hicache_plugin *p, int32_t level, const char *fmt, ...) {
    if (level > p->max_log_level) {
        return;
    }
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0) {
        return;
    }
    size_t len = (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1;
    static const char target[] = "c_memory_plugin";
    p->log(p->log_ctx, level, target, sizeof target - 1, msg, len);
}

/* A 64-bit checksum: word-wise multiply/xorshift. Every step is a bijection of the state for a
 * given input word, so any change of one word changes the result. */
static uint64_t checksum(const uint8_t *data, uint64_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, data + i, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    for (; i < n; i++) {
        h = (h ^ data[i]) * 0x100000001b3ull;
    }
    return h ^ (h >> 29);
}

static size_t bucket_of(const hicache_plugin *p, const hicache_key *k) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < HICACHE_KEY_LEN; i++) {
        h = (h ^ k->bytes[i]) * 0x100000001b3ull;
    }
    return (size_t)(h & (p->nbuckets - 1));
}

/* Lookup under the lock. */
static entry **find_slot(hicache_plugin *p, const hicache_key *k) {
    entry **slot = &p->buckets[bucket_of(p, k)];
    while (*slot != NULL && memcmp((*slot)->key.bytes, k->bytes, HICACHE_KEY_LEN) != 0) {
        slot = &(*slot)->hnext;
    }
    return slot;
}

static void lru_unlink(hicache_plugin *p, entry *e) {
    if (e->lprev) e->lprev->lnext = e->lnext; else p->lru_head = e->lnext;
    if (e->lnext) e->lnext->lprev = e->lprev; else p->lru_tail = e->lprev;
    e->lprev = e->lnext = NULL;
}

static void lru_push_front(hicache_plugin *p, entry *e) {
    e->lprev = NULL;
    e->lnext = p->lru_head;
    if (p->lru_head) p->lru_head->lprev = e; else p->lru_tail = e;
    p->lru_head = e;
}

static void unref(entry *e) { /* under the lock */
    if (--e->refs == 0) {
        free(e);
    }
}

/* Removes the entry in *slot from the table and the LRU list (under the lock). */
static void remove_at(hicache_plugin *p, entry **slot) {
    entry *e = *slot;
    *slot = e->hnext;
    lru_unlink(p, e);
    p->pages--;
    p->bytes -= e->len;
    unref(e);
}

static void grow(hicache_plugin *p) { /* under the lock; keeps the load factor <= 1 */
    size_t n = p->nbuckets * 2;
    entry **b = calloc(n, sizeof *b);
    if (b == NULL) {
        return; /* keep the old table: slower chains, still correct */
    }
    entry **old = p->buckets;
    size_t oldn = p->nbuckets;
    p->buckets = b;
    p->nbuckets = n;
    for (size_t i = 0; i < oldn; i++) {
        entry *e = old[i];
        while (e) {
            entry *next = e->hnext;
            size_t j = bucket_of(p, &e->key);
            e->hnext = b[j];
            b[j] = e;
            e = next;
        }
    }
    free(old);
}

/* Parses {} or {"max_batch": N}. Returns 0, or -1 with err filled. */
static int parse_config(const char *s, uint64_t *max_batch, hicache_error *err) {
#define WS() while (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r') s++
    WS();
    if (*s++ != '{') {
        hicache_error_set(err, "plugin_config: expected a JSON object");
        return -1;
    }
    WS();
    if (*s == '}') {
        return 0;
    }
    for (;;) {
        WS();
        if (*s++ != '"') {
            hicache_error_set(err, "plugin_config: expected a field name");
            return -1;
        }
        const char *name = s;
        while (*s && *s != '"' && *s != '\\') s++;
        if (*s != '"') {
            hicache_error_set(err, "plugin_config: unsupported field name");
            return -1;
        }
        size_t name_len = (size_t)(s - name);
        s++;
        WS();
        if (*s++ != ':') {
            hicache_error_set(err, "plugin_config: expected ':'");
            return -1;
        }
        WS();
        if (name_len == 9 && memcmp(name, "max_batch", 9) == 0) {
            char *end;
            unsigned long long v = strtoull(s, &end, 10);
            if (end == s || *s == '-' || v == 0 || v > 1000000) {
                hicache_error_set(err, "plugin_config: field `max_batch` must be an integer between 1 and 1000000");
                return -1;
            }
            *max_batch = v;
            s = end;
        } else {
            hicache_error_set(err, "plugin_config: unknown field `%.*s` (known fields: max_batch)",
                              (int)(name_len > 64 ? 64 : name_len), name);
            return -1;
        }
        WS();
        if (*s == ',') {
            s++;
            continue;
        }
        if (*s == '}') {
            return 0;
        }
        hicache_error_set(err, "plugin_config: expected ',' or '}'");
        return -1;
    }
#undef WS
}

/* ---- the ABI ------------------------------------------------------------------------------- */

static hicache_status mp_create(const char *config_json, uint64_t config_len,
                                const hicache_host *host, hicache_plugin **out,
                                hicache_error *err) {
    (void)config_len; /* the host NUL-terminates the text */
    if (host == NULL || out == NULL || host->log == NULL) {
        hicache_error_set(err, "create: NULL host, out or log callback");
        return HICACHE_ERR_INVALID_ARGUMENT;
    }
    if (host->abi_major != HICACHE_ABI_MAJOR) {
        hicache_error_set(err, "create: host ABI major %u, plugin built for %u", host->abi_major,
                          HICACHE_ABI_MAJOR);
        return HICACHE_ERR_INVALID_ARGUMENT;
    }
    uint64_t max_batch = DEFAULT_MAX_BATCH;
    if (parse_config(config_json, &max_batch, err) != 0) {
        return HICACHE_ERR_CONFIG;
    }
    hicache_plugin *p = calloc(1, sizeof *p);
    if (p == NULL) {
        hicache_error_set(err, "create: out of memory");
        return HICACHE_ERR_INTERNAL;
    }
    p->nbuckets = 1024;
    p->buckets = calloc(p->nbuckets, sizeof *p->buckets);
    if (p->buckets == NULL || pthread_mutex_init(&p->mu, NULL) != 0) {
        free(p->buckets);
        free(p);
        hicache_error_set(err, "create: out of memory");
        return HICACHE_ERR_INTERNAL;
    }
    p->capacity = host->capacity_bytes ? host->capacity_bytes : DEFAULT_CAPACITY;
    p->max_batch = max_batch;
    p->log = host->log;
    p->log_ctx = host->log_ctx;
    p->max_log_level = host->max_log_level;
    plugin_log(p, HICACHE_LOG_INFO, "created: capacity %llu bytes, max_batch %llu",
               (unsigned long long)p->capacity, (unsigned long long)p->max_batch);
    *out = p;
    return HICACHE_OK;
}

static void mp_destroy(hicache_plugin *p) {
    if (p == NULL) {
        return;
    }
    for (size_t i = 0; i < p->nbuckets; i++) {
        entry *e = p->buckets[i];
        while (e) {
            entry *next = e->hnext;
            free(e); /* no call is in flight during destroy, so no reader holds a reference */
            e = next;
        }
    }
    free(p->buckets);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static hicache_status mp_get_info(hicache_plugin *p, hicache_plugin_info *out, hicache_error *err) {
    (void)err;
    hicache_plugin_info info = {0};
    info.flags = 0; /* copies pages; not persistent; not shared */
    info.max_batch = p->max_batch;
    info.max_page_bytes = p->capacity;
    info.capacity_bytes = p->capacity;
    /* Write only what the host's struct holds, keeping its struct_size. */
    size_t n = out->struct_size < sizeof info ? out->struct_size : sizeof info;
    size_t skip = sizeof info.struct_size;
    if (n > skip) {
        memcpy((char *)out + skip, (const char *)&info + skip, n - skip);
    }
    return HICACHE_OK;
}

static hicache_status mp_batch_exists(hicache_plugin *p, const hicache_key *keys, uint64_t count,
                                      uint64_t *present, hicache_error *err) {
    (void)err;
    uint64_t hits = 0;
    pthread_mutex_lock(&p->mu);
    while (hits < count && *find_slot(p, &keys[hits]) != NULL) {
        hits++;
    }
    p->st.exists_calls++;
    p->st.exists_keys += hits < count ? hits + 1 : hits;
    p->st.exists_hits += hits;
    pthread_mutex_unlock(&p->mu);
    *present = hits;
    return HICACHE_OK;
}

static hicache_page_result get_one(hicache_plugin *p, const hicache_key *key,
                                   const hicache_page *page, uint64_t *written) {
    pthread_mutex_lock(&p->mu);
    entry *e = *find_slot(p, key);
    if (e == NULL) {
        pthread_mutex_unlock(&p->mu);
        return HICACHE_PAGE_MISS;
    }
    if (e->len != page->len || e->layout != page->layout) {
        p->st.meta_mismatches++;
        pthread_mutex_unlock(&p->mu);
        return HICACHE_PAGE_MISS;
    }
    e->refs++;
    lru_unlink(p, e);
    lru_push_front(p, e);
    pthread_mutex_unlock(&p->mu);

    /* Verify, then copy, outside the lock (the entry is immutable). */
    int ok = checksum(e->data, e->len) == e->checksum;
    if (ok) {
        uint64_t off = 0;
        for (uint64_t i = 0; i < page->part_count; i++) {
            if (page->parts[i].len > 0) {
                memcpy(page->parts[i].base, e->data + off, page->parts[i].len);
            }
            off += page->parts[i].len;
        }
        *written = off;
    }

    pthread_mutex_lock(&p->mu);
    if (!ok) {
        entry **slot = find_slot(p, key);
        if (*slot == e) { /* still the same copy: drop it */
            remove_at(p, slot);
        }
        plugin_log(p, HICACHE_LOG_WARN, "checksum mismatch: page of %llu bytes dropped",
                   (unsigned long long)e->len);
    }
    unref(e);
    pthread_mutex_unlock(&p->mu);
    return ok ? HICACHE_PAGE_HIT : HICACHE_PAGE_CORRUPT;
}

static hicache_status mp_batch_get(hicache_plugin *p, const hicache_key *keys,
                                   const hicache_page *pages, uint64_t count,
                                   hicache_page_result *results, uint64_t *lengths,
                                   hicache_error *err) {
    (void)err;
    if (count > p->max_batch) {
        hicache_error_set(err, "batch of %llu pages over max_batch %llu",
                          (unsigned long long)count, (unsigned long long)p->max_batch);
        return HICACHE_ERR_BATCH_TOO_LARGE;
    }
    uint64_t hits = 0, misses = 0, corrupt = 0, bytes = 0;
    for (uint64_t i = 0; i < count; i++) {
        lengths[i] = 0;
        results[i] = get_one(p, &keys[i], &pages[i], &lengths[i]);
        switch (results[i]) {
        case HICACHE_PAGE_HIT: hits++; bytes += pages[i].len; break;
        case HICACHE_PAGE_MISS: misses++; break;
        default: corrupt++; break;
        }
    }
    pthread_mutex_lock(&p->mu);
    p->st.get_pages += count;
    p->st.get_hits += hits;
    p->st.get_misses += misses;
    p->st.get_corrupt += corrupt;
    p->st.get_bytes += bytes;
    pthread_mutex_unlock(&p->mu);
    return HICACHE_OK;
}

static hicache_page_result set_one(hicache_plugin *p, const hicache_key *key,
                                   const hicache_page *page) {
    if (page->len == 0) {
        return HICACHE_PAGE_ERR_EMPTY;
    }
    if (page->len > p->capacity) {
        return HICACHE_PAGE_ERR_TOO_LARGE;
    }
    pthread_mutex_lock(&p->mu);
    entry *old = *find_slot(p, key);
    if (old != NULL && old->len == page->len && old->layout == page->layout) {
        lru_unlink(p, old);
        lru_push_front(p, old);
        pthread_mutex_unlock(&p->mu);
        return HICACHE_PAGE_PRESENT;
    }
    pthread_mutex_unlock(&p->mu);

    /* Copy and checksum before publishing: a page is visible only once complete. */
    entry *e = malloc(sizeof *e + page->len);
    if (e == NULL) {
        return HICACHE_PAGE_ERR_NO_SPACE;
    }
    memset(e, 0, sizeof *e);
    e->key = *key;
    e->layout = page->layout;
    e->len = page->len;
    e->refs = 1;
    uint64_t off = 0;
    for (uint64_t i = 0; i < page->part_count; i++) {
        if (page->parts[i].len > 0) {
            memcpy(e->data + off, page->parts[i].base, page->parts[i].len);
        }
        off += page->parts[i].len;
    }
    e->checksum = checksum(e->data, e->len);

    pthread_mutex_lock(&p->mu);
    entry **slot = find_slot(p, key);
    if (*slot != NULL) {
        remove_at(p, slot);
    }
    while (p->bytes + e->len > p->capacity && p->lru_tail != NULL) {
        entry *victim = p->lru_tail;
        p->st.evicted_pages++;
        p->st.evicted_bytes += victim->len;
        remove_at(p, find_slot(p, &victim->key));
    }
    slot = find_slot(p, key);
    e->hnext = NULL;
    *slot = e;
    lru_push_front(p, e);
    p->pages++;
    p->bytes += e->len;
    if (p->pages > p->nbuckets) {
        grow(p);
    }
    pthread_mutex_unlock(&p->mu);
    return HICACHE_PAGE_STORED;
}

static hicache_status mp_batch_set(hicache_plugin *p, const hicache_key *keys,
                                   const hicache_page *pages, uint64_t count,
                                   hicache_page_result *results, hicache_error *err) {
    if (count > p->max_batch) {
        hicache_error_set(err, "batch of %llu pages over max_batch %llu",
                          (unsigned long long)count, (unsigned long long)p->max_batch);
        return HICACHE_ERR_BATCH_TOO_LARGE;
    }
    uint64_t stored = 0, present = 0, errors = 0, bytes = 0;
    for (uint64_t i = 0; i < count; i++) {
        results[i] = set_one(p, &keys[i], &pages[i]);
        switch (results[i]) {
        case HICACHE_PAGE_STORED: stored++; bytes += pages[i].len; break;
        case HICACHE_PAGE_PRESENT: present++; break;
        default:
            if (errors++ == 0) {
                hicache_error_set(err, "page %llu of %llu bytes: %s", (unsigned long long)i,
                                  (unsigned long long)pages[i].len,
                                  results[i] == HICACHE_PAGE_ERR_TOO_LARGE ? "larger than the capacity"
                                  : results[i] == HICACHE_PAGE_ERR_EMPTY   ? "empty page"
                                                                            : "out of memory");
            }
            break;
        }
    }
    pthread_mutex_lock(&p->mu);
    p->st.set_pages += count;
    p->st.set_stored += stored;
    p->st.set_present += present;
    p->st.set_errors += errors;
    p->st.set_bytes += bytes;
    pthread_mutex_unlock(&p->mu);
    return HICACHE_OK;
}

static hicache_status mp_batch_delete(hicache_plugin *p, const hicache_key *keys, uint64_t count,
                                      uint64_t *removed, hicache_error *err) {
    (void)err;
    uint64_t n = 0;
    pthread_mutex_lock(&p->mu);
    for (uint64_t i = 0; i < count; i++) {
        entry **slot = find_slot(p, &keys[i]);
        if (*slot != NULL) {
            remove_at(p, slot);
            n++;
        }
    }
    p->st.deleted_pages += n;
    pthread_mutex_unlock(&p->mu);
    *removed = n;
    return HICACHE_OK;
}

static hicache_status mp_get_stats(hicache_plugin *p, hicache_stats *out, hicache_error *err) {
    (void)err;
    pthread_mutex_lock(&p->mu);
    hicache_stats s = p->st;
    s.pages = p->pages;
    s.bytes = p->bytes;
    s.capacity_bytes = p->capacity;
    pthread_mutex_unlock(&p->mu);
    size_t n = out->struct_size < sizeof s ? out->struct_size : sizeof s;
    size_t skip = sizeof s.struct_size;
    if (n > skip) {
        memcpy((char *)out + skip, (const char *)&s + skip, n - skip);
    }
    return HICACHE_OK;
}

static hicache_status mp_test_corrupt_page(hicache_plugin *p, const hicache_key *key,
                                           uint32_t *found, hicache_error *err) {
    pthread_mutex_lock(&p->mu);
    entry **slot = find_slot(p, key);
    entry *old = *slot;
    if (old == NULL) {
        pthread_mutex_unlock(&p->mu);
        *found = 0;
        return HICACHE_OK;
    }
    /* Replace with a damaged copy (readers of the old copy are unaffected). */
    entry *bad = malloc(sizeof *old + old->len);
    if (bad == NULL) {
        pthread_mutex_unlock(&p->mu);
        hicache_error_set(err, "test_corrupt_page: out of memory");
        return HICACHE_ERR_INTERNAL;
    }
    memcpy(bad, old, sizeof *old + old->len);
    bad->data[bad->len / 2] ^= 0x5a;
    bad->refs = 1;
    bad->lprev = bad->lnext = NULL;
    *slot = bad;
    lru_unlink(p, old);
    lru_push_front(p, bad);
    unref(old);
    pthread_mutex_unlock(&p->mu);
    *found = 1;
    return HICACHE_OK;
}

#ifdef HICACHE_EXAMPLE_NEWER_MINOR
/* Test variant: a plugin built against a future minor version whose vtable has one more
 * field. The host uses the common prefix. */
typedef struct {
    hicache_plugin_vtable v1;
    void *future_function;
} vtable_next;
#define VTABLE_TYPE vtable_next
#define VTABLE_MINOR (HICACHE_ABI_MINOR + 1)
#define VTABLE_SIZE sizeof(VTABLE_TYPE)
#define VTABLE_OF(t) (&(t).v1)
#define VTABLE_INIT(...) {{__VA_ARGS__}, NULL}
#define VTABLE_EXTRA_CAPS 0u
#elif defined(HICACHE_EXAMPLE_V1_0)
/* Test variant: the plugin as built against the 1.0 header (minor 0, the 1.0 vtable size):
 * the host must not look at the fields 1.1 appended. */
#define VTABLE_TYPE hicache_plugin_vtable
#define VTABLE_MINOR 0u
#define VTABLE_SIZE HICACHE_VTABLE_V1_0_SIZE
#define VTABLE_OF(t) (&(t))
#define VTABLE_INIT(...) {__VA_ARGS__}
#define VTABLE_EXTRA_CAPS 0u
#elif defined(HICACHE_EXAMPLE_V1_1)
/* Test variant: the plugin as built against the 1.1 header (minor 1, the 1.1 vtable size). It
 * sets the 1.2 HICACHE_CAP_CLEAR bit, which a 1.1 plugin never knew: the host must ignore the
 * bit (the entry lies beyond struct_size), load the plugin, and answer clear "unsupported". */
#define VTABLE_TYPE hicache_plugin_vtable
#define VTABLE_MINOR 1u
#define VTABLE_SIZE HICACHE_VTABLE_V1_1_SIZE
#define VTABLE_OF(t) (&(t))
#define VTABLE_INIT(...) {__VA_ARGS__}
#define VTABLE_EXTRA_CAPS HICACHE_CAP_CLEAR
#else
#define VTABLE_TYPE hicache_plugin_vtable
#define VTABLE_MINOR HICACHE_ABI_MINOR
#define VTABLE_SIZE sizeof(VTABLE_TYPE)
#define VTABLE_OF(t) (&(t))
#define VTABLE_INIT(...) {__VA_ARGS__}
#define VTABLE_EXTRA_CAPS 0u
#endif

static const VTABLE_TYPE VTABLE = VTABLE_INIT(
    HICACHE_ABI_MAJOR,
    VTABLE_MINOR,
    VTABLE_SIZE,
    HICACHE_CAP_TEST_CORRUPT | VTABLE_EXTRA_CAPS,
    "c-memory-example",
    "1.0.0",
    mp_create,
    mp_destroy,
    mp_get_info,
    mp_batch_exists,
    mp_batch_get,
    mp_batch_set,
    mp_batch_delete,
    mp_get_stats,
    NULL, /* register_memory: not needed, pages are copied */
    mp_test_corrupt_page,
    /* 1.1 batch context: this plugin has no use for prefix keys; the host calls the plain
     * entries. */
    NULL,
    NULL,
    NULL,
    /* 1.2 clear: not provided (no HICACHE_CAP_CLEAR); the host answers "unsupported". */
    NULL);

__attribute__((visibility("default"))) const hicache_plugin_vtable *HICACHE_PLUGIN_ENTRY(void) {
    return VTABLE_OF(VTABLE);
}
