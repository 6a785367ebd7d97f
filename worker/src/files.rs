//! Where a path from the user meets the file system, which may hold anything there. Inputs are
//! read only from regular files: a FIFO blocks its reader until some writer comes, a device
//! never ends. Outputs are written to a new file beside the target and renamed over it, only
//! where the target is a regular file or nothing: the rename would otherwise put a regular file
//! in place of a device node or a FIFO. One run at a time owns an output directory
//! ([`OutputLock`]).

use crate::error::{Error, Result};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

/// What a file that is not a regular one is, in words.
fn kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    match () {
        _ if t.is_dir() => "a directory",
        _ if t.is_fifo() => "a FIFO",
        _ if t.is_char_device() => "a character device",
        _ if t.is_block_device() => "a block device",
        _ if t.is_socket() => "a socket",
        _ if t.is_symlink() => "a symbolic link",
        _ => "not a regular file",
    }
}

/// Opens an input for reading if it is a regular file (symbolic links followed). The open does
/// not wait for a FIFO's writer (O_NONBLOCK); anything but a regular file is an error of kind
/// `InvalidInput` saying what the path is, which the readers report as a bad input (exit 2).
pub fn open_input(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let t = file.metadata()?.file_type();
    if !t.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("it is {}; inputs are read only from regular files", kind(t)),
        ));
    }
    Ok(file)
}

/// The whole of an input, read as [`open_input`] opens it.
pub fn read_input(path: &Path) -> io::Result<Vec<u8>> {
    let mut file = open_input(path)?;
    let mut bytes = Vec::with_capacity(file.metadata()?.len() as usize);
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// A failed file operation on `path`, as [`io_failure`] tells its kind.
pub fn io_error(path: &Path, e: io::Error) -> Error {
    io_failure(&e, format!("{}: {e}", path.display()))
}

/// `message`, about the failed file operation `e`: a missing or forbidden path, or one that is not
/// a regular file, is the user's to fix (exit 2); other failures may pass on a retry (exit 1).
pub fn io_failure(e: &io::Error, message: String) -> Error {
    use io::ErrorKind::*;
    match e.kind() {
        NotFound | PermissionDenied | IsADirectory | NotADirectory | InvalidInput | ReadOnlyFilesystem => {
            Error::Config(message)
        }
        _ => Error::Runtime(message),
    }
}

/// Whether `path` may be replaced by an output: it is a regular file (not followed through a
/// symbolic link, which the rename would replace) or nothing.
fn check_replaceable(path: &Path) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => Err(Error::Config(format!(
            "{}: it is {}; an output replaces only a regular file (or goes to a new path): name a file",
            path.display(),
            kind(m.file_type())
        ))),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error(path, e)),
    }
}

/// An output being written: a new file beside `target` (`.<name>.<pid>.tmp`, so that two
/// processes writing one target never share it), renamed over the target by [`NewFile::commit`]
/// once whole, so that a reader never sees half of it. Dropped without a commit (an error on the
/// way), the new file is removed.
pub struct NewFile {
    target: PathBuf,
    tmp: PathBuf,
    file: File,
    committed: bool,
}

impl NewFile {
    /// Starts replacing `target`, which must be a regular file or nothing; its directory is made
    /// if missing.
    pub fn create(target: &Path) -> Result<NewFile> {
        check_replaceable(target)?;
        if let Some(dir) = target.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
        }
        let mut name = std::ffi::OsString::from(".");
        name.push(target.file_name().unwrap_or_default());
        name.push(format!(".{}.tmp", std::process::id()));
        let tmp = target.with_file_name(name);
        let open = || OpenOptions::new().write(true).create_new(true).open(&tmp);
        let file = match open() {
            // A crashed process of the same id left it (a FIFO or a link there stays refused).
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && check_replaceable(&tmp).is_ok() => {
                std::fs::remove_file(&tmp).map_err(|e| io_error(&tmp, e))?;
                open()
            }
            opened => opened,
        }
        .map_err(|e| io_error(&tmp, e))?;
        Ok(NewFile { target: target.to_path_buf(), tmp, file, committed: false })
    }

    /// Flushes the new file to the disk and renames it over the target (checked again: it may
    /// have changed while the file was written).
    pub fn commit(mut self) -> Result<()> {
        self.file.sync_all().map_err(|e| io_error(&self.tmp, e))?;
        check_replaceable(&self.target)?;
        std::fs::rename(&self.tmp, &self.target).map_err(|e| io_error(&self.target, e))?;
        self.committed = true;
        Ok(())
    }
}

impl Write for NewFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl Drop for NewFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `bytes` as the whole of `target` through a [`NewFile`].
pub fn write_atomically(target: &Path, bytes: &[u8]) -> Result<()> {
    let mut new = NewFile::create(target)?;
    new.write_all(bytes).map_err(|e| io_error(target, e))?;
    new.commit()
}

/// This machine's host name ("localhost" where the kernel has none).
pub fn hostname() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    if host.is_empty() {
        "localhost".to_string()
    } else {
        host
    }
}

/// One run at a time writes an output directory: two runs mixed one's manifest with the other's
/// rank files, tore each other's `metrics.jsonl` lines, and a later start resumed the other
/// run. The lock is an exclusive `flock` on `<dir>/.lock`, which names its holder (process id
/// and host); the kernel releases it when the holder ends, however it ends, so a crash leaves
/// nothing to clean up. Held until dropped.
pub struct OutputLock {
    _file: File,
}

impl OutputLock {
    /// Takes the lock of `dir` (made if missing), the directory of the configuration's `key`;
    /// another run holding it is a configuration error (exit 2) naming the directory and holder.
    pub fn acquire(dir: &Path, key: &str) -> Result<OutputLock> {
        std::fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
        let path = dir.join(".lock");
        check_replaceable(&path)?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io_error(&path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                file.read_to_string(&mut holder).ok();
                let holder = match holder.trim() {
                    "" => "a process that has not written its name yet".to_string(),
                    named => named.to_string(),
                };
                return Err(Error::Config(format!(
                    "{key} {}: another run is writing there ({holder}, per {}); stop it, or give this run \
                     another {key}",
                    dir.display(),
                    path.display()
                )));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io_error(&path, e)),
        }
        let holder = format!("pid {} host {}\n", std::process::id(), hostname());
        file.set_len(0).and_then(|()| file.write_all(holder.as_bytes())).map_err(|e| io_error(&path, e))?;
        Ok(OutputLock { _file: file })
    }
}
