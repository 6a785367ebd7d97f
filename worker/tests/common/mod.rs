//! What the multi-process tests share: how they start `mpirun`.

use std::path::PathBuf;
use std::process::Command;

/// `mpirun -np <np>` as the tests run it: more ranks than cores allowed, no pinning (the ranks
/// share two cores with each other), and as root, which OpenMPI refuses unless told twice.
/// Panics with what to do when OpenMPI is not installed.
pub fn mpirun(np: usize) -> Command {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let exe: PathBuf =
        std::env::split_paths(&path).map(|d| d.join("mpirun")).find(|p| p.is_file()).unwrap_or_else(|| {
            panic!("mpirun is not on PATH: these tests run the worker under OpenMPI; run `make deps` to install it")
        });
    let mut cmd = Command::new(exe);
    cmd.args(["--oversubscribe", "--bind-to", "none", "-np", &np.to_string()])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    cmd
}
