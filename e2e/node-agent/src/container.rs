//! The container shim: `tensorfleet-node-agent container SPEC.json`, one process per running
//! container. It joins the pod's network namespace, takes a mount, UTS and PID namespace of its
//! own, and forks the container's first process, which mounts the pod's volumes and the image's
//! programs over the host's filesystem, sets the pod's hostname and execs the command.
//!
//! Why a separate process: the agent is a multi-threaded async program, and namespaces and mounts
//! are set up between fork and exec, where only a single-threaded process is safe. Why a PID
//! namespace: when the container's first process exits, the kernel kills everything left in the
//! namespace (sshd's sessions, the MPI ranks they started), as a container runtime does.

use anyhow::{bail, Context, Result};
use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::prctl;
use nix::sys::signal::{self, SigHandler, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{chdir, execve, fork, sethostname, ForkResult, Pid};
use serde::{Deserialize, Serialize};
use std::ffi::CString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};

/// What the agent hands the shim: everything about one container start, resolved already.
#[derive(Debug, Serialize, Deserialize)]
pub struct Spec {
    /// The pod's network namespace (`/run/netns/<name>`).
    pub netns: PathBuf,
    pub hostname: String,
    /// Bind mounts in order: the image's programs, /etc/hosts, the pod's volumes.
    pub mounts: Vec<Mount>,
    pub env: Vec<(String, String)>,
    pub working_dir: Option<PathBuf>,
    pub argv: Vec<String>,
    /// Where the shim writes the host pid of the container's first process (for fault injection:
    /// killing it takes the whole container down, as a crashed container would go).
    pub pid_file: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Mount {
    pub source: PathBuf,
    pub target: PathBuf,
    pub read_only: bool,
}

/// Exit code of a container that could not be started (a mount failed, the program is missing),
/// as container runtimes report it: 127 not found, 126 not executable, 128 anything else.
const START_FAILED: i32 = 128;

/// The container's first process, for the signal handler to forward to.
static CHILD: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: nix::libc::c_int) {
    let child = CHILD.load(Ordering::SeqCst);
    if child > 0 {
        // SAFETY: kill(2) is async-signal-safe.
        unsafe { nix::libc::kill(child, sig) };
    }
}

/// Runs the shim; returns the container's exit code (128 + signal when a signal ended it).
pub fn main(spec_path: &Path) -> Result<i32> {
    // The agent's death takes its containers along: nothing is left running after `down.sh`.
    prctl::set_pdeathsig(Signal::SIGKILL).context("prctl(PR_SET_PDEATHSIG)")?;
    let text = std::fs::read_to_string(spec_path).with_context(|| format!("reading {}", spec_path.display()))?;
    let spec: Spec = serde_json::from_str(&text).with_context(|| format!("parsing {}", spec_path.display()))?;
    let netns = std::fs::File::open(&spec.netns).with_context(|| format!("opening {}", spec.netns.display()))?;
    setns(&netns, CloneFlags::CLONE_NEWNET).with_context(|| format!("joining {}", spec.netns.display()))?;
    drop(netns);
    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWUTS | CloneFlags::CLONE_NEWPID)
        .context("unshare(mount, uts, pid)")?;
    // SAFETY: the shim is single-threaded here; the child only makes syscalls and execs.
    match unsafe { fork() }.context("fork")? {
        ForkResult::Child => {
            let code = match start(&spec) {
                Ok(never) => match never {},
                Err(e) => {
                    eprintln!("tensorfleet-node-agent: container start failed: {e:#}");
                    e.downcast_ref::<StartError>().map_or(START_FAILED, |s| s.code)
                }
            };
            std::process::exit(code);
        }
        ForkResult::Parent { child } => {
            CHILD.store(child.as_raw(), Ordering::SeqCst);
            std::fs::write(&spec.pid_file, child.to_string())
                .with_context(|| format!("writing {}", spec.pid_file.display()))?;
            for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
                // SAFETY: the handler only calls kill(2).
                unsafe { signal::signal(sig, SigHandler::Handler(forward)) }.context("installing a signal handler")?;
            }
            wait(child)
        }
    }
}

fn wait(child: Pid) -> Result<i32> {
    loop {
        match waitpid(child, None) {
            Ok(WaitStatus::Exited(_, code)) => return Ok(code),
            Ok(WaitStatus::Signaled(_, sig, _)) => return Ok(128 + sig as i32),
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => bail!("waiting for the container: {e}"),
        }
    }
}

#[derive(Debug)]
struct StartError {
    code: i32,
    message: String,
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for StartError {}

/// In the container's first process (pid 1 of its namespace): mounts, hostname, exec.
fn start(spec: &Spec) -> Result<std::convert::Infallible> {
    prctl::set_pdeathsig(Signal::SIGKILL).context("prctl(PR_SET_PDEATHSIG)")?;
    // Mounts made here must not leak back into the host's namespace.
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
        .context("making / private")?;
    for m in &spec.mounts {
        bind(m).with_context(|| format!("mounting {} at {}", m.source.display(), m.target.display()))?;
    }
    // A /proc of this PID namespace, so the container sees its own processes only.
    mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .context("mounting /proc")?;
    sethostname(&spec.hostname).with_context(|| format!("setting the hostname {}", spec.hostname))?;
    let dir = spec.working_dir.as_deref().unwrap_or(Path::new("/"));
    chdir(dir).with_context(|| format!("workingDir {}", dir.display()))?;
    let path = spec.env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.as_str()).unwrap_or("/usr/bin:/bin");
    let program = resolve(&spec.argv[0], path)?;
    let argv: Vec<CString> = spec.argv.iter().map(|a| cstring(a)).collect::<Result<_>>()?;
    let env: Vec<CString> = spec.env.iter().map(|(k, v)| cstring(&format!("{k}={v}"))).collect::<Result<_>>()?;
    let e = execve(&cstring(&program.to_string_lossy())?, &argv, &env).unwrap_err();
    Err(StartError { code: 126, message: format!("exec {}: {e}", program.display()) }.into())
}

fn bind(m: &Mount) -> Result<()> {
    let meta = std::fs::metadata(&m.source).context("the source")?;
    if meta.is_dir() {
        std::fs::create_dir_all(&m.target).context("creating the mount point")?;
    } else if !m.target.exists() {
        if let Some(parent) = m.target.parent() {
            std::fs::create_dir_all(parent).context("creating the mount point's directory")?;
        }
        std::fs::File::create(&m.target).context("creating the mount point")?;
    }
    mount(Some(&m.source), &m.target, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>)?;
    if m.read_only {
        let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
        mount(None::<&str>, &m.target, None::<&str>, flags, None::<&str>).context("making it read-only")?;
    }
    Ok(())
}

/// The program's path: as given when it has a slash, else the first executable on PATH.
fn resolve(program: &str, path: &str) -> Result<PathBuf> {
    if program.contains('/') {
        return Ok(PathBuf::from(program));
    }
    let executable = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    path.split(':')
        .map(|dir| Path::new(dir).join(program))
        .find(|p| executable(p))
        .ok_or_else(|| StartError { code: 127, message: format!("{program}: not found on PATH {path}") }.into())
}

fn cstring(s: &str) -> Result<CString> {
    CString::new(s).with_context(|| format!("{s:?} contains a NUL byte"))
}
