//! What the integration tests share: how they start `mpirun`, GPT-2's token batches, and how
//! the backend tests run one op and compare its outputs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use tensorfleet_worker::backend::{Arg, Backend, Scratch};
use tensorfleet_worker::graph::ir::Meta;
use tensorfleet_worker::op::Op;
use tensorfleet_worker::tensor::{DType, Tensor};

/// `mpirun -np <np>` as the tests run it: more ranks than cores allowed, no pinning (the ranks
/// share two cores with each other), and as root, which OpenMPI refuses unless told twice.
/// Panics with what to do when OpenMPI is not installed.
/// The project's venv interpreter, which `make test` names in TENSORFLEET_PYTHON; the tests
/// that call this are ignored in a plain `cargo test` ("needs TENSORFLEET_PYTHON").
#[allow(dead_code)] // the tests that run Python
pub fn venv_python() -> String {
    std::env::var("TENSORFLEET_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .expect("TENSORFLEET_PYTHON names the project's venv interpreter (make test sets it)")
}

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

/// Runs one op on `backend`: uploads `inputs`, launches into outputs of `out_metas`, and
/// downloads them.
#[allow(dead_code)] // the backend tests'
pub fn run_typed<B: Backend>(backend: &B, op: &Op, inputs: &[Tensor], out_metas: &[Meta]) -> Vec<Tensor> {
    let in_metas: Vec<Meta> = inputs.iter().map(|t| Meta::new(t.dtype(), t.shape())).collect();
    let in_bufs: Vec<B::Buffer> = in_metas.iter().map(|m| backend.alloc(m.bytes()).unwrap()).collect();
    let out_bufs: Vec<B::Buffer> = out_metas.iter().map(|m| backend.alloc(m.bytes()).unwrap()).collect();
    let arg = |buf, meta| Arg { buf, offset: 0, meta };
    for ((t, buf), meta) in inputs.iter().zip(&in_bufs).zip(&in_metas) {
        backend.upload(t, arg(buf, meta)).unwrap();
    }
    let ins: Vec<Option<Arg<B::Buffer>>> = in_bufs.iter().zip(&in_metas).map(|(b, m)| Some(arg(b, m))).collect();
    let outs: Vec<Arg<B::Buffer>> = out_bufs.iter().zip(out_metas).map(|(b, m)| arg(b, m)).collect();
    // The scratch the backend measures for the op, as an executor's plan would give it.
    let (ins_meta, outs_meta): (Vec<_>, Vec<_>) = (in_metas.iter().map(Some).collect(), out_metas.iter().collect());
    let scratch_bytes = backend.scratch_bytes(op, &ins_meta, &outs_meta);
    let scratch_buf = backend.alloc(scratch_bytes.max(1)).unwrap();
    let scratch = (scratch_bytes > 0).then_some(Scratch { buf: &scratch_buf, offset: 0, bytes: scratch_bytes });
    backend.launch(op, &ins, &outs, scratch).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    outs.into_iter().map(|o| backend.download(o).unwrap()).collect()
}

/// `n` values in [-1, 1), a different sequence for each salt.
#[allow(dead_code)] // the backend tests'
pub fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 37 + salt * 11) % 101) as f32 / 50.0) - 1.0).collect()
}

/// As many outputs as the reference, each of its shape and within `tol` of its largest finite
/// magnitude, compared in f32; a NaN or an infinity must be matched by the same (f32::max
/// would pass over a NaN).
#[allow(dead_code)] // the backend tests'
pub fn close_as_f32(what: &str, got: &[Tensor], reference: &[Tensor], tol: f32) {
    assert_eq!(got.len(), reference.len(), "{what}: {} outputs, the reference has {}", got.len(), reference.len());
    for (k, (g, c)) in got.iter().zip(reference).enumerate() {
        assert_eq!(g.shape(), c.shape(), "{what}, output {k}: shape differs from the reference's");
        let (g, c) = (g.cast(DType::F32), c.cast(DType::F32));
        let (gs, cs) = (g.as_slice::<f32>(), c.as_slice::<f32>());
        let largest = cs.iter().filter(|v| v.is_finite()).fold(1e-3f32, |m, v| m.max(v.abs()));
        let differs = |a: f32, b: f32| match (a - b).abs() {
            _ if a == b || (a.is_nan() && b.is_nan()) => 0.0,
            d if d.is_nan() => f32::INFINITY,
            d => d,
        };
        let worst = gs.iter().zip(cs).fold(0f32, |m, (&a, &b)| m.max(differs(a, b)));
        assert!(worst <= tol * largest, "{what}, output {k}: differs by {worst} (largest {largest})");
    }
}

/// A fresh, empty directory for one test, `tf-<name>-<pid>` under the temp dir.
#[allow(dead_code)] // the tests that run the worker binary
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A finished command's stderr, as text.
#[allow(dead_code)] // the tests that run the worker binary
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
