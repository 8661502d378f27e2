// Lets CUDA C++ kernel source compile as host C++ so that the CPU runs the very text NVRTC
// compiles. A grid runs one (block, thread) at a time on the calling thread (launch.cpp): the
// built-in indices are thread-local, so launches on different host threads (the emulated
// driver's streams) do not interfere. Kernels that need `__syncthreads` or shared memory are
// not supported (ours use neither).
#pragma once

#include <cstddef>
#include <cstdint>

struct hc_dim3 {
    unsigned int x, y, z;
};

extern thread_local hc_dim3 threadIdx;
extern thread_local hc_dim3 blockIdx;
extern thread_local hc_dim3 blockDim;
extern thread_local hc_dim3 gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__

struct uint4 {
    unsigned int x, y, z, w;
};

// Memory checking: every global load and store of a kernel goes through hc_access, which asks
// the launch's checker (if any). A refused access is not performed (a load yields zeros) and
// marks the launch as faulted, as CUDA_ERROR_ILLEGAL_ADDRESS would.
typedef int (*hc_access_fn)(void* ctx, const void* addr, size_t bytes, int write);
extern thread_local hc_access_fn hc_access_check;
extern thread_local void* hc_access_ctx;
extern thread_local int hc_fault;

static inline bool hc_access(const void* addr, size_t bytes, int write) {
    if (hc_access_check != nullptr && hc_access_check(hc_access_ctx, addr, bytes, write) != 0) {
        hc_fault = 1;
        return false;
    }
    return true;
}

template <typename T>
static inline T __ldg(const T* p) {
    return hc_access(p, sizeof(T), 0) ? *p : T();
}

template <typename T>
static inline T __ldcs(const T* p) {
    return hc_access(p, sizeof(T), 0) ? *p : T();
}

template <typename T>
static inline void __stcs(T* p, T v) {
    if (hc_access(p, sizeof(T), 1)) *p = v;
}

template <typename T>
static inline T min(T a, T b) {
    return b < a ? b : a;
}

template <typename T>
static inline T max(T a, T b) {
    return a < b ? b : a;
}
