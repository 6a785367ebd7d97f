//! Which device a rank trains on: `device: auto` takes a GPU when the machine has one the
//! CUDA backend can use (GPU = local rank modulo the GPUs visible), else the CPU; `device:
//! cuda` insists, and says what is missing when it cannot.

use crate::config::DeviceKind;
use crate::error::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda { ordinal: usize },
}

pub fn resolve(kind: DeviceKind, local_rank: usize) -> Result<Device> {
    if kind == DeviceKind::Cpu {
        return Ok(Device::Cpu);
    }
    match (gpus(), kind) {
        (Ok(count), _) => Ok(Device::Cuda { ordinal: local_rank % count }),
        (Err(why), DeviceKind::Cuda) => {
            Err(Error::Config(format!("device: cuda was asked for, but {why}; use device: cpu or auto")))
        }
        (Err(why), _) => {
            tracing::info!(reason = %why, "device: auto trains on the CPU");
            Ok(Device::Cpu)
        }
    }
}

#[cfg(feature = "cuda")]
fn gpus() -> std::result::Result<usize, String> {
    crate::backend::cuda::probe::gpu_count().map_err(|u| u.0)
}

#[cfg(not(feature = "cuda"))]
fn gpus() -> std::result::Result<usize, String> {
    Err("this worker was built without the cuda feature".into())
}
