//! What this machine offers the CUDA backend, found without ever letting cudarc panic: its
//! dynamically loaded entry points panic when a library is missing, so every library is
//! looked for (dlopen) before the first call into it.

use cudarc::driver::result as driver;

/// The libraries the backend loads, by the name a person would look for.
const DRIVER: &str = "the NVIDIA driver's libcuda.so.1";
const NVRTC: &str = "NVRTC (libnvrtc.so.13, CUDA's run-time compiler)";
const CUBLASLT: &str = "cuBLASLt (libcublasLt.so.13)";

/// Why no GPU can be used here, phrased for `device: cuda`'s error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unavailable(pub String);

/// How many GPUs the driver sees, once every library the backend needs loads. Err names the
/// first thing missing.
pub fn gpu_count() -> Result<usize, Unavailable> {
    if !driver_present() {
        return Err(Unavailable(format!("{DRIVER} could not be loaded (no NVIDIA driver on this machine?)")));
    }
    driver::init().map_err(|e| Unavailable(format!("the CUDA driver did not initialise: {e:?}")))?;
    let count =
        driver::device::get_count().map_err(|e| Unavailable(format!("the CUDA driver lists no GPUs: {e:?}")))?;
    if count <= 0 {
        return Err(Unavailable("the CUDA driver loads but sees no GPU (check CUDA_VISIBLE_DEVICES)".into()));
    }
    libraries()?;
    Ok(count as usize)
}

/// NVRTC and cuBLASLt, which the backend needs besides the driver: they come with the CUDA
/// runtime libraries (the worker image's base), not with the driver.
pub fn libraries() -> Result<(), Unavailable> {
    let missing = |what: &str| {
        Unavailable(format!(
            "{what} could not be loaded: install the CUDA 13 runtime libraries or put their directory on \
             LD_LIBRARY_PATH"
        ))
    };
    // SAFETY: as above, a dlopen of candidate names and nothing else.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(missing(NVRTC));
    }
    if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        return Err(missing(CUBLASLT));
    }
    Ok(())
}

/// The driver's library (libcuda) loads: the machine has an NVIDIA driver, with or without a
/// GPU the process may use.
pub fn driver_present() -> bool {
    // SAFETY: a dlopen of candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Only NVRTC, for compiling the kernels where there is no GPU (the kernels' own tests).
pub fn nvrtc_present() -> bool {
    // SAFETY: a dlopen of candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}
