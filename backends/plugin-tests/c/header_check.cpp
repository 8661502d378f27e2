// The header must also compile as C++ (engines and plugins are often C++).
#include "hicache_storage.h"

static_assert(sizeof(hicache_key) == HICACHE_KEY_LEN, "a key is 48 bytes");
static_assert(offsetof(hicache_plugin_vtable, struct_size) == 8, "header fields first");
