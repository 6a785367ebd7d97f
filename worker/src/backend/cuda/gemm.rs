//! Matrix products through cuBLASLt with fp32 accumulation (CUBLAS_COMPUTE_32F: no TF32, so
//! f32 results match the CPU backend's within fp32 rounding), of f32, f16 or bf16 matrices
//! (mixed precision's products: half inputs and output, f32 alpha and beta).
//!
//! Our tensors are row-major and cuBLASLt's matrices column-major. A row-major [r, c] matrix
//! read column-major is its transpose, so C = A·B (row-major) is computed as Cᵀ = Bᵀ·Aᵀ: cuBLASLt
//! is handed B as its first operand and A as its second, and writes Cᵀ column-major, which is
//! C row-major.

use crate::backend::BackendError;
use crate::tensor::DType;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use std::collections::HashMap;
use std::ffi::c_void;

/// What a product does to its f32 result before D is rounded to its type: cuBLASLt's
/// epilogues, GELU being GPT-2's tanh approximation (cuBLASLt's, which llm.c relies on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// D = result (+ bias).
    Plain,
    /// D = gelu(result + bias); `aux` (0: none) also gets result + bias, laid out like D, for
    /// the gradient (GELU_AUX_BIAS).
    Gelu { aux: u64 },
    /// D = result ⊙ gelu'(aux), aux laid out like D: the result is the gradient of a GELU's
    /// output, aux its input (DGELU; no bias).
    GeluGrad { aux: u64 },
}

/// One product D = alpha·op(A)·op(B) + beta·D (+ bias) over `batch` matrices, row-major: op(A)
/// is [m, k], op(B) [k, n], D [m, n]; an operand's batch stride is 0 when every batch shares it.
/// D's is m·n when the outputs are packed, more when they interleave with others (one group
/// of a grouped convolution's channels, per image). `bias` (0: none) is a vector of n added to
/// every row of every batch in the product's epilogue, before D is rounded to its type; then
/// `epilogue`.
#[derive(Clone, Copy, Debug)]
pub struct Product {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub batch: u64,
    pub trans_a: bool,
    pub trans_b: bool,
    pub a: u64,
    pub a_stride: i64,
    pub b: u64,
    pub b_stride: i64,
    pub d: u64,
    pub d_stride: i64,
    pub alpha: f32,
    pub beta: f32,
    /// The element type of A, B, D and the bias: f32, f16 or bf16 (accumulation and alpha/beta
    /// in f32).
    pub dtype: DType,
    /// D's element type: `dtype`, or f32 for a half product whose f32 sums are wanted unrounded
    /// (convolution's weight gradient, summed over images after it). No epilogue then.
    pub d_dtype: DType,
    pub bias: u64,
    pub epilogue: Epilogue,
}

impl Product {
    /// Whether the product does more than D = alpha·op(A)·op(B) + beta·D.
    pub fn has_epilogue(&self) -> bool {
        self.bias != 0 || self.epilogue != Epilogue::Plain
    }
}

/// The cuBLASLt handle, its workspace (both live as long as the backend) and the plans made so
/// far, by shape.
pub(super) struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
    plans: HashMap<Shape, Option<Plan>>,
}

// SAFETY: the handle is used under the backend's lock, one call at a time.
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

/// cuBLASLt's recommended workspace on Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

fn err(what: &str, e: lt::CublasError) -> String {
    format!("cuBLASLt {what}: {e:?}")
}

/// Why a product did not run: cuBLASLt offers no algorithm for it (with an epilogue, the
/// caller can apply it apart), or anything else.
enum RunError {
    Unsupported,
    Failed(String),
}
use RunError::{Failed, Unsupported};

impl From<String> for RunError {
    fn from(e: String) -> RunError {
        Failed(e)
    }
}

/// Everything a product's plan depends on: all of [`Product`] but the addresses (of which only
/// the alignment counts) and alpha and beta (passed at each call).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Shape {
    m: u64,
    n: u64,
    k: u64,
    batch: u64,
    trans_a: bool,
    trans_b: bool,
    strides: [i64; 3],
    dtype: DType,
    d_dtype: DType,
    /// cuBLASLt's A, B, C and D alignments (our B, A, D and D).
    alignment: [u32; 3],
    /// With the bias and epilogue (false: plain, the caller applies them).
    epilogue: bool,
    bias: bool,
    kind: EpilogueKind,
    /// The bias's and the aux's alignments (0 where none): the heuristic reads them from the
    /// addresses it is shown, so a plan holds only for addresses aligned as well.
    epilogue_alignment: [u32; 2],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum EpilogueKind {
    Plain,
    Gelu,
    GeluKeepingInput,
    GeluGrad,
}

impl Shape {
    fn of(p: &Product, epilogue: bool) -> Shape {
        let size = p.dtype.size();
        let kind = match p.epilogue {
            Epilogue::Plain => EpilogueKind::Plain,
            Epilogue::Gelu { aux: 0 } => EpilogueKind::Gelu,
            Epilogue::Gelu { .. } => EpilogueKind::GeluKeepingInput,
            Epilogue::GeluGrad { .. } => EpilogueKind::GeluGrad,
        };
        Shape {
            m: p.m,
            n: p.n,
            k: p.k,
            batch: p.batch,
            trans_a: p.trans_a,
            trans_b: p.trans_b,
            strides: [p.a_stride, p.b_stride, p.d_stride],
            dtype: p.dtype,
            d_dtype: p.d_dtype,
            alignment: [
                alignment(p.b, p.b_stride, p.batch, size),
                alignment(p.a, p.a_stride, p.batch, size),
                alignment(p.d, p.d_stride, p.batch, p.d_dtype.size()),
            ],
            epilogue,
            bias: epilogue && p.bias != 0,
            kind: if epilogue { kind } else { EpilogueKind::Plain },
            epilogue_alignment: match (epilogue, p.epilogue) {
                (false, _) => [0, 0],
                (true, Epilogue::Plain) => [alignment(p.bias, 0, 1, size), 0],
                (true, Epilogue::Gelu { aux } | Epilogue::GeluGrad { aux }) => [
                    if p.bias == 0 { 0 } else { alignment(p.bias, 0, 1, size) },
                    if aux == 0 { 0 } else { alignment(aux, p.d_stride, p.batch, p.d_dtype.size()) },
                ],
            },
        }
    }
}

/// A column-major matrix layout of `rows` × `cols` with leading dimension `ld`, batched.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    fn new(dtype: DType, rows: u64, cols: u64, ld: i64, batch: u64, stride: i64) -> Result<Layout, String> {
        let data = match dtype {
            DType::F32 => sys::cudaDataType::CUDA_R_32F,
            DType::F16 => sys::cudaDataType::CUDA_R_16F,
            DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
            t => return Err(format!("cuBLASLt products of {t} are not supported")),
        };
        let l = Layout(lt::create_matrix_layout(data, rows, cols, ld).map_err(|e| err("layout", e))?);
        if batch > 1 {
            let count = batch as i32;
            // SAFETY: the layout was just created; the attribute buffers outlive the calls.
            unsafe {
                lt::set_matrix_layout_attribute(
                    l.0,
                    sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    &count as *const i32 as *const c_void,
                    4,
                )
                .map_err(|e| err("batch count", e))?;
                lt::set_matrix_layout_attribute(
                    l.0,
                    sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    &stride as *const i64 as *const c_void,
                    8,
                )
                .map_err(|e| err("batch stride", e))?;
            }
        }
        Ok(l)
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by create_matrix_layout and dropped once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.0);
        }
    }
}

struct Desc(sys::cublasLtMatmulDesc_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by create_matmul_desc and dropped once.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.0);
        }
    }
}

struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by create_matmul_pref and dropped once.
        unsafe {
            let _ = lt::destroy_matmul_pref(self.0);
        }
    }
}

/// Says, once per product shape (the plans are kept), that its bias or epilogue runs as kernels
/// after a plain product rather than in cuBLASLt's epilogue: issue 24's profile needs to know
/// which path the products of a run took.
fn epilogue_apart(p: &Product, why: &str) {
    tracing::info!(
        m = p.m,
        n = p.n,
        k = p.k,
        batch = p.batch,
        dtype = %p.dtype,
        epilogue = ?p.epilogue,
        bias = p.bias != 0,
        "cuBLASLt epilogue not used ({why}): bias and activation run as kernels after the product"
    );
}

/// A shape's descriptors and the algorithm cuBLASLt's heuristic chose for it, made at its first
/// product and kept: creating them and asking the heuristic cost more host time than the
/// launch, and a training step repeats the same few dozen shapes. Only the bias and aux
/// addresses are set again at each call.
struct Plan {
    first: Layout,
    second: Layout,
    out: Layout,
    desc: Desc,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Gemm {
    /// `workspace` is device memory of `workspace_bytes` that the backend owns.
    pub(super) fn new(workspace: u64, workspace_bytes: usize) -> Result<Gemm, String> {
        let handle = lt::create_handle().map_err(|e| err("create", e))?;
        Ok(Gemm { handle, workspace, workspace_bytes, plans: HashMap::new() })
    }

    /// Runs `p`; returns whether its bias and epilogue were applied (false when cuBLASLt has no
    /// algorithm for the epilogue with these layouts: the caller applies them).
    /// cuBLASLt's failures are the device's; a product it has no algorithm for is refused.
    pub(super) fn run(&mut self, p: &Product, stream: sys::cudaStream_t) -> Result<bool, BackendError> {
        if p.has_epilogue() {
            match self.run_with(p, true, stream) {
                Ok(()) => return Ok(true),
                Err(Failed(e)) => return Err(BackendError::Device(e)),
                Err(Unsupported) => {}
            }
        }
        self.run_with(p, false, stream).map(|()| false).map_err(|e| match e {
            Failed(e) => BackendError::Device(e),
            Unsupported => BackendError::Refused(format!("cuBLASLt has no algorithm for {p:?}")),
        })
    }

    fn run_with(&mut self, p: &Product, epilogue: bool, stream: sys::cudaStream_t) -> Result<(), RunError> {
        let shape = Shape::of(p, epilogue);
        if !self.plans.contains_key(&shape) {
            // A shape cuBLASLt has no algorithm for with its epilogue is remembered as such.
            let plan = match self.plan(p, &shape) {
                Ok(plan) => Some(plan),
                Err(Unsupported) => {
                    if epilogue {
                        epilogue_apart(p, "the heuristic offers no algorithm with it");
                    }
                    None
                }
                Err(e) => return Err(e),
            };
            self.plans.insert(shape, plan);
        }
        let Some(plan) = &self.plans[&shape] else { return Err(Unsupported) };
        // SAFETY: the plan's descriptors are live; the pointers are device memory of the sizes
        // the layouts describe (the caller's plan); alpha and beta outlive the call.
        let done = unsafe {
            if epilogue {
                set_epilogue_addresses(plan.desc.0, p)?;
            }
            lt::matmul(
                self.handle,
                plan.desc.0,
                &p.alpha as *const f32 as *const c_void,
                &p.beta as *const f32 as *const c_void,
                p.b as *const c_void,
                plan.first.0,
                p.a as *const c_void,
                plan.second.0,
                p.d as *const c_void,
                plan.out.0,
                p.d as *mut c_void,
                plan.out.0,
                &plan.algo,
                self.workspace as *mut c_void,
                self.workspace_bytes,
                stream,
            )
        };
        match done {
            Ok(()) => Ok(()),
            // An epilogue the heuristic offered and the product then refused: run it apart,
            // now and for the rest of the run.
            Err(e) if epilogue && e.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => {
                epilogue_apart(p, "the product refused the algorithm the heuristic offered");
                self.plans.insert(shape, None);
                Err(Unsupported)
            }
            Err(e) => Err(Failed(err("matmul", e))),
        }
    }

    /// The descriptors of `shape` and the heuristic's first algorithm for them.
    fn plan(&self, p: &Product, shape: &Shape) -> Result<Plan, RunError> {
        if p.d_dtype != p.dtype && (p.has_epilogue() || p.d_dtype != DType::F32) {
            let why =
                format!("a product of {} into {} (only f32 sums, without an epilogue): {p:?}", p.dtype, p.d_dtype);
            return Err(Failed(why));
        }
        // cuBLASLt's first operand is our B: as stored it reads (column-major) as Bᵀ [n, k] when
        // B is [k, n], or as B [k, n] when B is stored transposed ([n, k]), then transposed.
        let (b_rows, b_cols, b_ld) = if p.trans_b { (p.k, p.n, p.k as i64) } else { (p.n, p.k, p.n as i64) };
        let (a_rows, a_cols, a_ld) = if p.trans_a { (p.m, p.k, p.m as i64) } else { (p.k, p.m, p.k as i64) };
        let first = Layout::new(p.dtype, b_rows, b_cols, b_ld, p.batch, p.b_stride)?;
        let second = Layout::new(p.dtype, a_rows, a_cols, a_ld, p.batch, p.a_stride)?;
        let out = Layout::new(p.d_dtype, p.n, p.m, p.n as i64, p.batch, p.d_stride)?;
        let desc = Desc(
            lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
                .map_err(|e| err("descriptor", e))?,
        );
        let pref = Pref(lt::create_matmul_pref().map_err(|e| err("preference", e))?);
        let (op_first, op_second) = (p.trans_b as i32, p.trans_a as i32);
        let ws = self.workspace_bytes as u64;
        // SAFETY: descriptors created above; attribute buffers outlive the calls.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc.0,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &op_first as *const i32 as *const c_void,
                4,
            )
            .map_err(|e| err("transa", e))?;
            lt::set_matmul_desc_attribute(
                desc.0,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &op_second as *const i32 as *const c_void,
                4,
            )
            .map_err(|e| err("transb", e))?;
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            )
            .map_err(|e| err("workspace preference", e))?;
            // A product split over k adds its parts in f32 (the compute type), never in a half
            // D's type: the sums are rounded once, as the CPU backend's and the emulator's are
            // (PyTorch's allow_bf16_reduced_precision_reduction = False). Unsplit products are
            // allowed whatever the mask.
            let f32_parts = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                &f32_parts as *const u32 as *const c_void,
                4,
            )
            .map_err(|e| err("reduction preference", e))?;
            // cuBLASLt's operands A, B, C and D are our B, A, D and D.
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            let [first_align, second_align, out_align] = shape.alignment;
            let aligned = [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, first_align),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, second_align),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, out_align),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, out_align),
            ];
            for (attribute, bytes) in aligned {
                lt::set_matmul_pref_attribute(pref.0, attribute, &bytes as *const u32 as *const c_void, 4)
                    .map_err(|e| err("alignment preference", e))?;
            }
            if shape.epilogue {
                set_epilogue(desc.0, p)?;
                set_epilogue_addresses(desc.0, p)?;
            }
            let heuristic = lt::get_matmul_algo_heuristic(self.handle, desc.0, first.0, second.0, out.0, out.0, pref.0)
                .map_err(|e| match e.0 {
                    // No algorithm (cudarc says so for an empty answer too): with an epilogue the
                    // caller runs the product plain and the epilogue as kernels; a plain product
                    // is refused, the same on every try. Any other failure (memory, a bad
                    // attribute) is the device's, not remembered.
                    sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => Unsupported,
                    _ => Failed(err(&format!("no algorithm for {p:?}"), e)),
                })?;
            Ok(Plan { first, second, out, desc, algo: heuristic.algo })
        }
    }
}

/// The largest power of two up to 256 that divides an operand's byte address and, over a batch,
/// the byte stride between its matrices: what cuBLASLt may assume of it. Its MIN_ALIGNMENT
/// preferences default to 256, which the executor's values (64-byte aligned) and a convolution
/// group's operands (element offsets) need not be.
fn alignment(at: u64, stride: i64, batch: u64, size: usize) -> u32 {
    let mut bits = at | 256;
    if batch > 1 && stride != 0 {
        bits |= stride.unsigned_abs() * size as u64;
    }
    1 << bits.trailing_zeros()
}

/// Sets `p`'s epilogue on `desc`: its kind and the aux's layout (the addresses are
/// [`set_epilogue_addresses`]'s).
///
/// # Safety
/// `desc` is a live matmul descriptor.
unsafe fn set_epilogue(desc: sys::cublasLtMatmulDesc_t, p: &Product) -> Result<(), RunError> {
    use sys::cublasLtEpilogue_t as E;
    use sys::cublasLtMatmulDescAttributes_t as A;
    let bias = p.bias != 0;
    let (kind, aux) = match p.epilogue {
        Epilogue::Plain => (E::CUBLASLT_EPILOGUE_BIAS, 0),
        Epilogue::Gelu { aux: 0 } if bias => (E::CUBLASLT_EPILOGUE_GELU_BIAS, 0),
        Epilogue::Gelu { aux: 0 } => (E::CUBLASLT_EPILOGUE_GELU, 0),
        Epilogue::Gelu { aux } if bias => (E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS, aux),
        Epilogue::Gelu { aux } => (E::CUBLASLT_EPILOGUE_GELU_AUX, aux),
        Epilogue::GeluGrad { .. } if bias => return Err(Failed(format!("a GELU gradient with a bias: {p:?}"))),
        Epilogue::GeluGrad { aux } => (E::CUBLASLT_EPILOGUE_DGELU, aux),
    };
    // cuBLASLt wants the aux's leading dimension a multiple of 8 (ours is D's row, n).
    if aux != 0 && !p.n.is_multiple_of(8) {
        return Err(Unsupported);
    }
    // SAFETY: `desc` is live (the caller's promise); the values outlive the calls.
    unsafe {
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &kind, "epilogue")?;
        if aux != 0 {
            // The aux is D's type and layout: column-major n × m per batch, D's batch stride.
            let ld = p.n as i64;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, "aux leading dimension")?;
            if p.batch > 1 {
                set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &p.d_stride, "aux batch stride")?;
            }
        }
    }
    Ok(())
}

/// Points `desc`'s epilogue at `p`'s bias and aux, which differ from call to call of one plan.
/// The bias is D's type (BIAS_DATA_TYPE's default) and shared by the batch (BIAS_BATCH_STRIDE's
/// default, 0).
///
/// # Safety
/// `desc` is a live matmul descriptor.
unsafe fn set_epilogue_addresses(desc: sys::cublasLtMatmulDesc_t, p: &Product) -> Result<(), RunError> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    // SAFETY: `desc` is live (the caller's promise); the values outlive the calls.
    unsafe {
        if p.bias != 0 {
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, "bias pointer")?;
        }
        if let Epilogue::Gelu { aux } | Epilogue::GeluGrad { aux } = p.epilogue {
            if aux != 0 {
                set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, "aux pointer")?;
            }
        }
    }
    Ok(())
}

/// Sets one attribute of `desc` to `value`.
///
/// # Safety
/// `desc` is a live matmul descriptor and `T` the attribute's type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
    what: &str,
) -> Result<(), RunError> {
    // SAFETY: `value` points at size_of::<T>() bytes that outlive the call.
    unsafe { lt::set_matmul_desc_attribute(desc, attr, value as *const T as *const c_void, std::mem::size_of::<T>()) }
        .map_err(|e| Failed(err(what, e)))
}

impl Drop for Gemm {
    fn drop(&mut self) {
        // SAFETY: created in new, destroyed once.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
