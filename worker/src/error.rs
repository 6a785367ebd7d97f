//! The worker's one error type. Its variants map to the exit codes of the command-line contract
//! (DESIGN.md): 2 bad configuration or input, or a model that uses operators the engine does
//! not run; 3 unreadable or corrupt data/model/checkpoint; 4 the training diverged; 1 anything
//! else. Every message names the file, field, node or rank it is about.

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
