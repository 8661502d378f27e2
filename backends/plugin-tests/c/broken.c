/*
 * Deliberately broken plugins for the loader's tests, one per -D flag:
 *   BROKEN_ABI_MAJOR       vtable says ABI major 2
 *   BROKEN_NULL_VTABLE     the entry function returns NULL
 *   BROKEN_SMALL_VTABLE    struct_size smaller than a v1.0 vtable
 *   BROKEN_NULL_FUNCTION   batch_get is NULL
 *   BROKEN_CAP_WITHOUT_FN  HICACHE_CAP_TEST_CORRUPT set, test_corrupt_page NULL
 *   BROKEN_CONTEXT_CAP_WITHOUT_FN  HICACHE_CAP_BATCH_CONTEXT set, batch_*_ctx NULL
 *   BROKEN_CLEAR_CAP_WITHOUT_FN    HICACHE_CAP_CLEAR set (1.2 vtable), clear NULL
 *   BROKEN_CREATE_FAILS    create fails with HICACHE_ERR_UNAVAILABLE and a message
 *   BROKEN_ZERO_BATCH      get_info reports max_batch 0
 *   BROKEN_GARBAGE         well-formed vtable, garbage results (see below)
 * Without a flag it is a valid (if useless) plugin: every call succeeds, every get misses.
 */
#include <stdlib.h>
#include <string.h>

#include "hicache_storage.h"

struct hicache_plugin {
    int unused;
};

static hicache_status b_create(const char *config_json, uint64_t config_len,
                               const hicache_host *host, hicache_plugin **out,
                               hicache_error *err) {
    (void)config_json;
    (void)config_len;
    static const char target[] = "broken";
    static const char msg[] = "broken plugin create called";
    host->log(host->log_ctx, HICACHE_LOG_DEBUG, target, sizeof target - 1, msg, sizeof msg - 1);
#ifdef BROKEN_CREATE_FAILS
    (void)out;
    hicache_error_set(err, "cannot reach the storage server at %s:%d", "10.0.0.1", 7000);
    return HICACHE_ERR_UNAVAILABLE;
#else
    (void)err;
    *out = calloc(1, sizeof **out);
    return *out ? HICACHE_OK : HICACHE_ERR_INTERNAL;
#endif
}

static void b_destroy(hicache_plugin *p) { free(p); }

static hicache_status b_get_info(hicache_plugin *p, hicache_plugin_info *out, hicache_error *err) {
    (void)p;
    (void)err;
#ifdef BROKEN_ZERO_BATCH
    out->max_batch = 0;
#else
    out->max_batch = 128;
#endif
    out->flags = 0;
    out->max_page_bytes = 0;
    out->capacity_bytes = 0;
    return HICACHE_OK;
}

static hicache_status b_batch_exists(hicache_plugin *p, const hicache_key *keys, uint64_t count,
                                     uint64_t *present, hicache_error *err) {
    (void)p;
    (void)keys;
    (void)err;
#ifdef BROKEN_GARBAGE
    *present = count + 5; /* more than the batch */
#else
    (void)count;
    *present = 0;
#endif
    return HICACHE_OK;
}

/* BROKEN_GARBAGE get: by page index i % 6:
 *   0: result code 77 (unknown)     1: HICACHE_PAGE_STORED (a set code)
 *   2: HIT with half the bytes       3: result left unset
 *   4: HIT, full length (valid)      5: HIT claiming one byte more than the page */
/* Not static: BROKEN_NULL_FUNCTION leaves it out of the vtable (hidden visibility anyway). */
hicache_status b_batch_get(hicache_plugin *p, const hicache_key *keys,
                                  const hicache_page *pages, uint64_t count,
                                  hicache_page_result *results, uint64_t *lengths,
                                  hicache_error *err) {
    (void)p;
    (void)keys;
    (void)err;
    for (uint64_t i = 0; i < count; i++) {
#ifdef BROKEN_GARBAGE
        switch (i % 6) {
        case 0: results[i] = 77; break;
        case 1: results[i] = HICACHE_PAGE_STORED; break;
        case 2:
            results[i] = HICACHE_PAGE_HIT;
            lengths[i] = pages[i].len / 2;
            break;
        case 3: break;
        case 4:
            for (uint64_t j = 0; j < pages[i].part_count; j++) {
                memset(pages[i].parts[j].base, 0xab, pages[i].parts[j].len);
            }
            results[i] = HICACHE_PAGE_HIT;
            lengths[i] = pages[i].len;
            break;
        default:
            results[i] = HICACHE_PAGE_HIT;
            lengths[i] = pages[i].len + 1;
            break;
        }
#else
        (void)pages;
        (void)lengths;
        results[i] = HICACHE_PAGE_MISS;
#endif
    }
    return HICACHE_OK;
}

/* BROKEN_GARBAGE set: by page index i % 3: 0: code -5, 1: HICACHE_PAGE_HIT (a get code),
 * 2: HICACHE_PAGE_STORED (valid). */
static hicache_status b_batch_set(hicache_plugin *p, const hicache_key *keys,
                                  const hicache_page *pages, uint64_t count,
                                  hicache_page_result *results, hicache_error *err) {
    (void)p;
    (void)keys;
    (void)pages;
    (void)err;
    for (uint64_t i = 0; i < count; i++) {
#ifdef BROKEN_GARBAGE
        results[i] = i % 3 == 0 ? -5 : i % 3 == 1 ? HICACHE_PAGE_HIT : HICACHE_PAGE_STORED;
#else
        results[i] = HICACHE_PAGE_STORED;
#endif
    }
    return HICACHE_OK;
}

static hicache_status b_batch_delete(hicache_plugin *p, const hicache_key *keys, uint64_t count,
                                     uint64_t *removed, hicache_error *err) {
    (void)p;
    (void)keys;
#ifdef BROKEN_GARBAGE
    (void)err;
    *removed = count + 1; /* more than the batch */
    return HICACHE_OK;
#else
    (void)count;
    (void)removed;
    hicache_error_set(err, "delete is broken on purpose");
    return 12345; /* an unknown status code */
#endif
}

static hicache_status b_get_stats(hicache_plugin *p, hicache_stats *out, hicache_error *err) {
    (void)p;
    (void)out;
    hicache_error_set(err, "no stats here");
    return HICACHE_ERR_UNSUPPORTED;
}

static const hicache_plugin_vtable VTABLE = {
#ifdef BROKEN_ABI_MAJOR
    2,
#else
    HICACHE_ABI_MAJOR,
#endif
    HICACHE_ABI_MINOR,
#ifdef BROKEN_SMALL_VTABLE
    offsetof(hicache_plugin_vtable, batch_get),
#else
    sizeof(hicache_plugin_vtable),
#endif
#if defined(BROKEN_CAP_WITHOUT_FN)
    HICACHE_CAP_TEST_CORRUPT,
#elif defined(BROKEN_CONTEXT_CAP_WITHOUT_FN)
    HICACHE_CAP_BATCH_CONTEXT,
#elif defined(BROKEN_CLEAR_CAP_WITHOUT_FN)
    HICACHE_CAP_CLEAR,
#else
    0,
#endif
    "broken",
    "0.0.1",
    b_create,
    b_destroy,
    b_get_info,
    b_batch_exists,
#ifdef BROKEN_NULL_FUNCTION
    NULL,
#else
    b_batch_get,
#endif
    b_batch_set,
    b_batch_delete,
    b_get_stats,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL,
};

__attribute__((visibility("default"))) const hicache_plugin_vtable *HICACHE_PLUGIN_ENTRY(void) {
#ifdef BROKEN_NULL_VTABLE
    (void)VTABLE;
    return NULL;
#else
    return &VTABLE;
#endif
}
