//! PyTorch's upsampling layers, exported by PyTorch, train in tensorfleet as PyTorch trains the
//! module (tests/data/torch_upsample/export.py wrote the models, the batches and PyTorch's
//! numbers): nn.ConvTranspose2d (strided with output_padding, grouped), nn.ConvTranspose1d,
//! nn.Upsample and F.interpolate (nearest; bilinear with align_corners False and True, up and
//! down, by scale and to a size), each exported by the TorchScript exporter and by the dynamo
//! exporter, trained for 12 SGD and 12 AdamW steps on the CPU backend and on the CUDA backend's
//! kernels under the CPU emulator.
//!
//! Compared with PyTorch's float32 run: each step's loss and the first step's gradient norm
//! (the network has no BatchNormalization, so float32 runs follow each other step for step).

mod cuda_emulator;
mod torch_oracle;

use cuda_emulator::EmulatedGpu;
use serde_json::Value;
use std::sync::Arc;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::backend::Backend;
use tensorfleet_worker::op::Op;
use tensorfleet_worker::session::{Session, SessionOptions};
use torch_oracle::{first_grad_norm, floats, rel, update};

/// Relative to PyTorch's: the CPU backend sums in other orders than PyTorch; the emulated
/// kernels in others again.
const TOLERANCE: f64 = 1e-5;

fn trains_like_pytorch<B: Backend + 'static>(backend: Arc<B>, exporter: &str, kind: &str, on: &str) {
    let dir = torch_oracle::data_dir("torch_upsample");
    let e = torch_oracle::expected(&dir);
    let file = e["exports"][exporter]["file"].as_str().unwrap();
    let case = format!("{file} {kind} on {on}");
    let model = torch_oracle::load(&dir, file, None, Default::default());
    let count = |f: fn(&Op) -> bool| model.graph.nodes.iter().filter(|n| f(&n.op)).count();
    assert_eq!(
        (count(|op| matches!(op, Op::ConvTranspose { .. })), count(|op| matches!(op, Op::Resize(_)))),
        (3, 5),
        "{case}: the export's ConvTranspose and Resize nodes"
    );
    let batches = torch_oracle::batches(
        &dir.join(e["data"].as_str().unwrap()),
        e["batch"].as_u64().unwrap() as usize,
        e["batches"].as_u64().unwrap() as usize,
    );
    let torch: &Value = &e[kind]["float32"];
    let want = floats(&torch["losses"]);
    let (update, lr) = update(&e, kind);
    let mut s = Session::new(backend, &model, &batches[0], 1, &SessionOptions::new(update))
        .unwrap_or_else(|err| panic!("{case}: {err}"));
    let mut losses = Vec::new();
    for step in 0..want.len() {
        let r = s.step(std::slice::from_ref(&batches[step % batches.len()]), lr, 0.0, 0).unwrap();
        if step == 0 {
            first_grad_norm(&case, r.grad_norm, torch, TOLERANCE);
        }
        losses.push(r.loss);
    }
    let worst = losses.iter().zip(&want).map(|(&a, &b)| rel(a, b)).fold(0.0, f64::max);
    println!("{case}: {} losses agree with PyTorch's to {worst:.1e}", want.len());
    assert!(worst <= TOLERANCE, "{case}: losses {losses:?} vs PyTorch's {want:?}");
}

#[test]
fn torchscript_export_trains_like_pytorch_on_the_cpu() {
    for kind in ["sgd", "adamw"] {
        trains_like_pytorch(Arc::new(CpuBackend::new()), "torchscript", kind, "the CPU");
    }
}

#[test]
fn dynamo_export_trains_like_pytorch_on_the_cpu() {
    for kind in ["sgd", "adamw"] {
        trains_like_pytorch(Arc::new(CpuBackend::new()), "dynamo", kind, "the CPU");
    }
}

#[test]
fn both_exports_train_like_pytorch_on_the_emulated_kernels() {
    for exporter in ["torchscript", "dynamo"] {
        for kind in ["sgd", "adamw"] {
            trains_like_pytorch(Arc::new(EmulatedGpu::new()), exporter, kind, "the emulated kernels");
        }
    }
}
