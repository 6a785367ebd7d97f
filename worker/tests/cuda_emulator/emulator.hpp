// A CPU stand-in for the GPU, for checking the CUDA backend's kernels where there is no GPU.
//
// The kernel program (worker/src/backend/cuda/kernels/) is compiled as C++ after this header
// (with TF_EMULATE defined). A launch runs its blocks one after another; the threads of a
// block are fibers (ucontext) on one OS thread, each with its own stack, switched at every
// __syncthreads and at every warp shuffle. A GPU promises no order, and a race shows only in
// an order where the reader runs before the writer, so the orders alternate: blocks first to
// last in one launch and last to first in the next, threads lowest first in one block and
// highest first in the next. A barrier releases its fibers once all that take
// part have reached it (the block's for __syncthreads, the warp's for a shuffle), so code that
// would deadlock or race on a GPU through a missing barrier shows up here as a deadlock error or
// a wrong result. `__shared__` variables are statics: one instance, shared by the block that
// runs. Atomics are plain reads and writes, which is atomic between cooperative fibers.
//
// What this does not emulate: memory coalescing and timing, warp divergence within a shuffle
// (every lane must take part, as the kernels' full masks require), and the GPU's float
// rounding of expf & co (the host's libm stands in).

#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned x, y, z;
};

static dim3 threadIdx, blockIdx, blockDim, gridDim;

static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float rsqrtf(float x) { return 1.f / sqrtf(x); }

static inline float atomicAdd(float* at, float v) {
    float old = *at;
    *at = old + v;
    return old;
}
static inline unsigned long long atomicCAS(unsigned long long* at, unsigned long long expected,
                                           unsigned long long desired) {
    unsigned long long old = *at;
    if (old == expected) *at = desired;
    return old;
}

namespace emu {

enum State { RUNNING, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };

// A fiber enters its stack once through ucontext (makecontext, setcontext) and switches after
// that with _setjmp/_longjmp, which, unlike swapcontext, leave the signal mask alone and so make
// no system call: a block of 256 threads switches thousands of times per reduction.
struct Fiber {
    ucontext_t context;
    jmp_buf at;
    bool started;
    State state;
};

static const size_t STACK_BYTES = 64 * 1024;
static std::vector<Fiber> fibers;
static std::vector<std::vector<char>> stacks;
static jmp_buf scheduler;
static unsigned current;
static std::function<void()> body;
static std::string failure;

static void wait(State s) {
    fibers[current].state = s;
    if (!_setjmp(fibers[current].at)) _longjmp(scheduler, 1);
}

static void start() {
    body();
    fibers[current].state = DONE;
    _longjmp(scheduler, 1);
}

// Runs fiber t until it waits or ends.
static void resume(unsigned t) {
    current = t;
    threadIdx = dim3{t, 0, 0};
    if (_setjmp(scheduler)) return;
    if (fibers[t].started) _longjmp(fibers[t].at, 1);
    fibers[t].started = true;
    setcontext(&fibers[t].context);
}

// Runs one block of `threads` fibers to completion; false on a deadlock.
static bool run_block(unsigned threads, bool highest_first) {
    fibers.assign(threads, Fiber{});
    if (stacks.size() < threads) stacks.resize(threads, std::vector<char>(STACK_BYTES));
    for (unsigned t = 0; t < threads; ++t) {
        getcontext(&fibers[t].context);
        fibers[t].context.uc_stack.ss_sp = stacks[t].data();
        fibers[t].context.uc_stack.ss_size = STACK_BYTES;
        fibers[t].context.uc_link = nullptr;
        makecontext(&fibers[t].context, start, 0);
        fibers[t].state = RUNNING;
    }
    for (;;) {
        for (unsigned k = 0; k < threads; ++k) {
            unsigned t = highest_first ? threads - 1 - k : k;
            if (fibers[t].state != RUNNING) continue;
            resume(t);
        }
        bool all_done = true, block_ready = true, released = false;
        for (auto& f : fibers) {
            all_done = all_done && f.state == DONE;
            block_ready = block_ready && (f.state == AT_BLOCK_BARRIER || f.state == DONE);
        }
        if (all_done) return true;
        if (block_ready) {
            for (auto& f : fibers)
                if (f.state == AT_BLOCK_BARRIER) f.state = RUNNING;
            continue;
        }
        for (unsigned w = 0; w * 32 < threads; ++w) {
            unsigned end = (w + 1) * 32 < threads ? (w + 1) * 32 : threads;
            bool ready = true, any = false;
            for (unsigned t = w * 32; t < end; ++t) {
                ready = ready && (fibers[t].state == AT_WARP_BARRIER || fibers[t].state == DONE);
                any = any || fibers[t].state == AT_WARP_BARRIER;
            }
            if (ready && any) {
                for (unsigned t = w * 32; t < end; ++t)
                    if (fibers[t].state == AT_WARP_BARRIER) fibers[t].state = RUNNING;
                released = true;
            }
        }
        if (!released) return false;
    }
}

// The lanes' values in flight during a shuffle, by thread index.
static double shuffled[1024];

}  // namespace emu

static inline void __syncthreads() { emu::wait(emu::AT_BLOCK_BARRIER); }

// The kernels shuffle floats and doubles; a double holds either exactly.
template <typename T>
static inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    unsigned t = threadIdx.x;
    emu::shuffled[t] = (double)v;
    emu::wait(emu::AT_WARP_BARRIER);
    T r = (T)emu::shuffled[t ^ (unsigned)lane_mask];
    emu::wait(emu::AT_WARP_BARRIER);
    return r;
}

// A half (f16 or bf16 bits) as f32.
static inline float emu_half(unsigned short h, bool bf16) {
    if (bf16) return __uint_as_float((unsigned)h << 16);
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

namespace emu {
// The warp's fragments during a tensor-core product, by thread index.
static unsigned mma_a[1024][4], mma_b[1024][2];
}  // namespace emu

// PTX's `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}`: c (16×8, f32) += a (16×16) · b (16×8),
// collective over the warp. Each lane leaves its fragments, the warp meets, and each lane computes
// its own four outputs from everyone's. Where each element sits is spelled here from the PTX ISA
// ("Matrix Fragments for mma.m16n8k16 with floating point type"), apart from the kernels' own use
// of it, so that a kernel that reads the layout wrongly computes the wrong product here too.
static inline void emu_mma_m16n8k16(float* c, const unsigned* a, const unsigned* b, bool bf16) {
    unsigned t = threadIdx.x, warp = t & ~31u, lane = t & 31u;
    memcpy(emu::mma_a[t], a, sizeof emu::mma_a[t]);
    memcpy(emu::mma_b[t], b, sizeof emu::mma_b[t]);
    emu::wait(emu::AT_WARP_BARRIER);
    auto half_of = [&](unsigned word, unsigned which) {
        return emu_half((unsigned short)(which ? word >> 16 : word & 0xffffu), bf16);
    };
    // a's (row r, col k): lane 4 (r mod 8) + (k mod 8) / 2, register r / 8 + 2 (k / 8), half k mod 2.
    auto a_at = [&](unsigned r, unsigned k) {
        return half_of(emu::mma_a[warp + 4 * (r % 8) + (k % 8) / 2][r / 8 + 2 * (k / 8)], k % 2);
    };
    // b's (row k, col n): lane 4 n + (k mod 8) / 2, register k / 8, half k mod 2.
    auto b_at = [&](unsigned k, unsigned n) { return half_of(emu::mma_b[warp + 4 * n + (k % 8) / 2][k / 8], k % 2); };
    // c[i]: row lane / 4 (+ 8 for i ≥ 2), col 2 (lane mod 4) + i mod 2. A half's product is exact in f32.
    float out[4];
    for (unsigned i = 0; i < 4; ++i) {
        unsigned r = lane / 4 + 8 * (i / 2), n = 2 * (lane % 4) + i % 2;
        float s = c[i];
        for (unsigned k = 0; k < 16; ++k) s += a_at(r, k) * b_at(k, n);
        out[i] = s;
    }
    emu::wait(emu::AT_WARP_BARRIER);
    memcpy(c, out, sizeof out);
}

namespace emu {
// The warp's row addresses during an ldmatrix, by thread index.
static const unsigned short* ldmatrix_rows[1024];
}  // namespace emu

// PTX's `ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16`, collective over the warp: lanes
// 8i..8i+7 give the row addresses of matrix i; lane l receives in r[i] matrix i's row l / 4,
// columns 2 (l mod 4) and 2 (l mod 4) + 1 (the lower in the low half), or with `trans` its
// rows 2 (l mod 4) and 2 (l mod 4) + 1 of column l / 4 (PTX ISA, "Warp-level matrix load
// instruction: ldmatrix"), spelled here apart from the kernels' use of it.
static inline void emu_ldmatrix_x4(unsigned* r, const unsigned short* row, bool trans) {
    unsigned t = threadIdx.x, warp = t & ~31u, lane = t & 31u;
    emu::ldmatrix_rows[t] = row;
    emu::wait(emu::AT_WARP_BARRIER);
    unsigned out[4];
    for (unsigned i = 0; i < 4; ++i) {
        auto at = [&](unsigned rr, unsigned c) { return (unsigned)emu::ldmatrix_rows[warp + 8 * i + rr][c]; };
        unsigned g = lane / 4, c = 2 * (lane % 4);
        out[i] = trans ? at(c, g) | at(c + 1, g) << 16 : at(g, c) | at(g, c + 1) << 16;
    }
    emu::wait(emu::AT_WARP_BARRIER);
    memcpy(r, out, sizeof out);
}

// Runs `kernel` over the grid; 0 when done, 1 on a deadlock (the message in emu_failure).
static int emu_run_grid(const char* name, unsigned gx, unsigned gy, unsigned bx, std::function<void()> kernel) {
    gridDim = dim3{gx, gy, 1};
    blockDim = dim3{bx, 1, 1};
    emu::body = std::move(kernel);
    static unsigned long long launches = 0;
    unsigned long long launch = launches++;
    unsigned blocks = gx * gy;
    for (unsigned k = 0; k < blocks; ++k) {
        unsigned b = (launch & 1) ? blocks - 1 - k : k, x = b % gx, y = b / gx;
        blockIdx = dim3{x, y, 0};
        if (!emu::run_block(bx, (k + launch / 2) & 1)) {
            emu::failure = std::string(name) + ": the threads of block (" + std::to_string(x) + ", " +
                           std::to_string(y) + ") deadlocked at mismatched barriers";
            return 1;
        }
    }
    return 0;
}

extern "C" const char* emu_failure() { return emu::failure.c_str(); }
