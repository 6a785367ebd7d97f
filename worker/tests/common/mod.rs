//! What the integration tests share: how they start `mpirun`, and GPT-2's token batches.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use tensorfleet_worker::tensor::Tensor;

/// `mpirun -np <np>` as the tests run it: more ranks than cores allowed, no pinning (the ranks
/// share two cores with each other), and as root, which OpenMPI refuses unless told twice.
/// Panics with what to do when OpenMPI is not installed.
#[allow(dead_code)] // the single-process tests include `common` for the batches
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

/// A GPT-2 micro-batch: `rows` × `seq` token ids (a fixed walk over `vocab`, shifted by `salt`)
/// and their next-token labels.
#[allow(dead_code)] // not every test crate that includes `common` trains GPT-2 this way
pub fn token_batch(rows: usize, seq: usize, vocab: usize, salt: usize) -> BTreeMap<String, Tensor> {
    let ids: Vec<i64> = (0..rows * seq + 1).map(|i| ((i * 7 + 3 + salt * 11) % vocab) as i64).collect();
    [
        ("input_ids".to_string(), Tensor::from_vec(&[rows, seq], ids[..rows * seq].to_vec())),
        ("labels".to_string(), Tensor::from_vec(&[rows, seq], ids[1..].to_vec())),
    ]
    .into_iter()
    .collect()
}
