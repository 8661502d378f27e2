typedef unsigned long long u64;
typedef unsigned int u32;

// Must match hicache_gpu::copy::CopyParams (repr(C), every u64 before every u32).
struct CopyParams {
    u64 dev_table;
    u64 dev_pages;
    u64 host_pages;
    u64 host_base;
    u64 host_half_stride;
    u64 host_page_stride;
    u64 host_layer_stride;
    u64 host_token_stride;
    u64 dev_page_stride;
    u32 num_pairs;
    u32 layer_begin;
    u32 num_layers;
    u32 total_layers;
    u32 num_halves;
    u32 page_size;
    u32 row_bytes;
    u32 to_host;
    u32 rows_per_chunk;
    u32 chunks_per_unit;
};

#ifndef HICACHE_UNROLL
#define HICACHE_UNROLL 4
#endif

template <typename W>
__device__ __forceinline__ void copy_pages(const CopyParams& p) {
    const u32 lane = threadIdx.x & 31u;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 units = (u64)p.num_pairs * p.num_halves * p.num_layers;
    const u64 items = units * p.chunks_per_unit;
    const u32 words_per_row = p.row_bytes / (u32)sizeof(W);
    const u64* table = (const u64*)p.dev_table;
    const u32* dpages = (const u32*)p.dev_pages;
    const u32* hpages = (const u32*)p.host_pages;

    for (u64 item = warp; item < items; item += nwarps) {
        const u64 unit = item / p.chunks_per_unit;
        const u32 chunk = (u32)(item - unit * p.chunks_per_unit);
        const u32 layer = p.layer_begin + (u32)(unit % p.num_layers);
        const u64 t = unit / p.num_layers;
        const u32 half = (u32)(t % p.num_halves);
        const u64 pair = t / p.num_halves;

        const u64 dev = __ldg(table + (u64)half * p.total_layers + layer)
                      + (u64)__ldg(dpages + pair) * p.dev_page_stride;
        const u64 host = p.host_base + (u64)half * p.host_half_stride
                       + (u64)__ldg(hpages + pair) * p.host_page_stride
                       + (u64)layer * p.host_layer_stride;
        const u32 row0 = chunk * p.rows_per_chunk;
        const u32 rows = min(p.rows_per_chunk, p.page_size - row0);

        u64 src, dst, src_stride, dst_stride;
        if (p.to_host) {
            src = dev;  src_stride = p.row_bytes;
            dst = host; dst_stride = p.host_token_stride;
        } else {
            src = host; src_stride = p.host_token_stride;
            dst = dev;  dst_stride = p.row_bytes;
        }
        src += (u64)row0 * src_stride;
        dst += (u64)row0 * dst_stride;

        const u32 n = rows * words_per_row;
        for (u32 base = lane; base < n; base += 32u * HICACHE_UNROLL) {
            W r[HICACHE_UNROLL];
#pragma unroll
            for (int k = 0; k < HICACHE_UNROLL; ++k) {
                const u32 i = base + 32u * k;
                if (i < n) {
                    const u32 row = i / words_per_row;
                    const u32 col = i - row * words_per_row;
                    r[k] = __ldcs((const W*)(src + (u64)row * src_stride) + col);
                }
            }
#pragma unroll
            for (int k = 0; k < HICACHE_UNROLL; ++k) {
                const u32 i = base + 32u * k;
                if (i < n) {
                    const u32 row = i / words_per_row;
                    const u32 col = i - row * words_per_row;
                    __stcs((W*)(dst + (u64)row * dst_stride) + col, r[k]);
                }
            }
        }
    }
}

extern "C" __global__ void hicache_copy_w16(const CopyParams p) { copy_pages<uint4>(p); }
extern "C" __global__ void hicache_copy_w8(const CopyParams p) { copy_pages<unsigned long long>(p); }
extern "C" __global__ void hicache_copy_w4(const CopyParams p) { copy_pages<unsigned int>(p); }
extern "C" __global__ void hicache_copy_w2(const CopyParams p) { copy_pages<unsigned short>(p); }
extern "C" __global__ void hicache_copy_w1(const CopyParams p) { copy_pages<unsigned char>(p); }
