// Attention on the tensor cores, for f16 and bf16 heads of 16 to 128 elements (a multiple of
// 16) on sm_80 and later: FlashAttention-2's tiling over PTX's m16n8k16 products (common.cuh's
// mma_*). The warp kernels of attention.cu take every other case (f32, other head sizes, older
// GPUs) and define what is computed; these compute the same in tiles, forward and backward side
// by side:
//
// - a block of MMA_WARPS warps takes 16 rows per warp (query rows forward, key rows backward),
//   and 32 forward for heads up to 64 (FWD_TILES); a warp's own operands stay in
//   registers as product fragments (backward, its values; its keys are read from the block's
//   shared tile, which dq's product needs anyway);
// - the other side streams through two shared buffers KT rows at a time (64 forward and 32
//   backward; for heads over 64, 32 and 16, which bound the registers), each tile read by
//   every warp of the block;
// - scores and probabilities live in the products' f32 accumulators, and enter the next product
//   rounded to the half type (the probabilities for P·V, the scores' gradient for dq and dk),
//   as in FlashAttention; the softmax's running maximum and sum stay in f32.
//
// The backward pass is FlashAttention-2's single sweep per key tile: the probabilities and the
// scores' gradient recomputed once (from the forward pass's log-sum-exp), dk and dv summed in
// registers, dq's part added atomically into f32 sums that attention_mma_dq rounds: five
// products per tile pair, where a race-free split (dq per query tile, dk and dv per key tile,
// as attention.cu's warp kernels split it by rows) recomputes both on each side: seven. delta
// (the softmax gradient's row term) comes from attention.cu's attention_bwd_delta.
//
// q, y, dy, dq: [groups, tq, d]; k, v, dk, dv: [groups / rep, tk, d] (query group g reads key
// group g / rep); lse, delta: [groups, tq], f32; or token-major, as attention.cu says: a
// group's rows then lie inter · d elements apart in y and dy, qld in q and kld in k and v (as
// attention.cu says: more than inter · d and kinter · d where q, k and v are packed).
// DMAX (64 or 128) sizes the registers for heads of d ≤ DMAX. Rows are 16-byte aligned (d is a
// multiple of 16 and the dispatch checks the bases), so eight halves move as one access.

#define MMA_WARPS 4
#define MMA_ROWS (MMA_WARPS * 16)
// The exponentials are taken base 2 (one instruction, exp2f), the scores scaled by log2(e)
// to match; the log-sum-exp kept for the backward pass stays natural, as the CPU's is.
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// The a fragments (one per 16 columns of d) of rows r0..r0+16 of an [n, d] matrix in global
// memory whose rows lie ld apart; zeros past n and past d.
template <int DMAX>
__device__ __forceinline__ void load_rows(u32 (&a)[DMAX / 16][4], const u16* m, i64 n, int d, i64 ld, i64 r0, int g,
                                          int t) {
#pragma unroll
    for (int kt = 0; kt < DMAX / 16; ++kt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            i64 r = r0 + g + 8 * (j & 1);
            int c = kt * 16 + 2 * t + 8 * (j >> 1);
            a[kt][j] = r < n && c < d ? ld_pair(m + r * ld + c) : 0u;
        }
}

// Starts copying rows r0..r0+KT of an [n, d] matrix (rows ld apart) into a shared tile of row stride DMAX + 8
// halves (zeros past n), by the whole block, 16 bytes per copy; consecutive threads take
// consecutive bytes. The 8 halves of padding put the eight rows that one ldmatrix reads in
// different banks, and keep each row 16-byte aligned.
template <int DMAX, int KT>
__device__ __forceinline__ void load_tile(u16* tile, const u16* m, i64 n, int d, i64 ld, i64 r0) {
    int quads = d / 8;
    for (int w = threadIdx.x; w < KT * quads; w += blockDim.x) {
        int r = w / quads, c = 8 * (w % quads);
        u16* to = tile + r * (DMAX + 8) + c;
        if (r0 + r < n) {
            cp_async16(to, m + (r0 + r) * ld + c);
        } else {
            st_quad(to, Quad{});
        }
    }
}

// The tiles stream through two buffers: while the block computes on one, the next tile's copies
// fly into the other. `stage` starts a pair of tiles (one copy group); `arrive`, with the tile
// at hand staged, stages the one after it (`next`, when below `end`) and waits until the one at
// hand is in shared memory for the whole block. After computing on a buffer the block meets
// (`__syncthreads`) before the buffer is staged again.
// a's rows lie lda apart, b's ldb.
template <int DMAX, int KT>
__device__ __forceinline__ void stage(u16* ta, u16* tb, const u16* a, const u16* b, i64 n, int d, i64 lda, i64 ldb,
                                      i64 r0) {
    load_tile<DMAX, KT>(ta, a, n, d, lda, r0);
    load_tile<DMAX, KT>(tb, b, n, d, ldb, r0);
    cp_async_commit();
}
template <int DMAX, int KT>
__device__ __forceinline__ void arrive(u16* ta, u16* tb, const u16* a, const u16* b, i64 n, int d, i64 lda, i64 ldb,
                                       i64 next, i64 end) {
    if (next < end) {
        stage<DMAX, KT>(ta, tb, a, b, n, d, lda, ldb, next);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
}

// The a fragment of columns kt·16.. of a tile of 16 of the warp's rows: held in registers, or read from a
// shared tile whose rows (row stride DMAX + 8) start at `rows`, as matrices (rows 0.., cols
// k0..), (8.., k0..), (0.., k0 + 8..), (8.., k0 + 8..).
template <int DMAX>
__device__ __forceinline__ const u32* a_fragment(const u32 (&held)[DMAX / 16][4], int kt, u32 (&)[4]) {
    return held[kt];
}
template <int DMAX>
__device__ __forceinline__ const u32* a_fragment(const u16* rows, int kt, u32 (&read)[4]) {
    int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
    ldmatrix_x4(read, rows + ((i & 1) * 8 + r) * (DMAX + 8) + kt * 16 + (i >> 1) * 8);
    return read;
}

// s[mt] (16 × KT, f32) = a[mt] (16 of the warp's rows, d wide) · tileᵀ, for MT tiles of the
// warp's rows (s and a point at MT of each): each row against every tile row. One ldmatrix gives the b fragments of two
// 8-row groups of the tile, read once for all MT row tiles: matrices (rows n0.., cols k0..),
// (n0.., k0 + 8..), (n0 + 8.., k0..), (n0 + 8.., k0 + 8..).
template <class S, int DMAX, int KT, int MT, class A>
__device__ __forceinline__ void rows_dot_tiles(float (*s)[KT / 8][4], const A* a, const u16* tile, int d) {
    int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int kt = 0; kt < DMAX / 16; ++kt) {
        if (kt * 16 >= d) break;
        u32 read[MT][4];
        const u32* ak[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ak[mt] = a_fragment<DMAX>(a[mt], kt, read[mt]);
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt += 2) {
            u32 b[4];
            ldmatrix_x4(b, tile + (nt * 8 + (i >> 1) * 8 + r) * (DMAX + 8) + kt * 16 + (i & 1) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                S::mma(s[mt][nt], ak[mt], b);
                S::mma(s[mt][nt + 1], ak[mt], b + 2);
            }
        }
    }
}
// The same for one tile of 16 rows (the backward pass's).
template <class S, int DMAX, int KT, class A>
__device__ __forceinline__ void rows_dot_tile(float (&s)[KT / 8][4], const A& a, const u16* tile, int d) {
    rows_dot_tiles<S, DMAX, KT, 1>(&s, &a, tile, d);
}

// acc[mt] (16 × d, f32) += p[mt] (16 × KT, f32 accumulators, rounded to S) · tile (KT × d), for
// MT tiles of 16 rows (acc and p point at MT of each). The accumulators of two 8-column products are, element for element, one
// a fragment. One transposing ldmatrix gives the b fragments of two 8-column groups of the
// tile, read once for all MT row tiles: matrices (rows k0.., cols n0..), (k0 + 8.., n0..),
// (k0.., n0 + 8..), (k0 + 8.., n0 + 8..).
template <class S, int DMAX, int KT, int MT>
__device__ __forceinline__ void acc_times_tiles(float (*acc)[DMAX / 8][4], const float (*p)[KT / 8][4],
                                                const u16* tile, int d) {
    int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float *lo = p[mt][2 * kk], *hi = p[mt][2 * kk + 1];
            a[mt][0] = S::pack(lo[0], lo[1]);
            a[mt][1] = S::pack(lo[2], lo[3]);
            a[mt][2] = S::pack(hi[0], hi[1]);
            a[mt][3] = S::pack(hi[2], hi[3]);
        }
#pragma unroll
        for (int nt = 0; nt < DMAX / 8; nt += 2) {
            if (nt * 8 >= d) break;
            u32 b[4];
            ldmatrix_x4_trans(b, tile + (kk * 16 + (i & 1) * 8 + r) * (DMAX + 8) + nt * 8 + (i >> 1) * 8);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                S::mma(acc[mt][nt], a[mt], b);
                S::mma(acc[mt][nt + 1], a[mt], b + 2);
            }
        }
    }
}
// The same for one tile of 16 rows (the backward pass's).
template <class S, int DMAX, int KT>
__device__ __forceinline__ void acc_times_tile(float (&acc)[DMAX / 8][4], const float (&p)[KT / 8][4], const u16* tile,
                                               int d) {
    acc_times_tiles<S, DMAX, KT, 1>(&acc, &p, tile, d);
}

// Rows r0 + g and r0 + g + 8 of a 16 × d accumulator, times `by`, stored to an [n, d] matrix
// whose rows lie ld apart.
template <class S, int DMAX>
__device__ __forceinline__ void store_rows(u16* m, i64 n, int d, i64 ld, i64 r0, const float (&acc)[DMAX / 8][4],
                                           const float* by, int g, int t) {
    for (int h = 0; h < 2; ++h) {
        i64 r = r0 + g + 8 * h;
        if (r >= n) continue;
#pragma unroll
        for (int nt = 0; nt < DMAX / 8; ++nt) {
            if (nt * 8 >= d) break;
            st_pair(m + r * ld + nt * 8 + 2 * t, S::pack(acc[nt][2 * h] * by[h], acc[nt][2 * h + 1] * by[h]));
        }
    }
}

// Which columns of a tile the lane's two accumulator rows (h = 0, 1) count, as a range [lo, hi)
// of the tile's columns: one comparison or two per element, in 32 bits, instead of the mask's
// 64-bit arithmetic (most tiles count every column; the element-wise work beside the products
// is what bounds these kernels). Forward and dq: rows are queries r0 + g + 8h, columns keys
// from k0; a key counts below tk and, under the causal mask, up to the row.
__device__ __forceinline__ int clamp_cols(i64 x, int kt) { return x < 0 ? 0 : (x > kt ? kt : (int)x); }
__device__ __forceinline__ void keys_seen(int (&hi)[2], i64 r0, i64 k0, i64 tk, int causal, int kt, int g) {
    for (int h = 0; h < 2; ++h) {
        i64 end = tk - k0, diagonal = r0 + g + 8 * h - k0 + 1;
        hi[h] = clamp_cols(causal && diagonal < end ? diagonal : end, kt);
    }
}
// dk and dv: rows are keys r0 + g + 8h (none past tk), columns queries from q0; a query counts
// below tq and, under the causal mask, from the key on.
__device__ __forceinline__ void queries_seen(int (&lo)[2], int& hi, i64 r0, i64 q0, i64 tq, i64 tk, int causal,
                                             int kt, int g) {
    hi = clamp_cols(tq - q0, kt);
    for (int h = 0; h < 2; ++h) {
        i64 key = r0 + g + 8 * h, from = causal ? key - q0 : 0;
        lo[h] = key >= tk ? kt : clamp_cols(from, kt);
    }
}

// The sum (or max) over the four lanes that hold one accumulator row.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// One key tile's step of the online softmax for a 16-row tile (rows r0.., keys k0..): the
// scores s, masked and times log2(e), become their exponentials against the rows' new running
// maximum m, which rescales the output's sums o and the rows' sums l first.
template <int DMAX, int KT>
__device__ __forceinline__ void online_softmax(float (&s)[KT / 8][4], float (&o)[DMAX / 8][4], float (&m)[2],
                                               float (&l)[2], i64 r0, i64 k0, i64 tk, int causal, float scale, int g,
                                               int t) {
    float mx[2] = {m[0], m[1]};
    int hi[2];
    keys_seen(hi, r0, k0, tk, causal, KT, g);
#pragma unroll
    for (int nt = 0; nt < KT / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int col = nt * 8 + 2 * t + (i & 1);
            float x = col < hi[i >> 1] ? s[nt][i] * (scale * LOG2E) : NEG_INF;
            s[nt][i] = x;
            mx[i >> 1] = fmaxf(mx[i >> 1], x);
        }
    float base[2];
    for (int h = 0; h < 2; ++h) {
        mx[h] = quad_max(mx[h]);
        // A row that has seen no key yet (all masked) takes its exponentials from 0, so that
        // none is NaN; they are all 0.
        base[h] = mx[h] == NEG_INF ? 0.f : mx[h];
        float rescale = exp2f(m[h] - base[h]);
        l[h] *= rescale;
#pragma unroll
        for (int nt = 0; nt < DMAX / 8; ++nt) {
            o[nt][2 * h] *= rescale;
            o[nt][2 * h + 1] *= rescale;
        }
        m[h] = mx[h];
    }
#pragma unroll
    for (int nt = 0; nt < KT / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float p = exp2f(s[nt][i] - base[i >> 1]);
            s[nt][i] = p;
            l[i >> 1] += p;
        }
}

// The forward pass's tiles of 16 query rows per warp: two for heads up to 64, where the key
// and value tiles' fragments, each read once from shared memory, serve both (FlashAttention-2
// gives a warp 32 query rows there; with one tile, each fragment read fed one product, and
// shared memory's bandwidth was as likely a bound as the tensor cores); one for larger heads,
// whose accumulators would not fit twice.
#define FWD_TILES(DMAX) ((DMAX) <= 64 ? 2 : 1)

template <class S, int DMAX>
__device__ void attention_mma_fwd(i64 groups, i64 tq, i64 tk, int d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale,
                                  int causal, const u16* q, const u16* k, const u16* v, u16* y, float* lse) {
    const int KT = DMAX <= 64 ? 64 : 32, MT = FWD_TILES(DMAX), ROWS = MMA_ROWS * MT;
    __shared__ __align__(16) u16 ks[2][KT * (DMAX + 8)];
    __shared__ __align__(16) u16 vs[2][KT * (DMAX + 8)];
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    i64 tiles = (tq + ROWS - 1) / ROWS;
    for (i64 b = blockIdx.x; b < groups * tiles; b += gridDim.x) {
        // The last query tiles first: with a causal mask they see the most keys. The warp's
        // rows: r0.. (16 a tile).
        i64 grp = b / tiles, q0 = (tiles - 1 - b % tiles) * ROWS, r0 = q0 + (threadIdx.x >> 5) * 16 * MT;
        i64 yld = inter * d, qat = head_row(grp, 0, tq, d, inter, qld), yat = head_row(grp, 0, tq, d, inter, yld);
        i64 kat = head_row(grp / rep, 0, tk, d, kinter, kld);
        const u16 *kg = k + kat, *vg = v + kat;
        u32 qa[MT][DMAX / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_rows<DMAX>(qa[mt], q + qat, tq, d, qld, r0 + 16 * mt, g, t);
        float o[MT][DMAX / 8][4] = {};
        // Each lane holds rows g and g + 8 (h = 0, 1) of each tile: their running maximum (of
        // the scores times log2(e)) and (partial) sum.
        float m[MT][2], l[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = NEG_INF, l[mt][0] = l[mt][1] = 0.f;
        i64 keys = causal && q0 + ROWS < tk ? q0 + ROWS : tk;
        if (keys > 0) stage<DMAX, KT>(ks[0], vs[0], kg, vg, tk, d, kld, kld, 0);
        for (i64 k0 = 0, j = 0; k0 < keys; k0 += KT, j ^= 1) {
            arrive<DMAX, KT>(ks[j ^ 1], vs[j ^ 1], kg, vg, tk, d, kld, kld, k0 + KT, keys);
            // Under the causal mask a tile past the warp's last row is masked for all of its rows
            // (the block's rows reach further): the warp skips it, as masked scores would
            // change nothing. The same for the whole warp, so its shuffles stay whole.
            if (!causal || k0 < r0 + 16 * MT) {
                float s[MT][KT / 8][4];
                rows_dot_tiles<S, DMAX, KT, MT>(s, qa, ks[j], d);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    online_softmax<DMAX, KT>(s[mt], o[mt], m[mt], l[mt], r0 + 16 * mt, k0, tk, causal, scale, g, t);
                acc_times_tiles<S, DMAX, KT, MT>(o, s, vs[j], d);
            }
            __syncthreads();  // every warp is done with buffer j
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            float inv[2];
            for (int h = 0; h < 2; ++h) {
                l[mt][h] = quad_sum(l[mt][h]);
                inv[h] = 1.f / l[mt][h];
                i64 row = r0 + 16 * mt + g + 8 * h;
                if (lse && t == 0 && row < tq) lse[grp * tq + row] = (m[mt][h] + log2f(l[mt][h])) * LN2;
            }
            store_rows<S, DMAX>(y + yat, tq, d, yld, r0 + 16 * mt, o[mt], inv, g, t);
        }
    }
}

// Adds two adjacent f32 values into global memory, 8-byte aligned: one vector reduction on
// sm_90 (PTX's red.global.add.v2.f32), two atomic adds before it and on the emulator.
#if defined(TF_EMULATE) || __CUDA_ARCH__ < 900
__device__ __forceinline__ void add_pair(float* at, float a, float b) {
    atomicAdd(at, a);
    atomicAdd(at + 1, b);
}
#else
__device__ __forceinline__ void add_pair(float* at, float a, float b) {
    asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %0; red.global.add.v2.f32 [g], {%1, %2}; }"
                 :
                 : "l"(at), "f"(a), "f"(b)
                 : "memory");
}
#endif

// The block's scores' gradient (its 64 keys × the KT queries of the tile, over scale, rounded
// to S as dk's product takes it) into shared memory, a row of KT + 8 halves per key.
template <class S, int KT>
__device__ __forceinline__ void store_scores_grad(u16* ds, const float (&dp)[KT / 8][4], int g, int t) {
    int key = (threadIdx.x >> 5) * 16 + g;
#pragma unroll
    for (int nt = 0; nt < KT / 8; ++nt)
        for (int h = 0; h < 2; ++h)
            st_pair(ds + (key + 8 * h) * (KT + 8) + nt * 8 + 2 * t, S::pack(dp[nt][2 * h], dp[nt][2 * h + 1]));
}

// The tile's KT query rows of dq (f32 sums over scale, rows ld apart, n rows in all) += dS
// (ds: 64 keys × KT queries) · the block's keys (ktile: 64 × d). The warps split the queries
// in blocks of 16 and, where those are fewer than the warps (KT = 16), the head's columns in
// 16-column pairs of 8-column groups. Every key tile of a group adds to the same rows, so the
// adds are atomic, as in FlashAttention-2: their order, and with it dq's last bits, is the
// scheduler's.
template <class S, int DMAX, int KT>
__device__ __forceinline__ void add_to_dq(float* dq, i64 n, int d, i64 ld, i64 q0, const u16* ds, const u16* ktile,
                                          int g, int t) {
    const int ROW_BLOCKS = KT / 16, PARTS = MMA_WARPS / ROW_BLOCKS;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
    int rows = warp % ROW_BLOCKS * 16, part = warp / ROW_BLOCKS;
    for (int c0 = part * 16; c0 < d; c0 += PARTS * 16) {
        float c[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < MMA_ROWS / 16; ++kk) {
            // a: the warp's 16 queries × keys kk·16.., dS transposed as it is read (.trans):
            // matrices (keys k0.., queries 0..), (k0.., 8..), (k0 + 8.., 0..), (k0 + 8.., 8..).
            // Read again for each column pair: held, they would push the sweep's registers
            // past the budget.
            u32 a[4], b[4];
            ldmatrix_x4_trans(a, ds + (kk * 16 + (i >> 1) * 8 + r) * (KT + 8) + rows + (i & 1) * 8);
            ldmatrix_x4_trans(b, ktile + (kk * 16 + (i & 1) * 8 + r) * (DMAX + 8) + c0 + (i >> 1) * 8);
            S::mma(c[0], a, b);
            S::mma(c[1], a, b + 2);
        }
        for (int h = 0; h < 2; ++h) {
            i64 row = q0 + rows + g + 8 * h;
            if (row >= n) continue;
            for (int nt = 0; nt < 2; ++nt)
                add_pair(dq + row * ld + c0 + nt * 8 + 2 * t, c[nt][2 * h], c[nt][2 * h + 1]);
        }
    }
}

// The log-sum-exp (times log2(e)) and delta of the query rows q0..q0 + KT of one group
// (`lse` and `delta` at its first row) into a buffer's shared rows, by the block (plain loads,
// made visible by `arrive`'s barrier).
template <int KT>
__device__ __forceinline__ void stage_rows(float* lse_rows, float* delta_rows, const float* lse, const float* delta,
                                           i64 q0, i64 tq) {
    for (int r = threadIdx.x; r < KT; r += blockDim.x) {
        lse_rows[r] = q0 + r < tq ? lse[q0 + r] * LOG2E : 0.f;
        delta_rows[r] = q0 + r < tq ? delta[q0 + r] : 0.f;
    }
}

// The backward pass in one sweep per tile of key rows, FlashAttention-2's: with p_ij the
// probabilities recomputed from the log-sum-exp and ds_ij = p_ij (dy_i·v_j − delta_i),
//   dv_j = Σ_i p_ij dy_i and dk_j = scale · Σ_i ds_ij q_i  (kept in registers),
//   dq_i += Σ_j ds_ij k_j  (added to dq_acc, laid out as y, in f32; attention_mma_dq scales
//   it into dq),
// over the queries that see key j (i ≥ j when causal) in every query group the key group
// serves. The products run transposed: scores as keys × queries. dq's product reads dS and
// the block's keys from shared memory.
template <class S, int DMAX>
__device__ void attention_mma_bwd(i64 groups, i64 tq, i64 tk, int d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale,
                                  int causal, const u16* q, const u16* k, const u16* v, const u16* dy, const float* lse,
                                  const float* delta, float* dq_acc, u16* dk, u16* dv) {
    // Each warp holds dk's and dv's sums (16 × d each) and v besides the scores: 32 query rows
    // per tile (16 for heads over 64) keep them within the registers.
    const int KT = DMAX <= 64 ? 32 : 16;
    __shared__ __align__(16) u16 qs[2][KT * (DMAX + 8)];
    __shared__ __align__(16) u16 dys[2][KT * (DMAX + 8)];
    __shared__ __align__(16) u16 ks[MMA_ROWS * (DMAX + 8)];
    __shared__ __align__(16) u16 ds[MMA_ROWS * (KT + 8)];  // the tile's dS, for dq's product
    __shared__ float tile_lse[2][KT], tile_delta[2][KT];  // the log-sum-exp times log2(e)
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    i64 tiles = (tk + MMA_ROWS - 1) / MMA_ROWS;
    for (i64 b = blockIdx.x; b < groups / rep * tiles; b += gridDim.x) {
        // A key group's tile; the first key tiles first: with a causal mask the most queries
        // see them.
        i64 grp = b / tiles, k0 = b % tiles * MMA_ROWS, r0 = k0 + (threadIdx.x >> 5) * 16;
        // The row strides in 32 bits: two 64-bit ones live through the sweep would spill
        // (sm_90, heads of 128).
        int yld = (int)(inter * d), qld32 = (int)qld;
        i64 kat = head_row(grp, 0, tk, d, kinter, kld);
        // The warp's keys are read from the block's tile `ks` where a product needs them (to
        // keep registers for dk's and dv's sums); its values stay in registers.
        const u16* k_rows = ks + (threadIdx.x >> 5) * 16 * (DMAX + 8);
        u32 va[DMAX / 16][4];
        load_rows<DMAX>(va, v + kat, tk, d, kld, r0, g, t);
        float dk_acc[DMAX / 8][4] = {}, dv_acc[DMAX / 8][4] = {};
        i64 first = causal ? k0 / KT * KT : 0;
        // No query sees these keys where first ≥ tq: dk and dv are 0, and dq gets nothing.
        if (first < tq) load_tile<DMAX, MMA_ROWS>(ks, k + kat, tk, d, kld, k0);  // in the first tile's copy group
        // Each query group the key group serves, in order, sweeping its query tiles.
        for (int h = 0; h < (first < tq ? (int)rep : 0); ++h) {
            i64 gq = grp * rep + h, yat = head_row(gq, 0, tq, d, inter, yld);
            const u16 *qg = q + head_row(gq, 0, tq, d, inter, qld), *dyg = dy + yat;
            const float *glse = lse + gq * tq, *gdelta = delta + gq * tq;
            stage<DMAX, KT>(qs[0], dys[0], qg, dyg, tq, d, qld32, yld, first);
            stage_rows<KT>(tile_lse[0], tile_delta[0], glse, gdelta, first, tq);
            for (i64 q0 = first, j = 0; q0 < tq; q0 += KT, j ^= 1) {
                if (q0 + KT < tq) stage_rows<KT>(tile_lse[j ^ 1], tile_delta[j ^ 1], glse, gdelta, q0 + KT, tq);
                arrive<DMAX, KT>(qs[j ^ 1], dys[j ^ 1], qg, dyg, tq, d, qld32, yld, q0 + KT, tq);
                const float *row_lse = tile_lse[j], *row_delta = tile_delta[j];
                float p[KT / 8][4], dp[KT / 8][4];
                rows_dot_tile<S, DMAX, KT>(p, k_rows, qs[j], d);  // scoresᵀ: keys × queries
                rows_dot_tile<S, DMAX, KT>(dp, va, dys[j], d);  // (dy·vᵀ)ᵀ
                int lo[2], hi;
                queries_seen(lo, hi, r0, q0, tq, tk, causal, KT, g);
#pragma unroll
                for (int nt = 0; nt < KT / 8; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        int c = nt * 8 + 2 * t + (i & 1);
                        bool seen = c >= lo[i >> 1] && c < hi;
                        float pij = seen ? exp2f(p[nt][i] * (scale * LOG2E) - row_lse[c]) : 0.f;
                        p[nt][i] = pij;
                        dp[nt][i] = pij * (dp[nt][i] - row_delta[c]);
                    }
                acc_times_tile<S, DMAX, KT>(dv_acc, p, dys[j], d);
                acc_times_tile<S, DMAX, KT>(dk_acc, dp, qs[j], d);
                store_scores_grad<S, KT>(ds, dp, g, t);
                __syncthreads();  // dS is whole
                add_to_dq<S, DMAX, KT>(dq_acc + yat, tq, d, yld, q0, ds, ks, g, t);
                __syncthreads();  // every warp is done with buffer j and with dS
            }
        }
        float by_k[2] = {scale, scale}, by_v[2] = {1.f, 1.f};
        store_rows<S, DMAX>(dk + kat, tk, d, kld, r0, dk_acc, by_k, g, t);
        store_rows<S, DMAX>(dv + kat, tk, d, kld, r0, dv_acc, by_v, g, t);
    }
}

// dq = scale · the f32 sums attention_mma_bwd added (n elements, laid out as y: tokens of
// `width` elements, a multiple of 4), each token's row `ld` elements on from the last in dq
// (more than width where dq is a part of a packed gradient); both 16-byte aligned.
template <class S>
__device__ void attention_mma_dq(i64 n, i64 width, i64 ld, float scale, const float* acc, u16* dq) {
    for (i64 i = 4 * first_index(); i < n; i += 4 * grid_stride()) {
        Vec<float, 4> a = ld_vec<float, 4>(acc + i);
        u16* to = dq + i / width * ld + i % width;
        st_pair(to, S::pack(a.e[0] * scale, a.e[1] * scale));
        st_pair(to + 2, S::pack(a.e[2] * scale, a.e[3] * scale));
    }
}

// The entry points: f16 and bf16, heads up to 64 and up to 128.
extern "C" __global__ void attention_mma_fwd_f16_d64(i64 groups, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                     const u16* q, const u16* k, const u16* v, u16* y, float* lse) {
    attention_mma_fwd<F16, 64>(groups, tq, tk, (int)d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, y, lse);
}
extern "C" __global__ void attention_mma_fwd_f16_d128(i64 groups, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                      const u16* q, const u16* k, const u16* v, u16* y, float* lse) {
    attention_mma_fwd<F16, 128>(groups, tq, tk, (int)d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, y, lse);
}
extern "C" __global__ void attention_mma_fwd_bf16_d64(i64 groups, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                      const u16* q, const u16* k, const u16* v, u16* y, float* lse) {
    attention_mma_fwd<BF16, 64>(groups, tq, tk, (int)d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, y, lse);
}
extern "C" __global__ void attention_mma_fwd_bf16_d128(i64 groups, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                       const u16* q, const u16* k, const u16* v, u16* y, float* lse) {
    attention_mma_fwd<BF16, 128>(groups, tq, tk, (int)d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, y, lse);
}
extern "C" __global__ void attention_mma_bwd_f16_d64(i64 groups, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                     const u16* q, const u16* k, const u16* v, const u16* dy,
                                                     const float* lse, const float* delta, float* dq_acc, u16* dk, u16* dv) {
    attention_mma_bwd<F16, 64>(groups, tq, tk, (int)d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dq_acc, dk, dv);
}
extern "C" __global__ void attention_mma_bwd_f16_d128(i64 groups, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                      const u16* q, const u16* k, const u16* v, const u16* dy,
                                                      const float* lse, const float* delta, float* dq_acc, u16* dk, u16* dv) {
    attention_mma_bwd<F16, 128>(groups, tq, tk, (int)d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dq_acc, dk, dv);
}
extern "C" __global__ void attention_mma_bwd_bf16_d64(i64 groups, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                      const u16* q, const u16* k, const u16* v, const u16* dy,
                                                      const float* lse, const float* delta, float* dq_acc, u16* dk, u16* dv) {
    attention_mma_bwd<BF16, 64>(groups, tq, tk, (int)d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dq_acc, dk, dv);
}
extern "C" __global__ void attention_mma_bwd_bf16_d128(i64 groups, i64 tq, i64 tk, i64 d, i64 inter, i64 kinter, i64 rep, i64 qld, i64 kld, float scale, int causal,
                                                       const u16* q, const u16* k, const u16* v, const u16* dy,
                                                       const float* lse, const float* delta, float* dq_acc, u16* dk, u16* dv) {
    attention_mma_bwd<BF16, 128>(groups, tq, tk, (int)d, inter, kinter, rep, qld, kld, scale, causal, q, k, v, dy, lse, delta, dq_acc, dk, dv);
}
extern "C" __global__ void attention_mma_dq_f16(i64 n, i64 width, i64 ld, float scale, const float* acc, u16* dq) {
    attention_mma_dq<F16>(n, width, ld, scale, acc, dq);
}
extern "C" __global__ void attention_mma_dq_bf16(i64 n, i64 width, i64 ld, float scale, const float* acc, u16* dq) {
    attention_mma_dq<BF16>(n, width, ld, scale, acc, dq);
}
