/* What a C compiler makes of hicache_storage.h: sizes and offsets in the order of
 * hicache_backend_plugin::abi::layout_probe(), compared by tests/abi_layout.rs. */
#include "hicache_storage.h"

#define S(t) (uint64_t) sizeof(t)
#define O(t, f) (uint64_t) offsetof(t, f)

__attribute__((visibility("default"))) const uint64_t hicache_layout_probe[] = {
    S(hicache_key),
    S(hicache_iovec),
    O(hicache_iovec, len),
    S(hicache_page),
    O(hicache_page, part_count),
    O(hicache_page, len),
    O(hicache_page, layout),
    S(hicache_error),
    O(hicache_error, capacity),
    S(hicache_host),
    O(hicache_host, max_log_level),
    O(hicache_host, log),
    O(hicache_host, log_ctx),
    O(hicache_host, capacity_bytes),
    O(hicache_host, page_bytes),
    O(hicache_host, layout),
    O(hicache_host, pp_size),
    O(hicache_host, has_namespace),
    O(hicache_host, namespace_id),
    S(hicache_plugin_info),
    O(hicache_plugin_info, max_batch),
    O(hicache_plugin_info, capacity_bytes),
    S(hicache_stats),
    O(hicache_stats, pages),
    O(hicache_stats, meta_mismatches),
    O(hicache_stats, discarded_on_open),
    S(hicache_plugin_vtable),
    O(hicache_plugin_vtable, struct_size),
    O(hicache_plugin_vtable, name),
    O(hicache_plugin_vtable, create),
    O(hicache_plugin_vtable, destroy),
    O(hicache_plugin_vtable, get_info),
    O(hicache_plugin_vtable, batch_exists),
    O(hicache_plugin_vtable, batch_get),
    O(hicache_plugin_vtable, batch_set),
    O(hicache_plugin_vtable, batch_delete),
    O(hicache_plugin_vtable, get_stats),
    O(hicache_plugin_vtable, register_memory),
    O(hicache_plugin_vtable, test_corrupt_page),
    O(hicache_plugin_vtable, batch_exists_ctx),
    O(hicache_plugin_vtable, batch_get_ctx),
    O(hicache_plugin_vtable, batch_set_ctx),
    O(hicache_plugin_vtable, clear),
    (uint64_t)HICACHE_VTABLE_V1_0_SIZE,
    (uint64_t)HICACHE_VTABLE_V1_1_SIZE,
    (uint64_t)HICACHE_VTABLE_V1_2_SIZE,
    O(hicache_stats, cleared_pages),
    S(hicache_batch_context),
    O(hicache_batch_context, prefix_keys),
    O(hicache_batch_context, prefix_count),
    O(hicache_batch_context, extra_info),
    O(hicache_batch_context, extra_info_len),
};

__attribute__((visibility("default"))) const uint64_t hicache_layout_probe_len =
    sizeof hicache_layout_probe / sizeof hicache_layout_probe[0];
