//! NCCL, the GPUs' own collectives, loaded at run time like every CUDA library.
//!
//! The few entry points the backend calls are bound here by hand rather than through cudarc's
//! NCCL module: that one looks for `libnccl.so` (the development symlink) or a CUDA-versioned
//! name, while NCCL installs itself as `libnccl.so.2` (its ABI version) in CUDA images and in
//! PyTorch's wheels alike. The signatures and enum values are those of `nccl.h` (NCCL 2.x,
//! whose ABI has not changed within the major version).
//!
//! A communicator spans one group of ranks. Its members agree on a 128-byte unique id that
//! group rank 0 draws ([`unique_id`]) and the group's host collective (MPI) broadcasts; then
//! every member calls [`Comm::init`] with it, on the GPU it trains on.

use crate::backend::BackendError;
use crate::comm::{Collective, HostGroup, ProcessGroup, ReduceOp};
use crate::tensor::DType;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// The names NCCL is looked for under: the ABI-versioned one first.
const LIBRARY: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// `ncclUniqueId`: opaque bytes, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub bytes: [u8; 128],
}

type Result_ = c_int; // ncclResult_t: 0 is ncclSuccess
type RawComm = *mut c_void; // ncclComm_t
type Stream = *mut c_void; // cudaStream_t, the driver's CUstream

/// The entry points, resolved once.
struct Api {
    _lib: libloading::Library,
    get_version: unsafe extern "C" fn(*mut c_int) -> Result_,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Result_,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> Result_,
    comm_destroy: unsafe extern "C" fn(RawComm) -> Result_,
    comm_abort: unsafe extern "C" fn(RawComm) -> Result_,
    comm_get_async_error: unsafe extern "C" fn(RawComm, *mut Result_) -> Result_,
    get_error_string: unsafe extern "C" fn(Result_) -> *const c_char,
    get_last_error: unsafe extern "C" fn(RawComm) -> *const c_char,
    group_start: unsafe extern "C" fn() -> Result_,
    group_end: unsafe extern "C" fn() -> Result_,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, Stream) -> Result_,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, Stream) -> Result_,
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, Stream) -> Result_,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, Stream) -> Result_,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, Stream) -> Result_,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, Stream) -> Result_,
}

fn load() -> Result<Api, String> {
    let mut tried = Vec::new();
    for name in LIBRARY {
        // SAFETY: loading NCCL runs no code of ours; its initialisers only set up its own state.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return bind(lib).map_err(|e| format!("{name} lacks an NCCL entry point: {e}")),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "NCCL could not be loaded ({}): install NCCL 2 (libnccl2) or put its directory on LD_LIBRARY_PATH",
        tried.join("; ")
    ))
}

fn bind(lib: libloading::Library) -> Result<Api, libloading::Error> {
    // SAFETY: each symbol is declared with nccl.h's signature for it.
    unsafe {
        Ok(Api {
            get_version: *lib.get(b"ncclGetVersion\0")?,
            get_unique_id: *lib.get(b"ncclGetUniqueId\0")?,
            comm_init_rank: *lib.get(b"ncclCommInitRank\0")?,
            comm_destroy: *lib.get(b"ncclCommDestroy\0")?,
            comm_abort: *lib.get(b"ncclCommAbort\0")?,
            comm_get_async_error: *lib.get(b"ncclCommGetAsyncError\0")?,
            get_error_string: *lib.get(b"ncclGetErrorString\0")?,
            get_last_error: *lib.get(b"ncclGetLastError\0")?,
            group_start: *lib.get(b"ncclGroupStart\0")?,
            group_end: *lib.get(b"ncclGroupEnd\0")?,
            all_reduce: *lib.get(b"ncclAllReduce\0")?,
            broadcast: *lib.get(b"ncclBroadcast\0")?,
            reduce_scatter: *lib.get(b"ncclReduceScatter\0")?,
            all_gather: *lib.get(b"ncclAllGather\0")?,
            send: *lib.get(b"ncclSend\0")?,
            recv: *lib.get(b"ncclRecv\0")?,
            _lib: lib,
        })
    }
}

fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// Whether NCCL loads on this machine.
pub fn present() -> bool {
    api().is_ok()
}

/// NCCL's version as "major.minor.patch" (its code is major·10000 + minor·100 + patch since 2.9).
pub fn version() -> Result<String, String> {
    let api = api()?;
    let mut code: c_int = 0;
    // SAFETY: writes one int.
    check(api, unsafe { (api.get_version)(&mut code) }, None, "ncclGetVersion")?;
    Ok(format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100))
}

/// A fresh unique id, drawn by the group's rank 0. It needs no GPU: it names rank 0's
/// bootstrap socket, which the members connect to in [`Comm::init`].
pub fn unique_id() -> Result<UniqueId, String> {
    let api = api()?;
    let mut id = UniqueId { bytes: [0; 128] };
    // SAFETY: writes the 128 bytes of `id`.
    check(api, unsafe { (api.get_unique_id)(&mut id) }, None, "ncclGetUniqueId")?;
    Ok(id)
}

/// The unique id of a communicator over `group`, the same on every member (collective over the
/// group's host collectives); None, on every member alike, where NCCL does not load on all of
/// them: some would otherwise wait in NCCL and the others in MPI.
pub fn shared_id(group: &HostGroup) -> Result<Option<UniqueId>, String> {
    let here = present();
    let mut everywhere = [f64::from(here as u8)];
    group.all_reduce(&mut everywhere[..], ReduceOp::Sum).map_err(|e| e.to_string())?;
    if everywhere[0] < group.size() as f64 {
        tracing::warn!(
            "NCCL does not load on every rank of group '{}' ({}here): its collectives go through host memory and \
             MPI",
            group.name(),
            if here { "it does " } else { "not " }
        );
        return Ok(None);
    }
    // Rank 0 draws the id and sends it with whether that worked, so that a failure there does
    // not leave the others waiting. The bytes travel as f64 bit patterns, which a broadcast
    // copies unchanged.
    let mut message = [0f64; 1 + 128 / 8];
    if group.rank() == 0 {
        match unique_id() {
            Ok(id) => {
                message[0] = 1.0;
                bytemuck::cast_slice_mut::<f64, u8>(&mut message[1..]).copy_from_slice(&id.bytes);
            }
            Err(e) => tracing::error!("group rank 0 could not draw an NCCL unique id: {e}"),
        }
    }
    group.broadcast(&mut message[..], 0).map_err(|e| e.to_string())?;
    if message[0] != 1.0 {
        return Err(format!("group rank 0 of '{}' could not draw an NCCL unique id (its log says why)", group.name()));
    }
    let mut id = UniqueId { bytes: [0; 128] };
    id.bytes.copy_from_slice(bytemuck::cast_slice(&message[1..]));
    Ok(Some(id))
}

/// NCCL's error string for `code`, with the communicator's last message when there is one.
fn check(api: &Api, code: Result_, comm: Option<RawComm>, call: &str) -> Result<(), String> {
    if code == 0 {
        return Ok(());
    }
    let text = |p: *const c_char| {
        // SAFETY: NCCL returns NUL-terminated static or per-thread strings (or null).
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()).filter(|s| !s.is_empty())
    };
    // SAFETY: both take any value / communicator (null asks for the thread's last error).
    let what = text(unsafe { (api.get_error_string)(code) }).unwrap_or_else(|| format!("error {code}"));
    let last = text(unsafe { (api.get_last_error)(comm.unwrap_or(std::ptr::null_mut())) });
    Err(match last {
        Some(last) => format!("{call}: {what} ({last})"),
        None => format!("{call}: {what}"),
    })
}

/// NCCL's type for `dtype`; another type is the graph's to change (a refusal, not the device's
/// failure).
fn data_type(dtype: DType) -> Result<c_int, BackendError> {
    // ncclDataType_t
    Ok(match dtype {
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
        other => return Err(BackendError::Refused(format!("NCCL collectives here carry floats, not {other:?}"))),
    })
}

fn reduce_op(op: ReduceOp) -> c_int {
    // ncclRedOp_t
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
        ReduceOp::Average => 4,
    }
}

/// A buffer on the device for a collective: its address, element count and type.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    pub ptr: u64,
    pub count: usize,
    pub dtype: DType,
}

/// One communicator: this rank's membership of a group, on the GPU its context is bound to.
/// Collectives are enqueued on the stream given to each call and return at once.
pub struct Comm {
    raw: RawComm,
    api: &'static Api,
    /// Whether a call failed: the communicator is then aborted, not destroyed (destroying
    /// waits for peers that may never come).
    failed: AtomicBool,
    /// Whether it has been aborted already (`abort`): dropping it then releases nothing.
    aborted: AtomicBool,
    /// The group's size.
    members: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; the backend
// serialises its calls by issuing them from the training thread only.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// Joins the communicator `id` names as `rank` of `size`; blocks until every member has.
    /// The caller's CUDA context must be current: NCCL binds the communicator to its device.
    pub fn init(size: usize, rank: usize, id: &UniqueId) -> Result<Comm, String> {
        let api = api()?;
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: writes the new communicator's handle; `id` is passed by value as nccl.h says.
        check(
            api,
            unsafe { (api.comm_init_rank)(&mut raw, size as c_int, *id, rank as c_int) },
            None,
            "ncclCommInitRank",
        )?;
        Ok(Comm { raw, api, failed: AtomicBool::new(false), aborted: AtomicBool::new(false), members: size })
    }

    fn call(&self, code: Result_, what: &str) -> Result<(), BackendError> {
        let r = check(self.api, code, Some(self.raw), what);
        if r.is_err() {
            self.failed.store(true, Ordering::Relaxed);
        }
        r.map_err(BackendError::Device)
    }

    /// An error NCCL met while running this communicator's enqueued work (a peer's connection
    /// lost, say), which no call returns: None while there is none.
    pub fn async_error(&self) -> Option<String> {
        if self.aborted.load(Ordering::Acquire) {
            return Some("the NCCL communicator was aborted".into());
        }
        let mut code: Result_ = 0;
        // SAFETY: writes one ncclResult_t; the communicator is live.
        let r = unsafe { (self.api.comm_get_async_error)(self.raw, &mut code) };
        // 7 is ncclInProgress: a non-blocking communicator still initialising, not an error.
        let code = if r != 0 { r } else { code };
        (code != 0 && code != 7).then(|| check(self.api, code, Some(self.raw), "NCCL").unwrap_err())
    }

    /// Refuses work on an aborted communicator (its handle is gone).
    fn live(&self) -> Result<(), BackendError> {
        match self.aborted.load(Ordering::Acquire) {
            false => Ok(()),
            true => Err(BackendError::Device(
                "the NCCL communicator was aborted (a wait outlasted parallelism.timeoutSeconds, or NCCL reported an \
                 error)"
                    .into(),
            )),
        }
    }

    /// Aborts the communicator: its enqueued work ends, whatever its peers do, so that a rank
    /// whose peer hangs can stop. Once only; the communicator is unusable after.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            // SAFETY: the handle is live, and aborted once (Drop then releases nothing).
            unsafe { (self.api.comm_abort)(self.raw) };
        }
    }

    /// Runs `f`'s collectives as one NCCL group: they are launched together (one kernel for
    /// many small all-reduces rather than a launch and a synchronisation each).
    pub fn grouped(&self, f: impl FnOnce() -> Result<(), BackendError>) -> Result<(), BackendError> {
        self.live()?;
        // SAFETY: group calls nest and take no arguments.
        self.call(unsafe { (self.api.group_start)() }, "ncclGroupStart")?;
        let inner = f();
        let end = self.call(unsafe { (self.api.group_end)() }, "ncclGroupEnd");
        inner.and(end)
    }

    /// Every member's `x` becomes the reduction of all members' `x`, in place.
    ///
    /// # Safety
    /// `x` must be device memory of this communicator's GPU holding `count` values, and
    /// `stream` a stream of its context; `x` must stay allocated until the stream has run it.
    pub unsafe fn all_reduce(&self, x: Region, op: ReduceOp, stream: Stream) -> Result<(), BackendError> {
        self.live()?;
        let p = x.ptr as *mut c_void;
        // SAFETY: as the caller promises; NCCL allows the same buffer as source and result.
        let code =
            unsafe { (self.api.all_reduce)(p, p, x.count, data_type(x.dtype)?, reduce_op(op), self.raw, stream) };
        self.call(code, "ncclAllReduce")
    }

    /// Every member's `x` becomes group rank `root`'s, in place.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce`].
    pub unsafe fn broadcast(&self, x: Region, root: usize, stream: Stream) -> Result<(), BackendError> {
        self.live()?;
        let p = x.ptr as *mut c_void;
        // SAFETY: as the caller promises.
        let code = unsafe { (self.api.broadcast)(p, p, x.count, data_type(x.dtype)?, root as c_int, self.raw, stream) };
        self.call(code, "ncclBroadcast")
    }

    /// Every member's `recv` becomes its part of the reduction of all members' `send`, which
    /// holds `recv.count` values per member, in member order.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce`], for both regions.
    pub unsafe fn reduce_scatter(
        &self,
        send: Region,
        recv: Region,
        op: ReduceOp,
        stream: Stream,
    ) -> Result<(), BackendError> {
        self.live()?;
        same_type(send, recv, recv.count * self.members)?;
        let (s, r) = (send.ptr as *const c_void, recv.ptr as *mut c_void);
        // SAFETY: as the caller promises.
        let code = unsafe {
            (self.api.reduce_scatter)(s, r, recv.count, data_type(recv.dtype)?, reduce_op(op), self.raw, stream)
        };
        self.call(code, "ncclReduceScatter")
    }

    /// Every member's `recv` becomes all members' `send`, end to end in member order (in place
    /// when `send` is this member's part of `recv`).
    ///
    /// # Safety
    /// As for [`Comm::all_reduce`], for both regions.
    pub unsafe fn all_gather(&self, send: Region, recv: Region, stream: Stream) -> Result<(), BackendError> {
        self.live()?;
        same_type(recv, send, send.count * self.members)?;
        let (s, r) = (send.ptr as *const c_void, recv.ptr as *mut c_void);
        // SAFETY: as the caller promises.
        let code = unsafe { (self.api.all_gather)(s, r, send.count, data_type(send.dtype)?, self.raw, stream) };
        self.call(code, "ncclAllGather")
    }

    /// Sends `x` to group rank `peer` (which receives it with [`Comm::recv`]).
    ///
    /// # Safety
    /// As for [`Comm::all_reduce`].
    pub unsafe fn send(&self, x: Region, peer: usize, stream: Stream) -> Result<(), BackendError> {
        self.live()?;
        // SAFETY: as the caller promises.
        let code = unsafe {
            (self.api.send)(x.ptr as *const c_void, x.count, data_type(x.dtype)?, peer as c_int, self.raw, stream)
        };
        self.call(code, "ncclSend")
    }

    /// Receives into `x` what group rank `peer` sends.
    ///
    /// # Safety
    /// As for [`Comm::all_reduce`].
    pub unsafe fn recv(&self, x: Region, peer: usize, stream: Stream) -> Result<(), BackendError> {
        self.live()?;
        // SAFETY: as the caller promises.
        let code = unsafe {
            (self.api.recv)(x.ptr as *mut c_void, x.count, data_type(x.dtype)?, peer as c_int, self.raw, stream)
        };
        self.call(code, "ncclRecv")
    }
}

/// Checks that `whole` holds `count` values of `part`'s type.
fn same_type(whole: Region, part: Region, count: usize) -> Result<(), BackendError> {
    if whole.dtype != part.dtype || whole.count != count {
        return Err(BackendError::Refused(format!(
            "{} values of {:?} against {count} of {:?}",
            whole.count, whole.dtype, part.dtype
        )));
    }
    Ok(())
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.failed.load(Ordering::Relaxed) {
            return self.abort();
        }
        if !self.aborted.load(Ordering::Acquire) {
            // SAFETY: the handle came from ncclCommInitRank and is released once.
            unsafe { (self.api.comm_destroy)(self.raw) };
        }
    }
}
