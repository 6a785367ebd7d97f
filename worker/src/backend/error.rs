//! What a backend's work can fail with, sorted by what the run should do about it: the data is
//! bad (exit 3), the graph asks what a kernel will not do (exit 2), the device is out of memory
//! or failed (exit 1, worth a retry on a restarted pod). `crate::error` maps each to its exit
//! code; the backend only says which it is.

use std::fmt;

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

/// A kernel's own refusal, written as a message: `?` on it makes a [`BackendError::Refused`].
impl From<String> for BackendError {
    fn from(why: String) -> BackendError {
        BackendError::Refused(why)
    }
}

impl From<&str> for BackendError {
    fn from(why: &str) -> BackendError {
        BackendError::Refused(why.to_string())
    }
}

/// `Err(BackendError::Refused(..))` from a format string.
#[macro_export]
macro_rules! refused {
    ($($arg:tt)*) => { Err($crate::backend::BackendError::Refused(format!($($arg)*))) };
}
