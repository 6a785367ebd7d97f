//! The worker's error types, below every other module. `Error`'s variants map to the exit codes
//! of the command-line contract (DESIGN.md): 2 bad configuration or input, or a model that uses
//! operators the engine does not run; 3 unreadable or corrupt data/model/checkpoint; 4 the
//! training diverged; 1 anything else. `BackendError` is what kernels, devices and collectives
//! fail with, mapped onto `Error` here. Every message names the file, field, node or rank it is
//! about.

use std::fmt;

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
impl From<BackendError> for Error {
    fn from(e: BackendError) -> Error {
        match e {
            BackendError::BadData(_) => Error::Corrupt(e.to_string()),
            BackendError::Refused(_) => Error::Unsupported(e.to_string()),
            BackendError::OutOfMemory { .. } | BackendError::Device(_) => Error::Runtime(e.to_string()),
        }
    }
}

/// What a backend's work (a kernel, the device, a collective) can fail with, sorted by what the
/// run should do about it: the data is bad (exit 3), the graph asks what a kernel will not do
/// (exit 2), the device is out of memory or failed (exit 1, worth a retry on a restarted pod).
/// `From<BackendError> for Error` maps each to its exit code; the backend only says which it is.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// An index a kernel read (a token id past the vocabulary, a class label past the classes)
    /// lies outside what it indexes: the input data is bad, and a retry reads it again.
    #[error("{0}")]
    BadData(String),
    /// A kernel will not run on these operands (their types, shapes or attributes): the same on
    /// every try, as for an operator the engine does not run.
    #[error("{0}")]
    Refused(String),
    /// The device has not the memory asked for (the machine's, for the CPU).
    #[error("{place}: cannot allocate {bytes} bytes{}", free.map_or(String::new(), |f| format!(" ({f} free)")))]
    OutOfMemory { place: String, bytes: usize, free: Option<usize> },
    /// The driver, a kernel's launch, a library or a collective failed, or a peer stopped: may
    /// pass on a retry (a restarted pod, another node).
    #[error("{0}")]
    Device(String),
}

impl BackendError {
    /// A kernel's refusal from its message: what a helper's own check says (`map_err`, `ok_or_else`).
    pub fn refused(why: impl Into<String>) -> BackendError {
        BackendError::Refused(why.into())
    }

    /// The same failure, its message led by `place` (the node or value it happened at).
    pub fn at(self, place: impl fmt::Display) -> BackendError {
        match self {
            BackendError::BadData(m) => BackendError::BadData(format!("{place}: {m}")),
            BackendError::Refused(m) => BackendError::Refused(format!("{place}: {m}")),
            BackendError::Device(m) => BackendError::Device(format!("{place}: {m}")),
            BackendError::OutOfMemory { place: on, bytes, free } => {
                BackendError::OutOfMemory { place: format!("{place} on {on}"), bytes, free }
            }
        }
    }
}

/// `Err(BackendError::Refused(..))` from a format string.
#[macro_export]
macro_rules! refused {
    ($($arg:tt)*) => { Err($crate::error::BackendError::Refused(format!($($arg)*))) };
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

#[cfg(test)]
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
