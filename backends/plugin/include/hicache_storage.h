/*
 * hicache_storage.h — the hicache-rs L3 storage plugin ABI, version 1.2.
 *
 * A plugin is a shared library that exports one function, HICACHE_PLUGIN_ENTRY
 * ("hicache_storage_plugin"), returning a pointer to a static vtable. hicache-rs loads it with
 * dlopen when the storage extra-config says
 *
 *     {"backend": "plugin", "plugin_path": "/opt/x/libfoo.so", "plugin_config": {...}}
 *
 * and calls `create` with `plugin_config` serialised as JSON. Everything a plugin may rely on,
 * and everything it must guarantee, is written in this file; docs/plugin-abi.md explains it
 * with worked examples in C and in Rust.
 *
 * ---------------------------------------------------------------------------------------------
 * 1. VERSIONING
 *    - The vtable starts with abi_major, abi_minor, struct_size. The host refuses a plugin whose
 *      abi_major differs from its own, and one whose struct_size is smaller than the v1.0
 *      vtable (HICACHE_VTABLE_V1_0_SIZE).
 *    - Minor versions only append fields at the end of structs and add capability or flag bits.
 *      A host newer than the plugin treats the fields beyond the plugin's struct_size as absent
 *      (NULL functions, zero values). A plugin newer than the host is used through the common
 *      prefix: the host reads only the fields it knows.
 *    - Structs the host passes in (hicache_host) or hands out to be filled (hicache_plugin_info,
 *      hicache_stats) carry struct_size too: a plugin reads, or writes, only the fields that lie
 *      within it. hicache_key, hicache_iovec, hicache_page and hicache_error are frozen for a
 *      major version (they travel in arrays).
 *    - Unknown capability bits, info flags and memory flags are ignored by both sides.
 *
 * 2. OWNERSHIP: WHO FREES WHAT
 *    - Nothing allocated on one side is ever freed by the other. The only object that crosses
 *      is the plugin instance: `create` makes it, the host calls `destroy` exactly once.
 *    - The vtable, and its `name` and `version` strings, are the plugin's static data and must
 *      stay valid and unchanged for the life of the process. The host never unloads a plugin
 *      library (dlclose is never called), so static data is never invalidated.
 *    - Every pointer the host passes into a call (config text, hicache_host, keys, pages, iovecs,
 *      result arrays, the error buffer) is valid only for the duration of that call. A plugin
 *      must not keep it, with two exceptions: `host->log` and `host->log_ctx` stay valid for the
 *      life of the process, and the memory range given to `register_memory` stays mapped
 *      while the instance lives.
 *    - Error text goes into the host-owned buffer of the call's `hicache_error` (see 4): the
 *      plugin copies text in, nobody frees anything.
 *    - Log messages passed to the host's log callback are read during the callback only.
 *
 * 3. THREADING AND COMPLETION
 *    - Calls are synchronous: a call returns when its work is done. The host makes them from
 *      threads that may block (tokio's blocking sections), so a call may do blocking I/O.
 *    - `get_info`, `batch_*`, `get_stats`, `register_memory` and `test_corrupt_page` may be
 *      called concurrently from any number of threads on the same instance; the plugin
 *      synchronises internally. `create` may run concurrently with calls on other instances.
 *      `destroy` is called once, when no other call on that instance is in flight, and the
 *      instance is never used after it. The entry function may be called more than once, from
 *      any thread, and must return the same pointer each time.
 *    - The log callback may be called from any thread, at any time, including from threads the
 *      plugin owns and after `destroy`.
 *
 * 4. ERRORS
 *    - Every fallible function returns a hicache_status. On anything but HICACHE_OK the plugin
 *      should write a NUL-terminated, UTF-8 description into err->message (at most
 *      err->capacity bytes including the NUL; hicache_error_set below does it). The host
 *      guarantees err, err->message are non-NULL, err->capacity >= 256 and err->message[0] == 0
 *      on entry. The host reads the buffer only after the call returns; this is the call's
 *      "last error", and being per call it needs no thread-local storage.
 *    - Per-page problems are not call failures: they are per-page result codes, and the call
 *      returns HICACHE_OK. The plugin may describe the first failed page in err->message.
 *    - NO UNWINDING: no exception, Rust panic or longjmp may leave any function of this ABI,
 *      nor the host's log callback (the host never lets one leave it). The Rust SDK catches
 *      panics and reports HICACHE_ERR_PANIC.
 *    - The host validates what comes back: an unknown result code, a code of the wrong kind
 *      (HICACHE_PAGE_STORED from a get), a hit shorter or longer than the page, or a count
 *      larger than the batch is an error for that page (or that call), never trusted data.
 *
 * 5. PAGES
 *    - A page is named by a 48-byte key (16-byte namespace id, then the 32-byte page hash).
 *      Keys are opaque; two keys are the same page iff their bytes are equal.
 *    - A page's bytes are the concatenation of its parts (iovecs) in order; how they are cut
 *      into parts is the caller's business and must not be stored (a page written from 64
 *      parts may be read into one). With the bytes the plugin stores the page's metadata, its
 *      layout tag and total length, and compares them on read: a read whose destination has
 *      another layout or length is HICACHE_PAGE_MISS (counted in meta_mismatches) and leaves
 *      the destination untouched.
 *    - The storage contract of hicache-storage applies unchanged (its `backend` module lists
 *      the rules; its conformance suite checks them): a page is visible only after its whole
 *      write completed; bytes are verified on read (a mismatch is HICACHE_PAGE_CORRUPT, counted,
 *      and the copy dropped); batch_exists answers the leading run; set is idempotent; stored
 *      bytes stay within capacity by eviction; a page larger than the plugin accepts is
 *      HICACHE_PAGE_ERR_TOO_LARGE.
 *    - Pages passed to batch_set are read-only: the plugin must not write through their iovecs.
 *      The iovecs of one batch_get never overlap one another.
 * ---------------------------------------------------------------------------------------------
 */
#ifndef HICACHE_STORAGE_H
#define HICACHE_STORAGE_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Versions and the entry symbol ------------------------------------------------------ */

/** ABI major version: the host refuses a plugin of another major version. */
#define HICACHE_ABI_MAJOR 1u
/** ABI minor version: appended fields and new bits only (1: the batch-context entries; 2: the
 * clear entry). */
#define HICACHE_ABI_MINOR 2u

/** The one symbol a plugin exports: `const hicache_plugin_vtable *hicache_storage_plugin(void)`. */
#define HICACHE_PLUGIN_ENTRY hicache_storage_plugin
/** The entry symbol's name as a string, for dlsym. */
#define HICACHE_PLUGIN_ENTRY_NAME "hicache_storage_plugin"

/* ---- Status codes (call level) ---------------------------------------------------------- */

/** Outcome of a whole call. */
typedef int32_t hicache_status;
/** The call did its work; per-page outcomes are in the result array. */
#define HICACHE_OK 0
/** A pointer, count or page description was invalid. */
#define HICACHE_ERR_INVALID_ARGUMENT (-1)
/** `create`: the configuration was refused (message names the field). */
#define HICACHE_ERR_CONFIG (-2)
/** The batch has more pages than hicache_plugin_info.max_batch. */
#define HICACHE_ERR_BATCH_TOO_LARGE (-3)
/** The storage cannot serve calls now (closed, server gone). */
#define HICACHE_ERR_UNAVAILABLE (-4)
/** The function is not supported by this plugin. */
#define HICACHE_ERR_UNSUPPORTED (-5)
/** An I/O error that concerns the whole call. */
#define HICACHE_ERR_IO (-6)
/** Any other failure. */
#define HICACHE_ERR_INTERNAL (-7)
/** A Rust plugin panicked inside the call (the SDK caught it at the boundary). */
#define HICACHE_ERR_PANIC (-8)

/* ---- Per-page result codes --------------------------------------------------------------- */

/** Outcome of one page of a batch. */
typedef int32_t hicache_page_result;
/** Never valid: the host fills result arrays with it, so a page left unwritten is an error. */
#define HICACHE_PAGE_UNSET 0
/** get: the destination holds the page exactly as written (lengths[i] == page length). */
#define HICACHE_PAGE_HIT 1
/** get: absent, evicted, or stored with another layout or length. */
#define HICACHE_PAGE_MISS 2
/** get: the stored copy failed verification; it was dropped and counted. */
#define HICACHE_PAGE_CORRUPT 3
/** set: written and committed. */
#define HICACHE_PAGE_STORED 4
/** set: already present with the same metadata, not rewritten. */
#define HICACHE_PAGE_PRESENT 5
/** get/set: the page has no bytes. */
#define HICACHE_PAGE_ERR_EMPTY 10
/** set: the page is larger than the plugin accepts (or its whole capacity). */
#define HICACHE_PAGE_ERR_TOO_LARGE 11
/** set: full, and nothing could be evicted. */
#define HICACHE_PAGE_ERR_NO_SPACE 12
/** get/set: an I/O error for this page. */
#define HICACHE_PAGE_ERR_IO 13
/** get/set: any other failure of this page. */
#define HICACHE_PAGE_ERR_BACKEND 14

/* ---- Tags and flags ---------------------------------------------------------------------- */

/** Page layouts (the tag stored with a page; values of hicache-core's LayoutKind::tag). */
#define HICACHE_LAYOUT_LAYER_FIRST 1u
#define HICACHE_LAYOUT_PAGE_FIRST 2u
#define HICACHE_LAYOUT_PAGE_FIRST_DIRECT 3u

/** Capability: `register_memory` is provided. */
#define HICACHE_CAP_REGISTER_MEMORY (1u << 0)
/** Capability: `test_corrupt_page` is provided (fault injection for conformance tests). */
#define HICACHE_CAP_TEST_CORRUPT (1u << 1)
/**
 * Capability (1.1): `batch_exists_ctx`, `batch_get_ctx` and `batch_set_ctx` are provided. The
 * host then calls them instead of the plain entries. Ignored in a vtable whose struct_size is
 * below HICACHE_VTABLE_V1_1_SIZE.
 */
#define HICACHE_CAP_BATCH_CONTEXT (1u << 2)
/**
 * Capability (1.2): `clear` is provided. Ignored in a vtable whose struct_size is below
 * HICACHE_VTABLE_V1_2_SIZE. Whether an instance clears is its HICACHE_INFO_CLEAR flag: a plugin
 * may provide the entry for every instance and support it for some.
 */
#define HICACHE_CAP_CLEAR (1u << 3)

/** Batch-context flag: prefix_keys / prefix_count are given (possibly 0 keys: the batch starts
 * the request). Without it the host passes no prefix keys. */
#define HICACHE_CONTEXT_HAS_PREFIX (1u << 0)
/** Batch-context flag: extra_info / extra_info_len are given. */
#define HICACHE_CONTEXT_HAS_EXTRA_INFO (1u << 1)

/** Info flag: pages move between caller buffers and the medium without a staging copy. */
#define HICACHE_INFO_ZERO_COPY (1u << 0)
/** Info flag: pages survive a restart of the process. */
#define HICACHE_INFO_PERSISTENT (1u << 1)
/** Info flag: several processes may use the same storage at once. */
#define HICACHE_INFO_SHARED (1u << 2)
/** Info flag (1.2): this instance supports `clear` (the vtable has HICACHE_CAP_CLEAR). Without
 * it the host never calls `clear` and answers "unsupported" itself. */
#define HICACHE_INFO_CLEAR (1u << 3)

/** Memory flag: the region is page-locked with the GPU driver (cuMemHostRegister). */
#define HICACHE_MEMORY_CUDA_REGISTERED (1u << 0)
/** Memory flag: the region is backed by 2 MiB huge pages. */
#define HICACHE_MEMORY_HUGE_PAGES (1u << 1)

/** Log levels of the host's log callback (tracing's levels). */
#define HICACHE_LOG_ERROR 1
#define HICACHE_LOG_WARN 2
#define HICACHE_LOG_INFO 3
#define HICACHE_LOG_DEBUG 4
#define HICACHE_LOG_TRACE 5

/* ---- Plain data ---------------------------------------------------------------------------- */

/** Bytes of a page key. */
#define HICACHE_KEY_LEN 48
/** Bytes of the namespace id at the start of a key. */
#define HICACHE_NAMESPACE_LEN 16

/** A page key: namespace id (16 bytes) then page hash (32 bytes). */
typedef struct hicache_key {
    uint8_t bytes[HICACHE_KEY_LEN];
} hicache_key;

/** One contiguous part of a page in caller memory. */
typedef struct hicache_iovec {
    /** Start of the part (read-only for batch_set). Non-NULL when len > 0. */
    void *base;
    /** Bytes in the part. */
    uint64_t len;
} hicache_iovec;

/** One page: its parts, in order, and its metadata. */
typedef struct hicache_page {
    /** `part_count` parts; their lengths add up to `len`. */
    const hicache_iovec *parts;
    /** Number of parts (at least 1 when len > 0). */
    uint64_t part_count;
    /** Total bytes of the page. */
    uint64_t len;
    /** HICACHE_LAYOUT_* of the bytes. */
    uint32_t layout;
    /** Zero. */
    uint32_t reserved;
} hicache_page;

/** The host-owned buffer a failing call writes its error text into (see 4. ERRORS). */
typedef struct hicache_error {
    /** `capacity` bytes; holds "" on entry. */
    char *message;
    /** Size of `message` in bytes, including room for the NUL. */
    uint64_t capacity;
} hicache_error;

/**
 * The context of one batch (1.1), lent for the call like the keys: the keys of the pages before
 * the batch's first page in the same request, root first (SGLang's `prefix_keys`, passed when
 * `hicache_storage_pass_prefix_keys` is on), and the engine's opaque extra info. A plugin may
 * use it to place a request's pages together or to read ahead; it must answer exactly as the
 * plain entry would (same results, same bytes).
 */
typedef struct hicache_batch_context {
    /** sizeof(hicache_batch_context) as the host compiled it; read only fields within it. */
    uint32_t struct_size;
    /** HICACHE_CONTEXT_* flags. */
    uint32_t flags;
    /** `prefix_count` keys (non-NULL when prefix_count > 0). */
    const hicache_key *prefix_keys;
    uint64_t prefix_count;
    /** UTF-8 text of extra_info_len bytes, not NUL-terminated (non-NULL when the length > 0). */
    const char *extra_info;
    uint64_t extra_info_len;
} hicache_batch_context;

/**
 * The host's log callback: `level` is HICACHE_LOG_*, `target` names the module or component
 * (may be empty), `message` is UTF-8. Neither string needs a NUL. Thread-safe; never unwinds.
 */
typedef void (*hicache_log_fn)(void *ctx, int32_t level, const char *target, uint64_t target_len,
                               const char *message, uint64_t message_len);

/** What the host tells `create`. Valid during `create` only (copy what you need). */
typedef struct hicache_host {
    /** sizeof(hicache_host) as the host compiled it; read only fields within it. */
    uint32_t struct_size;
    /** The host's ABI major version. */
    uint32_t abi_major;
    /** The host's ABI minor version. */
    uint32_t abi_minor;
    /** The most verbose level the host records (HICACHE_LOG_*; 0 = none): skip formatting above it. */
    int32_t max_log_level;
    /** The log callback (never NULL) and its context; both valid for the life of the process. */
    hicache_log_fn log;
    void *log_ctx;
    /** Configured capacity in bytes (the extra-config's `capacity`); 0 = the plugin's default. */
    uint64_t capacity_bytes;
    /** Bytes of one page in this deployment; 0 = unknown or varied. */
    uint64_t page_bytes;
    /** HICACHE_LAYOUT_* of the host pool. */
    uint32_t layout;
    /** Tensor-parallel rank and size, pipeline-parallel rank and size. */
    uint32_t tp_rank;
    uint32_t tp_size;
    uint32_t pp_rank;
    uint32_t pp_size;
    /** Whether `namespace_id` holds this rank's namespace. */
    uint32_t has_namespace;
    uint8_t namespace_id[HICACHE_NAMESPACE_LEN];
} hicache_host;

/** What an instance is and can do; constant for the instance's life. */
typedef struct hicache_plugin_info {
    /** Set by the host: bytes of this struct the plugin may write. */
    uint32_t struct_size;
    /** HICACHE_INFO_* flags. */
    uint32_t flags;
    /** Largest batch the plugin accepts (at least 1; the host never sends more). */
    uint64_t max_batch;
    /** Largest page in bytes; 0 = no limit. */
    uint64_t max_page_bytes;
    /** Capacity in bytes; 0 = unbounded. */
    uint64_t capacity_bytes;
} hicache_plugin_info;

/** Counters, as hicache-storage's StorageStats (same names, same meanings). */
typedef struct hicache_stats {
    /** Set by the host: bytes of this struct the plugin may write. */
    uint32_t struct_size;
    /** Zero. */
    uint32_t reserved;
    uint64_t pages;
    uint64_t bytes;
    /** 0 = unbounded. */
    uint64_t capacity_bytes;
    uint64_t exists_calls;
    uint64_t exists_keys;
    uint64_t exists_hits;
    uint64_t get_pages;
    uint64_t get_hits;
    uint64_t get_misses;
    uint64_t meta_mismatches;
    uint64_t get_corrupt;
    uint64_t get_errors;
    uint64_t get_bytes;
    uint64_t set_pages;
    uint64_t set_stored;
    uint64_t set_present;
    uint64_t set_errors;
    uint64_t set_bytes;
    uint64_t evicted_pages;
    uint64_t evicted_bytes;
    uint64_t deleted_pages;
    uint64_t discarded_on_open;
    /* ---- 1.2 ---- */
    /** Pages removed by `clear`. */
    uint64_t cleared_pages;
} hicache_stats;

/** An instance of a plugin: opaque to the host. */
typedef struct hicache_plugin hicache_plugin;

/* ---- The vtable ------------------------------------------------------------------------------ */

/** The plugin's functions. Static storage; see 1. VERSIONING for the first three fields. */
typedef struct hicache_plugin_vtable {
    /** HICACHE_ABI_MAJOR the plugin was built against. */
    uint32_t abi_major;
    /** HICACHE_ABI_MINOR the plugin was built against. */
    uint32_t abi_minor;
    /** sizeof(hicache_plugin_vtable) as the plugin compiled it. */
    uint32_t struct_size;
    /** HICACHE_CAP_* bits. */
    uint32_t capabilities;
    /** Plugin name and version: static, NUL-terminated UTF-8, at most 255 bytes each. */
    const char *name;
    const char *version;

    /**
     * Creates an instance from `config_json` (a JSON object, UTF-8, `config_len` bytes, followed
     * by a NUL the length does not count). On HICACHE_OK `*out` holds the instance. Anything
     * else: nothing was created and err says why.
     */
    hicache_status (*create)(const char *config_json, uint64_t config_len, const hicache_host *host,
                             hicache_plugin **out, hicache_error *err);
    /** Destroys an instance and frees everything it owns. Called once; never fails. */
    void (*destroy)(hicache_plugin *plugin);
    /** Fills `out` (see hicache_plugin_info.struct_size). Called once after create. */
    hicache_status (*get_info)(hicache_plugin *plugin, hicache_plugin_info *out, hicache_error *err);
    /** `*present` = the number of leading keys that are present (the index of the first absent). */
    hicache_status (*batch_exists)(hicache_plugin *plugin, const hicache_key *keys, uint64_t count,
                                   uint64_t *present, hicache_error *err);
    /**
     * Reads keys[i] into pages[i]; results[i] = HIT, MISS, CORRUPT or ERR_*, and lengths[i] =
     * the bytes written into pages[i] (the page's length for a HIT).
     */
    hicache_status (*batch_get)(hicache_plugin *plugin, const hicache_key *keys,
                                const hicache_page *pages, uint64_t count,
                                hicache_page_result *results, uint64_t *lengths, hicache_error *err);
    /** Writes pages[i] under keys[i]; results[i] = STORED, PRESENT or ERR_*. */
    hicache_status (*batch_set)(hicache_plugin *plugin, const hicache_key *keys,
                                const hicache_page *pages, uint64_t count,
                                hicache_page_result *results, hicache_error *err);
    /** Removes the present pages of `keys`; `*removed` = how many were removed. */
    hicache_status (*batch_delete)(hicache_plugin *plugin, const hicache_key *keys, uint64_t count,
                                   uint64_t *removed, hicache_error *err);
    /** Fills `out` (see hicache_stats.struct_size). */
    hicache_status (*get_stats)(hicache_plugin *plugin, hicache_stats *out, hicache_error *err);

    /**
     * Optional (HICACHE_CAP_REGISTER_MEMORY): the long-lived region later page buffers lie in
     * (the pinned host pool), announced at most once, before any I/O. HICACHE_MEMORY_* flags.
     */
    hicache_status (*register_memory)(hicache_plugin *plugin, void *addr, uint64_t len,
                                      uint32_t flags, hicache_error *err);
    /**
     * Optional (HICACHE_CAP_TEST_CORRUPT), for tests only: damages the stored bytes of `key`
     * behind the plugin's back (as a disk or memory fault would) without fixing its checksum;
     * `*found` = 1 if the page was present, else 0. Production plugins may leave it out.
     */
    hicache_status (*test_corrupt_page)(hicache_plugin *plugin, const hicache_key *key,
                                        uint32_t *found, hicache_error *err);

    /* ---- 1.1 ---- */

    /**
     * Optional (HICACHE_CAP_BATCH_CONTEXT, all three together): batch_exists, batch_get and
     * batch_set with the batch's context (`ctx` non-NULL, valid for the call). Same results as
     * the plain entries; a 1.0 plugin lacks them and the host calls the plain entries.
     */
    hicache_status (*batch_exists_ctx)(hicache_plugin *plugin, const hicache_key *keys,
                                       uint64_t count, const hicache_batch_context *ctx,
                                       uint64_t *present, hicache_error *err);
    hicache_status (*batch_get_ctx)(hicache_plugin *plugin, const hicache_key *keys,
                                    const hicache_page *pages, uint64_t count,
                                    const hicache_batch_context *ctx, hicache_page_result *results,
                                    uint64_t *lengths, hicache_error *err);
    hicache_status (*batch_set_ctx)(hicache_plugin *plugin, const hicache_key *keys,
                                    const hicache_page *pages, uint64_t count,
                                    const hicache_batch_context *ctx, hicache_page_result *results,
                                    hicache_error *err);

    /* ---- 1.2 ---- */

    /**
     * Optional (HICACHE_CAP_CLEAR; called only on an instance whose info has
     * HICACHE_INFO_CLEAR): removes every page of the namespace `namespace_id` (16 bytes, as in
     * hicache_key) that the instance holds, never a page of another namespace nor anything not
     * its own; `*removed` = how many pages were removed (0 for an empty namespace). Afterwards
     * those keys read as misses and can be set again. A persistent plugin clears crash-safely:
     * after a crash during the clear each page of the namespace is intact or absent. Pages whose
     * sets overlap the clear may survive it. Counts the pages in hicache_stats.cleared_pages.
     */
    hicache_status (*clear)(hicache_plugin *plugin,
                            const uint8_t namespace_id[HICACHE_NAMESPACE_LEN], uint64_t *removed,
                            hicache_error *err);
} hicache_plugin_vtable;

/** Size of the v1.0 vtable: the smallest struct_size a v1 host accepts. */
#define HICACHE_VTABLE_V1_0_SIZE (offsetof(hicache_plugin_vtable, test_corrupt_page) + sizeof(void *))
/** Size of the v1.1 vtable (the batch-context entries). */
#define HICACHE_VTABLE_V1_1_SIZE (offsetof(hicache_plugin_vtable, batch_set_ctx) + sizeof(void *))
/** Size of the v1.2 vtable (the clear entry). */
#define HICACHE_VTABLE_V1_2_SIZE (offsetof(hicache_plugin_vtable, clear) + sizeof(void *))

/** The entry function's type. */
typedef const hicache_plugin_vtable *(*hicache_plugin_entry_fn)(void);

/* ---- Helpers ------------------------------------------------------------------------------- */

/** Writes printf-style text into a call's error buffer (truncating, always NUL-terminated). */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static inline void hicache_error_set(hicache_error *err, const char *fmt, ...) {
    if (err == NULL || err->message == NULL || err->capacity == 0) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, (size_t)err->capacity, fmt, ap);
    va_end(ap);
}

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* HICACHE_STORAGE_H */
