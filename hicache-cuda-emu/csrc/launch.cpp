// The transfer kernels (hicache-gpu/src/kernels.cu, included verbatim) and a launcher that
// runs every block and thread of a grid on the calling thread.
#include "cuda_shim.h"

#include <cstring>

thread_local hc_dim3 threadIdx;
thread_local hc_dim3 blockIdx;
thread_local hc_dim3 blockDim;
thread_local hc_dim3 gridDim;
thread_local hc_access_fn hc_access_check = nullptr;
thread_local void* hc_access_ctx = nullptr;
thread_local int hc_fault = 0;

#include HICACHE_KERNEL_SOURCE

namespace {

typedef void (*copy_kernel)(const CopyParams);

struct Entry {
    const char* name;
    copy_kernel fn;
};

const Entry ENTRIES[] = {
    {"hicache_copy_w16", hicache_copy_w16}, {"hicache_copy_w8", hicache_copy_w8},
    {"hicache_copy_w4", hicache_copy_w4},   {"hicache_copy_w2", hicache_copy_w2},
    {"hicache_copy_w1", hicache_copy_w1},
};

const size_t NUM_ENTRIES = sizeof(ENTRIES) / sizeof(ENTRIES[0]);

}  // namespace

extern "C" size_t hicache_emu_kernel_count(void) { return NUM_ENTRIES; }

extern "C" const char* hicache_emu_kernel_name(size_t i) {
    return i < NUM_ENTRIES ? ENTRIES[i].name : nullptr;
}

// Bytes of the kernel's parameter block (its one by-value argument).
extern "C" size_t hicache_emu_kernel_param_bytes(size_t i) {
    return i < NUM_ENTRIES ? sizeof(CopyParams) : 0;
}

// Runs kernel i over grid x block. Returns 0 when every access was allowed, 1 when the checker
// refused one (the launch still ran to the end, skipping refused accesses), 2 for a bad index
// or parameter size.
extern "C" int hicache_emu_kernel_run(size_t i, const unsigned int grid[3],
                                      const unsigned int block[3], const void* params,
                                      size_t param_bytes, hc_access_fn check, void* ctx) {
    if (i >= NUM_ENTRIES || param_bytes != sizeof(CopyParams)) return 2;
    CopyParams p;
    std::memcpy(&p, params, sizeof p);
    gridDim = hc_dim3{grid[0], grid[1], grid[2]};
    blockDim = hc_dim3{block[0], block[1], block[2]};
    hc_access_check = check;
    hc_access_ctx = ctx;
    hc_fault = 0;
    for (unsigned int bz = 0; bz < grid[2]; ++bz)
        for (unsigned int by = 0; by < grid[1]; ++by)
            for (unsigned int bx = 0; bx < grid[0]; ++bx) {
                blockIdx = hc_dim3{bx, by, bz};
                for (unsigned int tz = 0; tz < block[2]; ++tz)
                    for (unsigned int ty = 0; ty < block[1]; ++ty)
                        for (unsigned int tx = 0; tx < block[0]; ++tx) {
                            threadIdx = hc_dim3{tx, ty, tz};
                            ENTRIES[i].fn(p);
                        }
            }
    const int fault = hc_fault;
    hc_access_check = nullptr;
    hc_access_ctx = nullptr;
    hc_fault = 0;
    return fault ? 1 : 0;
}
