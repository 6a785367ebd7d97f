// Shared by every kernel file of the CUDA backend. NVRTC compiles these without the CUDA
// toolkit's headers (the worker image carries only the runtime libraries), so the integer
// types, the half-precision conversions and the reductions are spelled out here.
//
// Launch conventions (backend/cuda/mod.rs): 1-D grids; elementwise kernels walk their range
// with a grid-stride loop; row kernels give each row one block of BLOCK threads.

typedef signed char i8;
typedef unsigned char u8;
typedef short i16;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define BLOCK 256
#define MAX_DIMS 8
// No math.h under NVRTC: the constants are spelled as bits.
#define NEG_INF __int_as_float(0xff800000)

// A shape and one operand's strides in elements, by value (kernel parameters); a broadcast
// dimension has stride 0.
struct Dims {
    i64 rank;
    i64 size[MAX_DIMS];
};
struct Strides {
    i64 at[MAX_DIMS];
};

__device__ __forceinline__ i64 first_index() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 grid_stride() { return (i64)gridDim.x * blockDim.x; }

// The offset in an operand with strides `s` of the element at flat index `i` of shape `d`.
// Below 2³² the index is divided in 32 bits: a 64-bit division is a long software routine on
// the GPU, and these divisions were most of a strided copy's time.
__device__ __forceinline__ i64 offset_of(i64 i, const Dims& d, const Strides& s) {
    i64 off = 0;
    if ((u64)i <= 0xffffffffull) {
        u32 j = (u32)i;
        for (int k = (int)d.rank - 1; k >= 0; --k) {
            u64 n = (u64)d.size[k];
            if (n > j) {  // j is this dimension's index and nothing is left for the outer ones
                off += (i64)j * s.at[k];
                return off;
            }
            u32 m = (u32)n;
            off += (i64)(j % m) * s.at[k];
            j /= m;
        }
        return off;
    }
    for (int k = (int)d.rank - 1; k >= 0; --k) {
        i64 n = d.size[k];
        off += (i % n) * s.at[k];
        i /= n;
    }
    return off;
}

// i / d, with i % d in *r (i ≥ 0, d > 0): in 32 bits where both fit, as offset_of divides, else
// in 64. Kernels that find an element's coordinates from its flat index divide by sizes several
// times per element, and a 64-bit division's routine can cost more than the element's own work.
__device__ __forceinline__ i64 divmod(i64 i, i64 d, i64* r) {
    if ((u64)(i | d) <= 0xffffffffull) {
        u32 q = (u32)i / (u32)d;
        *r = (i64)((u32)i - q * (u32)d);
        return (i64)q;
    }
    i64 q = i / d;
    *r = i - q * d;
    return q;
}

// Sixteen bytes moved as one, the widest load and store a thread has: the word of a strided
// move whose layout allows it (launch.rs's strided_move).
struct alignas(16) u128 {
    u64 lo, hi;
};

// bf16 is the top half of an f32; rounding to nearest even, NaN kept quiet.
__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#ifdef TF_EMULATE
// The tests' CPU emulator (worker/tests/cuda_emulator/) has no PTX: the compiler's _Float16.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    _Float16 h = (_Float16)f;
    u16 b;
    memcpy(&b, &h, 2);
    return b;
}
#else
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}
#endif

// Two adjacent halves as one 32-bit word (the lower index in the low bits), read from or
// written to a 4-byte-aligned address.
#ifdef TF_EMULATE
__device__ __forceinline__ u32 ld_pair(const u16* p) {
    u32 w;
    memcpy(&w, p, 4);
    return w;
}
__device__ __forceinline__ void st_pair(u16* p, u32 w) { memcpy(p, &w, 4); }
#else
__device__ __forceinline__ u32 ld_pair(const u16* p) { return *(const u32*)p; }
__device__ __forceinline__ void st_pair(u16* p, u32 w) { *(u32*)p = w; }
#endif

// Eight adjacent halves as one 16-byte access, from or to a 16-byte-aligned address.
struct __align__(16) Quad {
    u32 w[4];
};
#ifdef TF_EMULATE
__device__ __forceinline__ Quad ld_quad(const u16* p) {
    Quad q;
    memcpy(&q, p, 16);
    return q;
}
__device__ __forceinline__ void st_quad(u16* p, Quad q) { memcpy(p, &q, 16); }
#else
__device__ __forceinline__ Quad ld_quad(const u16* p) { return *(const Quad*)p; }
__device__ __forceinline__ void st_quad(u16* p, Quad q) { *(Quad*)p = q; }
#endif

// N adjacent elements of type T as one access of N·sizeof(T) bytes (16 at most), from or to an
// address aligned to that: the element-wise kernels' contiguous paths, whose per-element loads
// move too few bytes per instruction to reach the memory's bandwidth.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
    T e[N];
};
#ifdef TF_EMULATE
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> ld_vec(const T* p) {
    Vec<T, N> v;
    memcpy(&v, p, sizeof v);
    return v;
}
template <typename T, int N>
__device__ __forceinline__ void st_vec(T* p, const Vec<T, N>& v) { memcpy(p, &v, sizeof v); }
#else
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> ld_vec(const T* p) { return *(const Vec<T, N>*)p; }
template <typename T, int N>
__device__ __forceinline__ void st_vec(T* p, const Vec<T, N>& v) { *(Vec<T, N>*)p = v; }
#endif
__device__ __forceinline__ bool aligned16(const void* p) { return ((u64)p & 15) == 0; }

// Asynchronous 16-byte copies from global to shared memory (sm_80's cp.async), in groups:
// cp_async_commit closes the group of the copies started since the last, cp_async_wait<n>
// waits until at most n groups are in flight (for this thread's copies; a barrier after it
// makes everyone's visible). Both addresses 16-byte aligned. The emulator, and GPUs before
// sm_80, copy at once.
#if defined(TF_EMULATE) || __CUDA_ARCH__ < 800
__device__ __forceinline__ void cp_async16(u16* dst, const u16* src) { st_quad(dst, ld_quad(src)); }
__device__ __forceinline__ void cp_async_commit() {}
template <int N>
__device__ __forceinline__ void cp_async_wait() {}
#else
__device__ __forceinline__ void cp_async16(u16* dst, const u16* src) {
    asm volatile("{ .reg .u64 s, g; cvta.to.shared.u64 s, %0; cvta.to.global.u64 g, %1; cp.async.cg.shared.global [s], [g], 16; }"
                 :
                 : "l"(dst), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

// One warp's tensor-core product c += a·b (PTX `mma.sync` m16n8k16): a is 16×16 and b 16×8 in
// half precision, two elements per word, c is 16×8 in f32. Lane (g = lane / 4, t = lane % 4)
// holds, as the PTX ISA lays the fragments out:
//   a[0] (row g, cols 2t, 2t+1)  a[1] (g + 8, 2t..)  a[2] (g, 2t + 8..)  a[3] (g + 8, 2t + 8..)
//   b[0] (rows 2t, 2t+1, col g)  b[1] (rows 2t + 8.., col g)
//   c[0], c[1] (row g, cols 2t, 2t+1)  c[2], c[3] (row g + 8, cols 2t, 2t+1)
#ifdef TF_EMULATE
// The emulator (tests/cuda_emulator/emulator.hpp) gathers the warp's fragments and multiplies.
__device__ __forceinline__ void mma_f16(float* c, const u32* a, const u32* b) { emu_mma_m16n8k16(c, a, b, false); }
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) { emu_mma_m16n8k16(c, a, b, true); }
#elif __CUDA_ARCH__ < 800
// No such product before sm_80: the dispatch runs the kernels that use it only from sm_80 on
// (`Target::tensor_cores`).
__device__ __forceinline__ void mma_f16(float*, const u32*, const u32*) { __trap(); }
__device__ __forceinline__ void mma_bf16(float*, const u32*, const u32*) { __trap(); }
#else
__device__ __forceinline__ void mma_f16(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// Four 8×8 matrices of halves from shared memory into one register each, collectively over
// the warp (PTX `ldmatrix` .x4): lanes 8i..8i+7 give the addresses of matrix i's rows (16
// bytes each, 16-byte aligned), and lane (g = lane / 4, t = lane % 4) receives in r[i] matrix
// i's (row g, cols 2t, 2t+1), or with .trans its (rows 2t, 2t+1, col g): the b fragment of a
// product with the matrix's transpose, or with the matrix itself.
#ifdef TF_EMULATE
__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* row) { emu_ldmatrix_x4(r, row, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const u16* row) { emu_ldmatrix_x4(r, row, true); }
#elif __CUDA_ARCH__ < 800
// Used only beside mma_* (above), which sm_80 brought.
__device__ __forceinline__ void ldmatrix_x4(u32*, const u16*) { __trap(); }
__device__ __forceinline__ void ldmatrix_x4_trans(u32*, const u16*) { __trap(); }
#else
__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* row) {
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %4; ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [a]; }"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(row)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const u16* row) {
    asm volatile(
        "{ .reg .u64 a; cvta.to.shared.u64 a, %4; ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [a]; }"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "l"(row)
        : "memory");
}
#endif

// The element types of the float kernels: a value is loaded to its compute type C (f32, or f64
// for f64), computed in it and stored rounded to its type (f16 and bf16 are storage types, as on
// the CPU backend). A kernel family is a template over one of these, with an extern "C" entry
// point per type.
struct F32 {
    typedef float T;
    typedef float C;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};
// f64 is for the few families an ONNX graph may hand it to (arithmetic, comparisons, and the
// reductions and pooling that other element types are widened to f64 for).
struct F64 {
    typedef double T;
    typedef double C;
    static __device__ __forceinline__ double load(double v) { return v; }
    static __device__ __forceinline__ double store(double v) { return v; }
};
// Two f32 values rounded to nearest even and packed as halves, the first in the low half: one
// instruction on sm_80 and later.
#if defined(TF_EMULATE) || __CUDA_ARCH__ < 800
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) { return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16); }
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}
#else
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 d;
    asm("{ cvt.rn.f16x2.f32 %0, %1, %2; }" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 d;
    asm("{ cvt.rn.bf16x2.f32 %0, %1, %2; }" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
#endif

// The math a float family's template calls, for each compute type. max_of and min_of ignore a
// NaN operand (C's fmax), as the CPU backend's reductions do.
__device__ __forceinline__ float pow_of(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double pow_of(double a, double b) { return pow(a, b); }
__device__ __forceinline__ float max_of(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_of(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float min_of(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ double min_of(double a, double b) { return fmin(a, b); }
__device__ __forceinline__ float fmod_of(float a, float b) { return fmodf(a, b); }
__device__ __forceinline__ double fmod_of(double a, double b) { return fmod(a, b); }
// One-argument functions, f32 and f64 (CUDA's overloads and the emulator's <cmath> differ in
// which names they put in the global namespace, so each is spelled out).
#define TF_MATH_OF(name, f32, f64)                                          \
    __device__ __forceinline__ float name(float x) { return f32(x); } \
    __device__ __forceinline__ double name(double x) { return f64(x); }
TF_MATH_OF(exp_of, expf, exp)
TF_MATH_OF(expm1_of, expm1f, expm1)
TF_MATH_OF(log_of, logf, log)
TF_MATH_OF(log1p_of, log1pf, log1p)
TF_MATH_OF(sqrt_of, sqrtf, sqrt)
TF_MATH_OF(abs_of, fabsf, fabs)
TF_MATH_OF(floor_of, floorf, floor)
TF_MATH_OF(ceil_of, ceilf, ceil)
TF_MATH_OF(rint_of, rintf, rint)
TF_MATH_OF(erf_of, erff, erf)
TF_MATH_OF(sin_of, sinf, sin)
TF_MATH_OF(cos_of, cosf, cos)
TF_MATH_OF(tan_of, tanf, tan)
TF_MATH_OF(asin_of, asinf, asin)
TF_MATH_OF(acos_of, acosf, acos)
TF_MATH_OF(atan_of, atanf, atan)
TF_MATH_OF(sinh_of, sinhf, sinh)
TF_MATH_OF(cosh_of, coshf, cosh)
TF_MATH_OF(tanh_of, tanhf, tanh)
TF_MATH_OF(asinh_of, asinhf, asinh)
TF_MATH_OF(acosh_of, acoshf, acosh)
TF_MATH_OF(atanh_of, atanhf, atanh)
#undef TF_MATH_OF

// The half types also name their packing and their tensor-core product.
struct F16 {
    typedef u16 T;
    typedef float C;
    static __device__ __forceinline__ float load(u16 v) { return f16_to_f32(v); }
    static __device__ __forceinline__ u16 store(float v) { return f32_to_f16(v); }
    static __device__ __forceinline__ u32 pack(float lo, float hi) { return pack_f16x2(lo, hi); }
    static __device__ __forceinline__ void mma(float* c, const u32* a, const u32* b) { mma_f16(c, a, b); }
};
struct BF16 {
    typedef u16 T;
    typedef float C;
    static __device__ __forceinline__ float load(u16 v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ u16 store(float v) { return f32_to_bf16(v); }
    static __device__ __forceinline__ u32 pack(float lo, float hi) { return pack_bf16x2(lo, hi); }
    static __device__ __forceinline__ void mma(float* c, const u32* a, const u32* b) { mma_bf16(c, a, b); }
};

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (or max) over the block, returned to every thread. blockDim.x is a multiple of 32. The
// leading barrier lets a block call these back to back: the partials of the previous call
// have been read before they are overwritten.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
        v = warp_sum(v);
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}
__device__ double block_sum_f64(double v) {
    __shared__ double partial[32];
    __shared__ double total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}
// The block's maximum in f64 (max_of: a NaN loses to a number), to every thread.
__device__ double block_max_f64(double v) {
    __shared__ double partial[32];
    __shared__ double total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = max_of(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? partial[lane] : (double)NEG_INF;
        for (int o = 16; o > 0; o >>= 1) v = max_of(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}
__device__ float block_max(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? partial[lane] : NEG_INF;
        v = warp_max(v);
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}

// The counter-based generator of rng.rs (SplitMix64's finalizer), so that a dropout mask on
// the GPU is bit for bit the CPU's.
__device__ __forceinline__ u64 mix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ double uniform01(u64 seed, u64 i) {
    return (double)(mix64(seed ^ mix64(i)) >> 11) * (1.0 / 9007199254740992.0);
}
