// Pointwise ops: activations and their gradients, broadcasting binary ops, Where, casts,
// Expand, dropout and the causal mask (Trilu). Op codes are the order of the Unary and Binary
// enums in graph/op.rs (backend/cuda/launch.rs passes `op as i32`).

// Unary codes are Unary::code()'s (graph/op.rs); p0 and p1 are Unary::params().
template <typename C>
__device__ __forceinline__ C sigmoid_of(C x) {
    return (C)1 / ((C)1 + exp_of(-x));
}
// ln(1 + eˣ) without overflow for large x.
template <typename C>
__device__ __forceinline__ C softplus_of(C x) {
    return max_of(x, (C)0) + log1p_of(exp_of(-abs_of(x)));
}
// x·σ(2z) = 0.5·x·(1 + tanh z) with z = √(2/π)·(x + 0.044715·x³), without 1 + tanh z's
// cancellation for large negative x.
template <typename C>
__device__ __forceinline__ C gelu_tanh(C x) {
    C z = (C)0.7978845608028654 * (x + (C)0.044715 * x * x * x);
    return x / ((C)1 + exp_of((C)-2 * z));
}
template <typename C>
__device__ __forceinline__ C gelu_tanh_grad(C x) {
    C t = tanh_of((C)0.7978845608028654 * (x + (C)0.044715 * x * x * x));
    return (C)0.5 * ((C)1 + t) +
           (C)0.5 * x * ((C)1 - t * t) * (C)0.7978845608028654 * ((C)1 + (C)3 * (C)0.044715 * x * x);
}
// min(max(x, lo), hi) with NaN passing through (numpy's clip, PyTorch's clamp).
template <typename C>
__device__ __forceinline__ C clip_of(C x, C lo, C hi) {
    return x < lo ? lo : (x > hi ? hi : x);
}

template <typename C>
__device__ C unary_f(int op, C x, float p0, float p1) {
    const C a = (C)p0, b = (C)p1;
    switch (op) {
    case 0: return -x;
    case 1: return exp_of(x);
    case 2: return log_of(x);
    case 3: return sqrt_of(x);
    case 4: return tanh_of(x);
    case 5: return erf_of(x);
    case 6: return max_of(x, (C)0);
    case 7: return sigmoid_of(x);
    case 8: return abs_of(x);
    case 9: return (C)1 / x;
    case 10: return floor_of(x);
    case 11: return ceil_of(x);
    case 12: return x == (C)0 ? (C)1 : (C)0;
    case 13: return (C)0.5 * x * ((C)1 + erf_of(x * (C)0.7071067811865476));
    case 14: return gelu_tanh(x);
    case 15: return sin_of(x);
    case 16: return cos_of(x);
    case 17: return tan_of(x);
    case 18: return asin_of(x);
    case 19: return acos_of(x);
    case 20: return atan_of(x);
    case 21: return sinh_of(x);
    case 22: return cosh_of(x);
    case 23: return asinh_of(x);
    case 24: return acosh_of(x);
    case 25: return atanh_of(x);
    case 26: return x > (C)0 ? (C)1 : (x < (C)0 ? (C)-1 : x);
    case 27: return rint_of(x);  // half to even in the default rounding mode
    case 28: return softplus_of(x);
    case 29: return x / ((C)1 + abs_of(x));
    case 30: return x * tanh_of(softplus_of(x));
    case 31: return x * clip_of(x * (C)(1.0 / 6.0) + (C)0.5, (C)0, (C)1);
    case 32: return clip_of(a * x + b, (C)0, (C)1);
    case 33: return x >= (C)0 ? x : a * x;
    case 34: return x > (C)0 ? x : a * expm1_of(x);
    case 35: return b * (x > (C)0 ? x : a * expm1_of(x));
    case 36: return max_of(x, (C)0) + min_of((C)0, a * expm1_of(x / a));
    case 37: return x > a ? x : (C)0;
    case 41: return x * sigmoid_of(x);
    default: return clip_of(x, a, b);  // 38
    }
}

// d/dx of each activation at x (0 for the step functions: Floor, Ceil, Not, Sign, Round).
template <typename C>
__device__ C unary_df(int op, C x, float p0, float p1) {
    const C a = (C)p0, b = (C)p1;
    switch (op) {
    case 0: return (C)-1;
    case 1: return exp_of(x);
    case 2: return (C)1 / x;
    case 3: return (C)0.5 / sqrt_of(x);
    case 4: { C t = tanh_of(x); return (C)1 - t * t; }
    case 5: return (C)1.1283791670955126 * exp_of(-x * x);
    case 6: return x > (C)0 ? (C)1 : (C)0;
    case 7: { C s = sigmoid_of(x); return s * ((C)1 - s); }
    case 8: return x > (C)0 ? (C)1 : (x < (C)0 ? (C)-1 : (C)0);
    case 9: return (C)-1 / (x * x);
    case 13: {
        C cdf = (C)0.5 * ((C)1 + erf_of(x * (C)0.7071067811865476));
        C pdf = exp_of((C)-0.5 * x * x) * (C)0.3989422804014327;
        return cdf + x * pdf;
    }
    case 14: return gelu_tanh_grad(x);
    case 15: return cos_of(x);
    case 16: return -sin_of(x);
    case 17: { C c = cos_of(x); return (C)1 / (c * c); }
    case 18: return (C)1 / sqrt_of((C)1 - x * x);
    case 19: return (C)-1 / sqrt_of((C)1 - x * x);
    case 20: return (C)1 / ((C)1 + x * x);
    case 21: return cosh_of(x);
    case 22: return sinh_of(x);
    case 23: return (C)1 / sqrt_of(x * x + (C)1);
    case 24: return (C)1 / sqrt_of(x * x - (C)1);
    case 25: return (C)1 / ((C)1 - x * x);
    case 28: return sigmoid_of(x);
    case 29: { C d = (C)1 + abs_of(x); return (C)1 / (d * d); }
    case 30: {
        C t = tanh_of(softplus_of(x));
        return t + x * sigmoid_of(x) * ((C)1 - t * t);
    }
    case 31: return x < (C)-3 ? (C)0 : (x <= (C)3 ? x * (C)(1.0 / 3.0) + (C)0.5 : (C)1);
    case 32: { C z = a * x + b; return (z > (C)0 && z < (C)1) ? a : (C)0; }
    case 33: return x > (C)0 ? (C)1 : a;
    case 34: return x > (C)0 ? (C)1 : a * exp_of(x);
    case 35: return b * (x > (C)0 ? (C)1 : a * exp_of(x));
    case 36: return x > (C)0 ? (C)1 : exp_of(x / a);
    case 37: return x > a ? (C)1 : (C)0;
    case 38: return (x >= a && x <= b) ? (C)1 : (C)0;
    case 41: { C s = sigmoid_of(x); return s * ((C)1 + x * ((C)1 - s)); }
    default: return (C)0;  // 10, 11, 12, 26, 27
    }
}

template <class S>
__device__ void unary(int op, float p0, float p1, i64 n, const typename S::T* x, typename S::T* y) {
    for (i64 i = first_index(); i < n; i += grid_stride()) y[i] = S::store(unary_f(op, S::load(x[i]), p0, p1));
}
extern "C" __global__ void unary_f32(int op, float p0, float p1, i64 n, const float* x, float* y) {
    unary<F32>(op, p0, p1, n, x, y);
}
extern "C" __global__ void unary_f16(int op, float p0, float p1, i64 n, const u16* x, u16* y) {
    unary<F16>(op, p0, p1, n, x, y);
}
extern "C" __global__ void unary_bf16(int op, float p0, float p1, i64 n, const u16* x, u16* y) {
    unary<BF16>(op, p0, p1, n, x, y);
}
extern "C" __global__ void unary_f64(int op, float p0, float p1, i64 n, const double* x, double* y) {
    unary<F64>(op, p0, p1, n, x, y);
}

template <class S>
__device__ void unary_grad(int op, float p0, float p1, i64 n, const typename S::T* dy, const typename S::T* x,
                           typename S::T* dx) {
    for (i64 i = first_index(); i < n; i += grid_stride())
        dx[i] = S::store(S::load(dy[i]) * unary_df(op, S::load(x[i]), p0, p1));
}
extern "C" __global__ void unary_grad_f32(int op, float p0, float p1, i64 n, const float* dy, const float* x,
                                          float* dx) {
    unary_grad<F32>(op, p0, p1, n, dy, x, dx);
}
extern "C" __global__ void unary_grad_f16(int op, float p0, float p1, i64 n, const u16* dy, const u16* x,
                                          u16* dx) {
    unary_grad<F16>(op, p0, p1, n, dy, x, dx);
}
extern "C" __global__ void unary_grad_bf16(int op, float p0, float p1, i64 n, const u16* dy, const u16* x,
                                           u16* dx) {
    unary_grad<BF16>(op, p0, p1, n, dy, x, dx);
}
extern "C" __global__ void unary_grad_f64(int op, float p0, float p1, i64 n, const double* dy, const double* x,
                                          double* dx) {
    unary_grad<F64>(op, p0, p1, n, dy, x, dx);
}

// IsNaN (39) and IsInf (40: −∞ when p0 ≠ 0, +∞ when p1 ≠ 0) as bools. ∞ is the value that is
// not NaN and whose difference with itself is (no header needed for isinf).
template <class S>
__device__ void unary_predicate(int op, float p0, float p1, i64 n, const typename S::T* x, u8* y) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        typename S::C v = S::load(x[i]);
        bool nan = v != v, inf = !nan && (v - v) != (v - v);
        y[i] = (op == 39 ? nan : (inf && ((v > 0 && p1 != 0.f) || (v < 0 && p0 != 0.f)))) ? 1 : 0;
    }
}
extern "C" __global__ void unary_predicate_f32(int op, float p0, float p1, i64 n, const float* x, u8* y) {
    unary_predicate<F32>(op, p0, p1, n, x, y);
}
extern "C" __global__ void unary_predicate_f16(int op, float p0, float p1, i64 n, const u16* x, u8* y) {
    unary_predicate<F16>(op, p0, p1, n, x, y);
}
extern "C" __global__ void unary_predicate_bf16(int op, float p0, float p1, i64 n, const u16* x, u8* y) {
    unary_predicate<BF16>(op, p0, p1, n, x, y);
}
extern "C" __global__ void unary_predicate_f64(int op, float p0, float p1, i64 n, const double* x, u8* y) {
    unary_predicate<F64>(op, p0, p1, n, x, y);
}

// Not of bools.
extern "C" __global__ void not_u8(i64 n, const u8* x, u8* y) {
    for (i64 i = first_index(); i < n; i += grid_stride()) y[i] = x[i] == 0 ? 1 : 0;
}

// Arithmetic codes 0..6 and 15..17 (Mod, Fmod, PRelu) give a value of the operands' compute type; comparisons 7..11 a bool
// (u8). As the CPU backend's: x² is x·x, and Max and Min propagate NaN (numpy's maximum and
// minimum).
template <typename C>
__device__ __forceinline__ C arith_f(int op, C a, C b) {
    switch (op) {
    case 0: return a + b;
    case 1: return a - b;
    case 2: return a * b;
    case 3: return a / b;
    case 4: return b == (C)2 ? a * a : pow_of(a, b);
    case 5: return (a >= b || a != a) ? a : b;
    case 6: return (a <= b || a != a) ? a : b;
    case 15: {  // Mod: the remainder with the divisor's sign
        C r = fmod_of(a, b);
        return (r != (C)0 && ((r < (C)0) != (b < (C)0))) ? r + b : r;
    }
    case 16: return fmod_of(a, b);
    default: return a < (C)0 ? a * b : a;  // 17: PRelu
    }
}
template <typename C>
__device__ __forceinline__ bool compare_f(int op, C a, C b) {
    switch (op) {
    case 7: return a == b;
    case 8: return a < b;
    case 9: return a > b;
    case 10: return a <= b;
    default: return a >= b;
    }
}

// The contiguous case with every operand 16-byte aligned (as the executor's values are): 16
// bytes of each operand per access.
template <class S>
__device__ void binary_vectors(int op, i64 n, const typename S::T* a, const typename S::T* b, typename S::T* out) {
    typedef typename S::T T;
    const int N = 16 / sizeof(T);
    i64 vectors = n / N;
    for (i64 v = first_index(); v < vectors; v += grid_stride()) {
        Vec<T, N> x = ld_vec<T, N>(a + v * N), y = ld_vec<T, N>(b + v * N), z;
#pragma unroll
        for (int k = 0; k < N; ++k) z.e[k] = S::store(arith_f(op, S::load(x.e[k]), S::load(y.e[k])));
        st_vec<T, N>(out + v * N, z);
    }
    for (i64 i = vectors * N + first_index(); i < n; i += grid_stride())
        out[i] = S::store(arith_f(op, S::load(a[i]), S::load(b[i])));
}

// Where an operand's element for output element i lies, by how it broadcasts (`Reach` in
// launch.rs): 0 the output's own layout (i), 1 repeated along the leading dims (i mod k, its
// size: a bias, RoPE's [T, D] tables against [B, H, T, D]), 2 spread over the trailing dims
// (i / k, their size: a row statistic [B, T, 1] against [B, T, C]), 3 any other (the strides,
// a division per dim). One division at most where the strides took one per dim.
__device__ __forceinline__ i64 reach(int kind, i64 k, i64 i, const Dims& d, const Strides& s) {
    switch (kind) {
    case 0: return i;
    case 1: { i64 r; divmod(i, k, &r); return r; }
    case 2: { i64 r; return divmod(i, k, &r); }
    default: return offset_of(i, d, s);
    }
}

// out[i] = a[·] op b[·] over the output's shape `d`; `sa`, `sb` are the operands' strides
// broadcast to it, `ka`/`pa` and `kb`/`pb` how each reaches its elements (reach above).
template <class S>
__device__ void binary(int op, i64 n, const Dims& d, const typename S::T* a, const Strides& sa, int ka, i64 pa,
                       const typename S::T* b, const Strides& sb, int kb, i64 pb, typename S::T* out) {
    if (ka == 0 && kb == 0 && aligned16(a) && aligned16(b) && aligned16(out)) {
        binary_vectors<S>(op, n, a, b, out);
        return;
    }
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        typename S::C x = S::load(a[reach(ka, pa, i, d, sa)]);
        typename S::C y = S::load(b[reach(kb, pb, i, d, sb)]);
        out[i] = S::store(arith_f(op, x, y));
    }
}
extern "C" __global__ void binary_f32(int op, i64 n, Dims d, const float* a, Strides sa, int ka, i64 pa,
                                      const float* b, Strides sb, int kb, i64 pb, float* out) {
    binary<F32>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void binary_f16(int op, i64 n, Dims d, const u16* a, Strides sa, int ka, i64 pa, const u16* b,
                                      Strides sb, int kb, i64 pb, u16* out) {
    binary<F16>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void binary_bf16(int op, i64 n, Dims d, const u16* a, Strides sa, int ka, i64 pa,
                                       const u16* b, Strides sb, int kb, i64 pb, u16* out) {
    binary<BF16>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void binary_f64(int op, i64 n, Dims d, const double* a, Strides sa, int ka, i64 pa,
                                      const double* b, Strides sb, int kb, i64 pb, double* out) {
    binary<F64>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}

// SwiGLU's SiLU(a)·b (dy null), or its gradient: da = dy·b·SiLU'(a), db = dy·SiLU(a).
template <class S>
__device__ void swiglu(i64 n, const typename S::T* dy, const typename S::T* a, const typename S::T* b,
                       typename S::T* out, typename S::T* db) {
    typedef typename S::C C;
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        C x = S::load(a[i]), u = S::load(b[i]), s = sigmoid_of(x);
        if (!dy) {
            out[i] = S::store(x * s * u);
            continue;
        }
        C g = S::load(dy[i]);
        out[i] = S::store(g * u * (s * ((C)1 + x * ((C)1 - s))));
        db[i] = S::store(g * (x * s));
    }
}
extern "C" __global__ void swiglu_f32(i64 n, const float* dy, const float* a, const float* b, float* out, float* db) {
    swiglu<F32>(n, dy, a, b, out, db);
}
extern "C" __global__ void swiglu_f16(i64 n, const u16* dy, const u16* a, const u16* b, u16* out, u16* db) {
    swiglu<F16>(n, dy, a, b, out, db);
}
extern "C" __global__ void swiglu_bf16(i64 n, const u16* dy, const u16* a, const u16* b, u16* out, u16* db) {
    swiglu<BF16>(n, dy, a, b, out, db);
}
extern "C" __global__ void swiglu_f64(i64 n, const double* dy, const double* a, const double* b, double* out,
                                      double* db) {
    swiglu<F64>(n, dy, a, b, out, db);
}

// The rotary embedding over the last dim's halves of `h` elements (RoPE as Hugging Face's Llama
// applies it), one thread per pair (j, j + h) of a row: forward y = x·cos + [−x₂, x₁]·sin;
// backward (grad 1, x the output's gradient) dx = x·cos + [x₂·sin₂, −x₁·sin₁]. cos and sin
// reach their elements as a binary op's operands do (reach above).
template <class S>
__device__ void rotary(int grad, i64 pairs, i64 h, const Dims& d, const typename S::T* x, const typename S::T* cosine,
                       const Strides& sc, int kc, i64 pc, const typename S::T* sine, const Strides& ss, int ks, i64 ps,
                       typename S::T* out) {
    typedef typename S::C C;
    for (i64 p = first_index(); p < pairs; p += grid_stride()) {
        i64 within;
        i64 i1 = divmod(p, h, &within) * 2 * h + within, i2 = i1 + h;
        C x1 = S::load(x[i1]), x2 = S::load(x[i2]);
        C c1 = S::load(cosine[reach(kc, pc, i1, d, sc)]), c2 = S::load(cosine[reach(kc, pc, i2, d, sc)]);
        C s1 = S::load(sine[reach(ks, ps, i1, d, ss)]), s2 = S::load(sine[reach(ks, ps, i2, d, ss)]);
        out[i1] = S::store(grad ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
        out[i2] = S::store(grad ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
    }
}
extern "C" __global__ void rotary_f32(int grad, i64 pairs, i64 h, Dims d, const float* x, const float* cosine,
                                   Strides sc, int kc, i64 pc, const float* sine, Strides ss, int ks, i64 ps,
                                   float* out) {
    rotary<F32>(grad, pairs, h, d, x, cosine, sc, kc, pc, sine, ss, ks, ps, out);
}
extern "C" __global__ void rotary_f16(int grad, i64 pairs, i64 h, Dims d, const u16* x, const u16* cosine,
                                   Strides sc, int kc, i64 pc, const u16* sine, Strides ss, int ks, i64 ps,
                                   u16* out) {
    rotary<F16>(grad, pairs, h, d, x, cosine, sc, kc, pc, sine, ss, ks, ps, out);
}
extern "C" __global__ void rotary_bf16(int grad, i64 pairs, i64 h, Dims d, const u16* x, const u16* cosine,
                                   Strides sc, int kc, i64 pc, const u16* sine, Strides ss, int ks, i64 ps,
                                   u16* out) {
    rotary<BF16>(grad, pairs, h, d, x, cosine, sc, kc, pc, sine, ss, ks, ps, out);
}
extern "C" __global__ void rotary_f64(int grad, i64 pairs, i64 h, Dims d, const double* x, const double* cosine,
                                   Strides sc, int kc, i64 pc, const double* sine, Strides ss, int ks, i64 ps,
                                   double* out) {
    rotary<F64>(grad, pairs, h, d, x, cosine, sc, kc, pc, sine, ss, ks, ps, out);
}

template <class S>
__device__ void compare(int op, i64 n, const Dims& d, const typename S::T* a, const Strides& sa,
                        const typename S::T* b, const Strides& sb, u8* out) {
    for (i64 i = first_index(); i < n; i += grid_stride())
        out[i] = compare_f(op, S::load(a[offset_of(i, d, sa)]), S::load(b[offset_of(i, d, sb)])) ? 1 : 0;
}
extern "C" __global__ void compare_f32(int op, i64 n, Dims d, const float* a, Strides sa, const float* b,
                                       Strides sb, u8* out) {
    compare<F32>(op, n, d, a, sa, b, sb, out);
}
extern "C" __global__ void compare_f16(int op, i64 n, Dims d, const u16* a, Strides sa, const u16* b, Strides sb,
                                       u8* out) {
    compare<F16>(op, n, d, a, sa, b, sb, out);
}
extern "C" __global__ void compare_bf16(int op, i64 n, Dims d, const u16* a, Strides sa, const u16* b,
                                        Strides sb, u8* out) {
    compare<BF16>(op, n, d, a, sa, b, sb, out);
}
extern "C" __global__ void compare_f64(int op, i64 n, Dims d, const double* a, Strides sa, const double* b,
                                       Strides sb, u8* out) {
    compare<F64>(op, n, d, a, sa, b, sb, out);
}

// a^b for an integer exponent b, in f64: by squaring for b ≥ 0 (exact while the powers stay
// below 2^53, where the GPU's pow() may be off by an ulp and so truncate to the integer below),
// pow() for b < 0 (a result of magnitude at most 1, or ∞).
__device__ double integer_power(double a, double b) {
    if (b < 0.0) return pow(a, b);
    // Exponents past 2^63 are even in f64, as 2^63 is.
    u64 e = b >= 9223372036854775808.0 ? (1ull << 63) : (u64)b;
    double r = 1.0;
    for (; e; e >>= 1) {
        if (e & 1) r *= a;
        a *= a;
    }
    return r;
}

// Integer arithmetic and comparisons, as the CPU backend's: sums and products wrap (computed in
// the unsigned type U of at least 32 bits, where C would call a signed overflow, or a u16
// product promoted to int, undefined), division truncates and gives 0 for a zero divisor or
// for MIN / −1, Pow goes through f64 and saturates to the type (NaN gives 0).
template <typename T, typename U>
__device__ __forceinline__ T arith_int(int op, T a, T b) {
    const T lowest = (T)0 < (T)-1 ? (T)0 : (T)((U)1 << (8 * sizeof(T) - 1));
    const T highest = (T)~lowest;
    switch (op) {
    case 0: return (T)((U)a + (U)b);
    case 1: return (T)((U)a - (U)b);
    case 2: return (T)((U)a * (U)b);
    case 3: return (b == 0 || (a == lowest && b == (T)-1)) ? (T)0 : (T)(a / b);
    case 4: {
        double p = integer_power((double)a, (double)b);
        if (p != p) return 0;
        if (p <= (double)lowest) return lowest;
        if (p >= (double)highest) return highest;
        return (T)p;
    }
    case 5: return a > b ? a : b;
    case 6: return a < b ? a : b;
    case 15:
    case 16: {  // the truncated remainder, 0 for a zero divisor or MIN % −1; Mod moves it to b's sign
        T r = (b == 0 || (a == lowest && b == (T)-1)) ? (T)0 : (T)(a % b);
        return (op == 15 && r != 0 && ((r < 0) != (b < 0))) ? (T)((U)r + (U)b) : r;
    }
    default: return a < 0 ? (T)((U)a * (U)b) : a;  // 17: PRelu
    }
}
template <typename T, typename U>
__device__ void binary_int(int op, i64 n, const Dims& d, const T* a, const Strides& sa, int ka, i64 pa, const T* b,
                           const Strides& sb, int kb, i64 pb, T* out) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        T x = a[reach(ka, pa, i, d, sa)];
        T y = b[reach(kb, pb, i, d, sb)];
        out[i] = arith_int<T, U>(op, x, y);
    }
}
template <typename T>
__device__ void compare_int(int op, i64 n, const Dims& d, const T* a, const Strides& sa, const T* b,
                            const Strides& sb, u8* out) {
    for (i64 i = first_index(); i < n; i += grid_stride())
        out[i] = compare_f(op, a[offset_of(i, d, sa)], b[offset_of(i, d, sb)]) ? 1 : 0;
}
// One pair per integer type (the kernel-declaration parser reads each entry point as written).
extern "C" __global__ void binary_i8(int op, i64 n, Dims d, const i8* a, Strides sa, int ka, i64 pa,
                                      const i8* b, Strides sb, int kb, i64 pb, i8* out) {
    binary_int<i8, u32>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void compare_i8(int op, i64 n, Dims d, const i8* a, Strides sa, const i8* b, Strides sb,
                                      u8* out) {
    compare_int<i8>(op, n, d, a, sa, b, sb, out);
}
extern "C" __global__ void binary_u8(int op, i64 n, Dims d, const u8* a, Strides sa, int ka, i64 pa,
                                      const u8* b, Strides sb, int kb, i64 pb, u8* out) {
    binary_int<u8, u32>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void compare_u8(int op, i64 n, Dims d, const u8* a, Strides sa, const u8* b, Strides sb,
                                      u8* out) {
    compare_int<u8>(op, n, d, a, sa, b, sb, out);
}
extern "C" __global__ void binary_i16(int op, i64 n, Dims d, const i16* a, Strides sa, int ka, i64 pa,
                                      const i16* b, Strides sb, int kb, i64 pb, i16* out) {
    binary_int<i16, u32>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void compare_i16(int op, i64 n, Dims d, const i16* a, Strides sa, const i16* b, Strides sb,
                                       u8* out) {
    compare_int<i16>(op, n, d, a, sa, b, sb, out);
}
extern "C" __global__ void binary_u16(int op, i64 n, Dims d, const u16* a, Strides sa, int ka, i64 pa,
                                      const u16* b, Strides sb, int kb, i64 pb, u16* out) {
    binary_int<u16, u32>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void compare_u16(int op, i64 n, Dims d, const u16* a, Strides sa, const u16* b, Strides sb,
                                       u8* out) {
    compare_int<u16>(op, n, d, a, sa, b, sb, out);
}
extern "C" __global__ void binary_i32(int op, i64 n, Dims d, const int* a, Strides sa, int ka, i64 pa,
                                      const int* b, Strides sb, int kb, i64 pb, int* out) {
    binary_int<int, u32>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void compare_i32(int op, i64 n, Dims d, const int* a, Strides sa, const int* b, Strides sb,
                                       u8* out) {
    compare_int<int>(op, n, d, a, sa, b, sb, out);
}
extern "C" __global__ void binary_u32(int op, i64 n, Dims d, const u32* a, Strides sa, int ka, i64 pa,
                                      const u32* b, Strides sb, int kb, i64 pb, u32* out) {
    binary_int<u32, u32>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void compare_u32(int op, i64 n, Dims d, const u32* a, Strides sa, const u32* b, Strides sb,
                                       u8* out) {
    compare_int<u32>(op, n, d, a, sa, b, sb, out);
}
extern "C" __global__ void binary_i64(int op, i64 n, Dims d, const i64* a, Strides sa, int ka, i64 pa,
                                      const i64* b, Strides sb, int kb, i64 pb, i64* out) {
    binary_int<i64, u64>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void compare_i64(int op, i64 n, Dims d, const i64* a, Strides sa, const i64* b, Strides sb,
                                       u8* out) {
    compare_int<i64>(op, n, d, a, sa, b, sb, out);
}
extern "C" __global__ void binary_u64(int op, i64 n, Dims d, const u64* a, Strides sa, int ka, i64 pa,
                                      const u64* b, Strides sb, int kb, i64 pb, u64* out) {
    binary_int<u64, u64>(op, n, d, a, sa, ka, pa, b, sb, kb, pb, out);
}
extern "C" __global__ void compare_u64(int op, i64 n, Dims d, const u64* a, Strides sa, const u64* b, Strides sb,
                                       u8* out) {
    compare_int<u64>(op, n, d, a, sa, b, sb, out);
}

// And (12), Or (13) and Xor (14) of bools (their comparisons are compare_u8's).
extern "C" __global__ void logic_u8(int op, i64 n, Dims d, const u8* a, Strides sa, const u8* b, Strides sb,
                                    u8* out) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        bool x = a[offset_of(i, d, sa)] != 0, y = b[offset_of(i, d, sb)] != 0;
        out[i] = (op == 12 ? (x && y) : op == 13 ? (x || y) : (x != y)) ? 1 : 0;
    }
}

// ---- Pad and its gradient ----

// The input coordinate that output coordinate o reads along an axis of n elements with `begin`
// padding before it, or -1 in the constant border: PadMode::source (graph/op.rs), whose order
// the mode codes follow (0 constant, 1 reflect, 2 edge, 3 wrap).
__device__ __forceinline__ i64 pad_source(int mode, i64 o, i64 begin, i64 n) {
    i64 i = o - begin;
    if (i >= 0 && i < n) return i;
    switch (mode) {
    case 0: return -1;
    case 2: return i < 0 ? 0 : n - 1;
    case 3: { i64 r = i % n; return r < 0 ? r + n : r; }
    default: {
        if (n == 1) return 0;
        i64 p = 2 * n - 2, j = i % p;
        if (j < 0) j += p;
        return j >= n ? p - j : j;
    }
    }
}
// The offset in the input (shape id, strides is) that output element i (of shape od) reads, or
// -1 in the constant border.
__device__ i64 pad_offset(i64 i, int mode, const Dims& od, const Dims& id, const Strides& is, const Strides& begin) {
    i64 off = 0, j = i;
    for (int k = (int)od.rank - 1; k >= 0; --k) {
        i64 c = j % od.size[k];
        j /= od.size[k];
        i64 s = pad_source(mode, c, begin.at[k], id.size[k]);
        if (s < 0) return -1;
        off += s * is.at[k];
    }
    return off;
}
// out[i] = x[pad_offset(i)], or the fill value's bits (the low bytes of `fill`).
template <typename T>
__device__ void pad(int mode, i64 n, const Dims& od, const Dims& id, const Strides& is, const Strides& begin,
                    const T* x, u64 fill, T* out) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 at = pad_offset(i, mode, od, id, is, begin);
        out[i] = at < 0 ? (T)fill : x[at];
    }
}
extern "C" __global__ void pad_b8(int mode, i64 n, Dims od, Dims id, Strides is, Strides begin, const u8* x,
                                  u64 fill, u8* out) {
    pad<u8>(mode, n, od, id, is, begin, x, fill, out);
}
extern "C" __global__ void pad_b16(int mode, i64 n, Dims od, Dims id, Strides is, Strides begin, const u16* x,
                                   u64 fill, u16* out) {
    pad<u16>(mode, n, od, id, is, begin, x, fill, out);
}
extern "C" __global__ void pad_b32(int mode, i64 n, Dims od, Dims id, Strides is, Strides begin, const u32* x,
                                   u64 fill, u32* out) {
    pad<u32>(mode, n, od, id, is, begin, x, fill, out);
}
extern "C" __global__ void pad_b64(int mode, i64 n, Dims od, Dims id, Strides is, Strides begin, const u64* x,
                                   u64 fill, u64* out) {
    pad<u64>(mode, n, od, id, is, begin, x, fill, out);
}
// dX (zeroed first by the backend) += dY at the input element each output element read.
// atomicAdd: the reflect, edge and wrap borders read input elements more than once.
extern "C" __global__ void pad_grad_f32(int mode, i64 n, Dims od, Dims id, Strides is, Strides begin,
                                        const float* dy, float* dx) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 at = pad_offset(i, mode, od, id, is, begin);
        if (at >= 0) atomicAdd(&dx[at], dy[i]);
    }
}

// Where(cond, x, y) for elements of 1, 2, 4 or 8 bytes.
extern "C" __global__ void where_b8(i64 n, Dims d, const u8* c, Strides sc, const u8* x, Strides sx, const u8* y,
                                    Strides sy, u8* out) {
    for (i64 i = first_index(); i < n; i += grid_stride())
        out[i] = c[offset_of(i, d, sc)] ? x[offset_of(i, d, sx)] : y[offset_of(i, d, sy)];
}
extern "C" __global__ void where_b16(i64 n, Dims d, const u8* c, Strides sc, const u16* x, Strides sx, const u16* y,
                                     Strides sy, u16* out) {
    for (i64 i = first_index(); i < n; i += grid_stride())
        out[i] = c[offset_of(i, d, sc)] ? x[offset_of(i, d, sx)] : y[offset_of(i, d, sy)];
}
extern "C" __global__ void where_b32(i64 n, Dims d, const u8* c, Strides sc, const u32* x, Strides sx, const u32* y,
                                     Strides sy, u32* out) {
    for (i64 i = first_index(); i < n; i += grid_stride())
        out[i] = c[offset_of(i, d, sc)] ? x[offset_of(i, d, sx)] : y[offset_of(i, d, sy)];
}
extern "C" __global__ void where_b64(i64 n, Dims d, const u8* c, Strides sc, const u64* x, Strides sx, const u64* y,
                                     Strides sy, u64* out) {
    for (i64 i = first_index(); i < n; i += grid_stride())
        out[i] = c[offset_of(i, d, sc)] ? x[offset_of(i, d, sx)] : y[offset_of(i, d, sy)];
}

// Expand, Transpose, Split, Slice and any other copy that reads its input through strides: out[i] =
// x[offset(i)] (a broadcast dimension has stride 0, a permuted one the input's stride).
extern "C" __global__ void strided_copy_b32(i64 n, Dims d, const u32* x, Strides sx, u32* out) {
    for (i64 i = first_index(); i < n; i += grid_stride()) out[i] = x[offset_of(i, d, sx)];
}
extern "C" __global__ void strided_copy_b8(i64 n, Dims d, const u8* x, Strides sx, u8* out) {
    for (i64 i = first_index(); i < n; i += grid_stride()) out[i] = x[offset_of(i, d, sx)];
}
extern "C" __global__ void strided_copy_b16(i64 n, Dims d, const u16* x, Strides sx, u16* out) {
    for (i64 i = first_index(); i < n; i += grid_stride()) out[i] = x[offset_of(i, d, sx)];
}
extern "C" __global__ void strided_copy_b64(i64 n, Dims d, const u64* x, Strides sx, u64* out) {
    for (i64 i = first_index(); i < n; i += grid_stride()) out[i] = x[offset_of(i, d, sx)];
}
extern "C" __global__ void strided_copy_b128(i64 n, Dims d, const u128* x, Strides sx, u128* out) {
    for (i64 i = first_index(); i < n; i += grid_stride()) out[i] = x[offset_of(i, d, sx)];
}

// The inverse: out[offset(i)] = x[i], x contiguous, the output read through strides (Concat
// writes each input into its part of the output, SliceGrad the gradient into its slice).
extern "C" __global__ void strided_store_b32(i64 n, Dims d, const u32* x, u32* out, Strides so) {
    for (i64 i = first_index(); i < n; i += grid_stride()) out[offset_of(i, d, so)] = x[i];
}
extern "C" __global__ void strided_store_b8(i64 n, Dims d, const u8* x, u8* out, Strides so) {
    for (i64 i = first_index(); i < n; i += grid_stride()) out[offset_of(i, d, so)] = x[i];
}
extern "C" __global__ void strided_store_b16(i64 n, Dims d, const u16* x, u16* out, Strides so) {
    for (i64 i = first_index(); i < n; i += grid_stride()) out[offset_of(i, d, so)] = x[i];
}
extern "C" __global__ void strided_store_b64(i64 n, Dims d, const u64* x, u64* out, Strides so) {
    for (i64 i = first_index(); i < n; i += grid_stride()) out[offset_of(i, d, so)] = x[i];
}
extern "C" __global__ void strided_store_b128(i64 n, Dims d, const u128* x, u128* out, Strides so) {
    for (i64 i = first_index(); i < n; i += grid_stride()) out[offset_of(i, d, so)] = x[i];
}

// Rows of `cols` elements from x (rows `x_ld` apart) to y (rows `y_ld` apart), and with `pad`
// zeros after each row up to y_ld: a strided move of rank 2 (Split, Concat, a product's padded
// operands), with a block per row and no index division per element.
template <class T>
__device__ void rows_copy(i64 rows, i64 cols, i64 x_ld, const T* x, i64 y_ld, T* y, int pad) {
    i64 width = pad ? y_ld : cols;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T* xr = x + r * x_ld;
        T* yr = y + r * y_ld;
        for (i64 c = threadIdx.x; c < width; c += blockDim.x) yr[c] = c < cols ? xr[c] : T{};
    }
}
extern "C" __global__ void rows_b8(i64 rows, i64 cols, i64 x_ld, const u8* x, i64 y_ld, u8* y, int pad) {
    rows_copy(rows, cols, x_ld, x, y_ld, y, pad);
}
extern "C" __global__ void rows_b16(i64 rows, i64 cols, i64 x_ld, const u16* x, i64 y_ld, u16* y, int pad) {
    rows_copy(rows, cols, x_ld, x, y_ld, y, pad);
}
extern "C" __global__ void rows_b32(i64 rows, i64 cols, i64 x_ld, const u32* x, i64 y_ld, u32* y, int pad) {
    rows_copy(rows, cols, x_ld, x, y_ld, y, pad);
}
extern "C" __global__ void rows_b64(i64 rows, i64 cols, i64 x_ld, const u64* x, i64 y_ld, u64* y, int pad) {
    rows_copy(rows, cols, x_ld, x, y_ld, y, pad);
}
extern "C" __global__ void rows_b128(i64 rows, i64 cols, i64 x_ld, const u128* x, i64 y_ld, u128* y, int pad) {
    rows_copy(rows, cols, x_ld, x, y_ld, y, pad);
}

// Element types by their ONNX codes (TensorProto.DataType; DType::onnx_code on the Rust side).
#define TY_F32 1
#define TY_U8 2
#define TY_I8 3
#define TY_U16 4
#define TY_I16 5
#define TY_I32 6
#define TY_I64 7
#define TY_BOOL 9
#define TY_F16 10
#define TY_F64 11
#define TY_U32 12
#define TY_U64 13
#define TY_BF16 16

// Element i of x (of type t) as f64.
__device__ double load_f64(int t, const void* x, i64 i) {
    switch (t) {
    case TY_F32: return ((const float*)x)[i];
    case TY_F16: return f16_to_f32(((const u16*)x)[i]);
    case TY_BF16: return bf16_to_f32(((const u16*)x)[i]);
    case TY_F64: return ((const double*)x)[i];
    case TY_I8: return ((const i8*)x)[i];
    case TY_I16: return ((const i16*)x)[i];
    case TY_I32: return ((const int*)x)[i];
    case TY_I64: return (double)((const i64*)x)[i];
    case TY_U16: return ((const u16*)x)[i];
    case TY_U32: return ((const u32*)x)[i];
    case TY_U64: return (double)((const u64*)x)[i];
    default: return ((const u8*)x)[i];
    }
}

// Element i of x (of an integer type t, or bool) as i64; a u64 past i64's range reads 0, as the
// CPU backend's conversion does.
__device__ i64 load_i64(int t, const void* x, i64 i) {
    switch (t) {
    case TY_I8: return ((const i8*)x)[i];
    case TY_I16: return ((const i16*)x)[i];
    case TY_I32: return ((const int*)x)[i];
    case TY_I64: return ((const i64*)x)[i];
    case TY_U16: return ((const u16*)x)[i];
    case TY_U32: return ((const u32*)x)[i];
    case TY_U64: {
        u64 v = ((const u64*)x)[i];
        return v >> 63 ? 0 : (i64)v;
    }
    default: return ((const u8*)x)[i];
    }
}

// A float truncated toward zero to i64, 0 for NaN and values outside i64's range (ONNX leaves
// those undefined; the CPU backend gives 0).
__device__ __forceinline__ i64 trunc_i64(double v) {
    if (!(v >= -9223372036854775808.0 && v < 9223372036854775808.0)) return 0;
    return (i64)v;
}

__device__ __forceinline__ bool is_float_type(int t) { return t == TY_F32 || t == TY_F16 || t == TY_BF16 || t == TY_F64; }

// Between f32, f16 and bf16 (mixed precision's casts of every step), four elements per access,
// from and to 16-byte-aligned addresses; the conversions are the general loop's.
template <class A, class B>
__device__ void cast_vectors(i64 n, const typename A::T* x, typename B::T* y) {
    i64 vectors = n / 4;
    for (i64 v = first_index(); v < vectors; v += grid_stride()) {
        Vec<typename A::T, 4> in = ld_vec<typename A::T, 4>(x + v * 4);
        Vec<typename B::T, 4> out;
#pragma unroll
        for (int k = 0; k < 4; ++k) out.e[k] = B::store(A::load(in.e[k]));
        st_vec<typename B::T, 4>(y + v * 4, out);
    }
    for (i64 i = vectors * 4 + first_index(); i < n; i += grid_stride()) y[i] = B::store(A::load(x[i]));
}
template <class A>
__device__ void cast_vectors_from(int to, i64 n, const void* x, void* y) {
    const typename A::T* from = (const typename A::T*)x;
    switch (to) {
    case TY_F32: cast_vectors<A, F32>(n, from, (float*)y); break;
    case TY_F16: cast_vectors<A, F16>(n, from, (u16*)y); break;
    default: cast_vectors<A, BF16>(n, from, (u16*)y); break;
    }
}

// Cast (ONNX semantics, as the CPU backend's cast.rs): between any two element types. Floats
// meet through f64 (f32, f16 and bf16 through f32, exactly); f16 and bf16 are rounded from f32
// (from f64 and wide integers that is two roundings, as on the CPU backend and in PyTorch);
// floats to integers truncate toward zero and then wrap to the type's width, integers wrap;
// bool is x ≠ 0.
extern "C" __global__ void cast(int from, int to, i64 n, const void* x, void* y) {
    bool halves = from == TY_F32 || from == TY_F16 || from == TY_BF16;
    if (halves && (to == TY_F32 || to == TY_F16 || to == TY_BF16) && aligned16(x) && aligned16(y)) {
        switch (from) {
        case TY_F32: cast_vectors_from<F32>(to, n, x, y); break;
        case TY_F16: cast_vectors_from<F16>(to, n, x, y); break;
        default: cast_vectors_from<BF16>(to, n, x, y); break;
        }
        return;
    }
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        if (to == TY_F64) {
            ((double*)y)[i] = load_f64(from, x, i);
            continue;
        }
        if (to == TY_F32 || to == TY_F16 || to == TY_BF16 || to == TY_BOOL) {
            float v;
            if (halves) {
                v = from == TY_F32 ? ((const float*)x)[i]
                    : from == TY_F16 ? f16_to_f32(((const u16*)x)[i])
                                      : bf16_to_f32(((const u16*)x)[i]);
            } else {
                double d = load_f64(from, x, i);
                if (to == TY_BOOL) {
                    ((u8*)y)[i] = d != 0.0 ? 1 : 0;
                    continue;
                }
                v = (float)d;
            }
            switch (to) {
            case TY_F32: ((float*)y)[i] = v; break;
            case TY_F16: ((u16*)y)[i] = f32_to_f16(v); break;
            case TY_BF16: ((u16*)y)[i] = f32_to_bf16(v); break;
            default: ((u8*)y)[i] = v != 0.f ? 1 : 0; break;
            }
            continue;
        }
        i64 v = is_float_type(from) ? trunc_i64(load_f64(from, x, i)) : load_i64(from, x, i);
        switch (to) {
        case TY_I8: ((i8*)y)[i] = (i8)v; break;
        case TY_I16: ((i16*)y)[i] = (i16)v; break;
        case TY_I32: ((int*)y)[i] = (int)v; break;
        case TY_I64: ((i64*)y)[i] = v; break;
        case TY_U16: ((u16*)y)[i] = (u16)v; break;
        case TY_U32: ((u32*)y)[i] = (u32)v; break;
        case TY_U64: ((u64*)y)[i] = (u64)v; break;
        default: ((u8*)y)[i] = (u8)v; break;
        }
    }
}

// Dropout in training: mask[i] = uniform(seed, i) ≥ ratio, y = x·mask/(1 − ratio). The draw is
// rng::uniform's, so masks equal the CPU backend's.
template <class S>
__device__ void dropout(i64 n, u64 seed, float ratio, const typename S::T* x, typename S::T* y, u8* mask) {
    float scale = 1.f / (1.f - ratio);
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        u8 keep = uniform01(seed, (u64)i) >= (double)ratio ? 1 : 0;
        y[i] = S::store(S::load(x[i]) * (float)keep * scale);
        if (mask) mask[i] = keep;
    }
}
extern "C" __global__ void dropout_f32(i64 n, u64 seed, float ratio, const float* x, float* y, u8* mask) {
    dropout<F32>(n, seed, ratio, x, y, mask);
}
extern "C" __global__ void dropout_f16(i64 n, u64 seed, float ratio, const u16* x, u16* y, u8* mask) {
    dropout<F16>(n, seed, ratio, x, y, mask);
}
extern "C" __global__ void dropout_bf16(i64 n, u64 seed, float ratio, const u16* x, u16* y, u8* mask) {
    dropout<BF16>(n, seed, ratio, x, y, mask);
}

template <class S>
__device__ void dropout_grad(i64 n, float scale, const typename S::T* dy, const u8* mask, typename S::T* dx) {
    for (i64 i = first_index(); i < n; i += grid_stride()) dx[i] = S::store(S::load(dy[i]) * (float)mask[i] * scale);
}
extern "C" __global__ void dropout_grad_f32(i64 n, float scale, const float* dy, const u8* mask, float* dx) {
    dropout_grad<F32>(n, scale, dy, mask, dx);
}
extern "C" __global__ void dropout_grad_f16(i64 n, float scale, const u16* dy, const u8* mask, u16* dx) {
    dropout_grad<F16>(n, scale, dy, mask, dx);
}
extern "C" __global__ void dropout_grad_bf16(i64 n, float scale, const u16* dy, const u8* mask, u16* dx) {
    dropout_grad<BF16>(n, scale, dy, mask, dx);
}

// Trilu over the last two dims (rows × cols) of 1-, 2-, 4- or 8-byte elements: keep element
// (r, c) where c − r ≤ k (lower) or c − r ≥ k (upper), zero elsewhere.
extern "C" __global__ void trilu_b32(i64 n, i64 rows, i64 cols, int upper, i64 k, const u32* x, u32* y) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 c = i % cols, r = (i / cols) % rows;
        bool keep = upper ? (c - r >= k) : (c - r <= k);
        y[i] = keep ? x[i] : 0u;
    }
}
extern "C" __global__ void trilu_b8(i64 n, i64 rows, i64 cols, int upper, i64 k, const u8* x, u8* y) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 c = i % cols, r = (i / cols) % rows;
        bool keep = upper ? (c - r >= k) : (c - r <= k);
        y[i] = keep ? x[i] : 0;
    }
}
extern "C" __global__ void trilu_b16(i64 n, i64 rows, i64 cols, int upper, i64 k, const u16* x, u16* y) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 c = i % cols, r = (i / cols) % rows;
        bool keep = upper ? (c - r >= k) : (c - r <= k);
        y[i] = keep ? x[i] : 0;
    }
}
extern "C" __global__ void trilu_b64(i64 n, i64 rows, i64 cols, int upper, i64 k, const u64* x, u64* y) {
    for (i64 i = first_index(); i < n; i += grid_stride()) {
        i64 c = i % cols, r = (i / cols) % rows;
        bool keep = upper ? (c - r >= k) : (c - r <= k);
        y[i] = keep ? x[i] : 0ull;
    }
}
