//! The worker's one error type. Its variants map to the exit codes of the command-line contract
//! (DESIGN.md): 2 bad configuration or input, or a model that uses operators the engine does
//! not run; 3 unreadable or corrupt data/model/checkpoint; 4 the training diverged; 1 anything
//! else. Every message names the file, field, node or rank it is about.

#[cfg(feature = "engine")]
use crate::backend::BackendError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration key or value, a command-line argument, or a missing input file.
    #[error("{0}")]
    Config(String),
    /// A model, data shard or checkpoint that cannot be read, or a value in it we do not support.
    #[error("{0}")]
    Corrupt(String),
    /// A valid model the engine refuses: operators (or operator domains) it does not run. Like a
    /// bad configuration, retrying will not help; the message lists every such operator at once.
    #[error("{0}")]
    Unsupported(String),
    /// The loss is not finite (outside fp16's skipped steps): resuming from the newest checkpoint
    /// on the same data would diverge again, so it is not worth retrying as it is.
    #[error("{0}")]
    Diverged(String),
    /// Anything else: I/O failures, resource exhaustion. Worth retrying.
    #[error("{0}")]
    Runtime(String),
}

impl Error {
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Config(_) | Error::Unsupported(_) => 2,
            Error::Corrupt(_) => 3,
            Error::Diverged(_) => 4,
            Error::Runtime(_) => 1,
        }
    }
}

/// A backend's failure, by kind: bad data is corrupt input; a kernel's refusal, like an
/// operator the engine does not run, is unsupported; running out of device memory while the
/// plan fits, a driver's or a collective's failure may pass on a retry.
#[cfg(feature = "engine")]
impl From<BackendError> for Error {
    fn from(e: BackendError) -> Error {
        match e {
            BackendError::BadData(_) => Error::Corrupt(e.to_string()),
            BackendError::Refused(_) => Error::Unsupported(e.to_string()),
            BackendError::OutOfMemory { .. } | BackendError::Device(_) => Error::Runtime(e.to_string()),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `Error::Config` from a format string.
#[macro_export]
macro_rules! config_err {
    ($($arg:tt)*) => { $crate::error::Error::Config(format!($($arg)*)) };
}

/// `Error::Corrupt` from a format string.
#[macro_export]
macro_rules! corrupt_err {
    ($($arg:tt)*) => { $crate::error::Error::Corrupt(format!($($arg)*)) };
}

#[cfg(all(test, feature = "engine"))]
mod tests {
    use super::*;

    /// Each kind of backend failure reaches the exit code the operator acts on, its message
    /// led by where it happened.
    #[test]
    fn backend_failures_map_to_their_exit_codes() {
        let oom = BackendError::OutOfMemory { place: "cuda:0".into(), bytes: 1 << 30, free: Some(1 << 20) };
        let cases = [
            (BackendError::BadData("label 7 is out of range for 3 classes".into()), 3),
            (BackendError::Refused("Gemm takes 2-D operands".into()), 2),
            (oom, 1),
            (BackendError::Device("CUDA synchronize: CUDA_ERROR_LAUNCH_FAILED".into()), 1),
        ];
        for (e, code) in cases {
            let e = Error::from(e.at("SoftmaxCrossEntropyLoss 'loss'"));
            assert_eq!(e.exit_code(), code, "{e}");
            assert!(e.to_string().starts_with("SoftmaxCrossEntropyLoss 'loss'"), "{e}");
        }
        let oom = BackendError::OutOfMemory { place: "cuda:0".into(), bytes: 1024, free: Some(512) };
        assert_eq!(oom.to_string(), "cuda:0: cannot allocate 1024 bytes (512 free)");
    }
}
