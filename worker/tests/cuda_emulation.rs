//! The CUDA backend's kernels and dispatch checked on the CPU, where no GPU is: the kernel
//! program compiled by g++ and run by the fiber emulator of `cuda_emulator/`, behind the same
//! dispatch the GPU uses, trains GPT-2 and SqueezeNet to the CPU backend's losses and weights.
//! (cuBLASLt is replaced by a plain loop here; the GPU tests in cuda_backend.rs cover it where a
//! GPU is.)

mod common;
mod cuda_emulator;
mod torch_oracle;

use cuda_emulator::EmulatedGpu;
use std::collections::BTreeMap;
use std::sync::Arc;
use tensorfleet_worker::backend::cpu::CpuBackend;
use tensorfleet_worker::backend::Backend;
use tensorfleet_worker::config::{DynamicLossScale, Gpt2Config, ModelSpec, Recompute, SqueezeNetConfig};
use tensorfleet_worker::graph::infer::window_output;
use tensorfleet_worker::graph::ir::Meta;
use tensorfleet_worker::models;
use tensorfleet_worker::op::resize::{Coordinates, Interpolation, Target};
use tensorfleet_worker::op::{
    AttentionLayout, Binary, LossReduction, Op, PadMode, PoolKind, Reduce, Resize, ScatterReduction, Unary, Window,
};
use tensorfleet_worker::optim::scaler::LossScaler;
use tensorfleet_worker::optim::Update;
use tensorfleet_worker::session::{Session, SessionOptions};
use tensorfleet_worker::tensor::{DType, Tensor};

use common::token_batch as batch;
use common::{close_as_f32, run_typed, values};

/// What a run leaves to compare: each step's loss, the evaluation loss, the final weights, and
/// how many of the training graph's steps its plan gave scratch (the dispatch's temporary
/// memory, in the arena: the emulator refuses a request beyond it).
struct Run {
    losses: Vec<f64>,
    eval: f64,
    initial: BTreeMap<String, Tensor>,
    weights: BTreeMap<String, Tensor>,
    scratch_steps: usize,
}

/// GPT-2 with its vocabulary of 45 padded to 48 (the LM head masked past 45) trained `steps`.
fn train<B: Backend>(backend: Arc<B>, update: Update, recompute: Recompute, micro_batches: usize, steps: u64) -> Run {
    let spec = ModelSpec {
        gpt2: Some(Gpt2Config {
            layers: 2,
            heads: 2,
            embed: 32,
            seq_len: 8,
            vocab: 45,
            dropout: 0.1,
            make_vocab_size_divisible_by: 16,
        }),
        ..Default::default()
    };
    let batches: Vec<_> = (0..micro_batches).map(|k| batch(2, 8, 45, k)).collect();
    train_model(backend, &spec, &batches, &SessionOptions { recompute, ..SessionOptions::new(update) }, steps)
}

/// `steps` updates over `batches` (one per micro-batch), then an evaluation of the first.
fn train_model<B: Backend>(
    backend: Arc<B>,
    spec: &ModelSpec,
    batches: &[BTreeMap<String, Tensor>],
    opts: &SessionOptions,
    steps: u64,
) -> Run {
    let micro_batches = batches.len();
    let model = models::load(spec, 11).unwrap();
    let mut s = Session::new(backend, &model, &batches[0], micro_batches, opts).unwrap();
    let initial = s.weights().unwrap();
    let losses = (0..steps).map(|k| s.step(batches, 3e-3, 1.0, k).unwrap().loss).collect();
    let eval = s.evaluate(&batches[..1]).unwrap();
    let scratch_steps = s.train.plan.scratch.iter().flatten().count();
    Run { losses, eval, initial, weights: s.weights().unwrap(), scratch_steps }
}

fn assert_same(what: &str, gpu: &Run, cpu: &Run) {
    let close = |a: f64, b: f64, rtol: f64| (a - b).abs() <= rtol * b.abs().max(1e-3);
    for (k, (g, c)) in gpu.losses.iter().zip(&cpu.losses).enumerate() {
        assert!(close(*g, *c, 1e-5), "{what}, step {}: emulated GPU loss {g}, CPU {c}", k + 1);
    }
    assert!(close(gpu.eval, cpu.eval, 1e-5), "{what}: evaluation loss {} vs {}", gpu.eval, cpu.eval);
    for (name, c) in &cpu.weights {
        let g = &gpu.weights[name];
        let (gs, cs) = (g.as_slice::<f32>(), c.as_slice::<f32>());
        let worst = gs.iter().zip(cs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4, "{what}: weight {name} differs by {worst}");
    }
}

#[test]
fn gpt2_trains_on_the_emulated_kernels_to_the_cpu_losses() {
    let adamw = Update::Adam { beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1, decoupled: true };
    let cases = [
        ("AdamW, dropout 0.1", adamw, Recompute::None, 1),
        (
            "SGD with Nesterov momentum, 2 micro-batches",
            Update::Sgd { momentum: 0.9, nesterov: true, weight_decay: 1e-4 },
            Recompute::None,
            2,
        ),
        (
            "LAMB, whole layers recomputed",
            Update::Lamb { beta1: 0.9, beta2: 0.999, epsilon: 1e-6, weight_decay: 0.01 },
            Recompute::Layer,
            1,
        ),
        (
            "Adam with L2, GELU recomputed",
            Update::Adam { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.01, decoupled: false },
            Recompute::Gelu,
            1,
        ),
    ];
    for (what, update, recompute, micro) in cases {
        let gpu = train(Arc::new(EmulatedGpu::new()), update, recompute, micro, 3);
        let cpu = train(Arc::new(CpuBackend::new()), update, recompute, micro, 3);
        assert_same(what, &gpu, &cpu);
        // The attention's gradient (dq's f32 sums) and the bias gradients' column sums.
        assert!(gpu.scratch_steps > 0 && cpu.scratch_steps == 0, "{what}: scratch planned for {}", gpu.scratch_steps);
    }
}

/// ResNet-18's topology as PyTorch's TorchScript exporter wrote it (tests/data/torch_cnn, tiny
/// widths) trains in bf16 on the emulated kernels to the CPU backend's bf16 losses: its
/// BatchNormalizations and their gradients run in bf16 (f32 inside), the max pool's gradient
/// goes through each window's first maximum. The
/// first loss within 1e-5, the rest within 2⁻⁶, as the GPU test allows these BatchNorm nets,
/// whose two backends part with rounding from the first update.
#[test]
fn exported_resnet18_trains_in_bf16_on_the_emulated_kernels_to_the_cpu_losses() {
    let dir = torch_oracle::data_dir("torch_cnn");
    let e = torch_oracle::expected(&dir);
    let spec = torch_oracle::spec(&dir, "resnet18_torchscript.onnx", None, Default::default());
    let batches =
        torch_oracle::batches(&dir.join(e["data"].as_str().unwrap()), e["batch"].as_u64().unwrap() as usize, 1);
    let sgd = Update::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 };
    let opts = SessionOptions { half: Some(DType::BF16), ..SessionOptions::new(sgd) };
    let gpu = train_model(Arc::new(EmulatedGpu::new()), &spec, &batches, &opts, 2);
    let cpu = train_model(Arc::new(CpuBackend::new()), &spec, &batches, &opts, 2);
    println!("resnet18 bf16: emulated {:?} then {}, CPU {:?} then {}", gpu.losses, gpu.eval, cpu.losses, cpu.eval);
    // The convolutions' columns, their gradients' chunks, the max pool's first maxima.
    assert!(gpu.scratch_steps > 0, "no step of the emulated ResNet-18 was planned scratch");
    // The first step's loss is the forward pass over the initial weights: within rounding.
    let (g, c) = (gpu.losses[0], cpu.losses[0]);
    assert!((g - c).abs() <= 1e-5 * c.abs(), "step 1: emulated GPU loss {g}, CPU {c}");
    for (k, (g, c)) in gpu.losses.iter().chain([&gpu.eval]).zip(cpu.losses.iter().chain([&cpu.eval])).enumerate() {
        assert!((g - c).abs() <= c.abs() / 64.0, "loss {k} (the last: evaluation): emulated GPU {g}, CPU {c}");
    }
}

/// Models users export: the tiny Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention) and
/// ViT (patch convolution, erf GELU) that tests/torch_hf.rs trains against PyTorch, from both
/// exporters, train in bf16 on the emulated kernels to the CPU backend's bf16 losses.
#[test]
fn exported_llama_and_vit_train_in_bf16_on_the_emulated_kernels_to_the_cpu_losses() {
    let dir = torch_oracle::data_dir("torch_hf");
    let adamw = Update::Adam { beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.01, decoupled: true };
    let opts = SessionOptions { half: Some(DType::BF16), ..SessionOptions::new(adamw) };
    for file in ["llama_torchscript.onnx", "llama_dynamo.onnx", "vit_torchscript.onnx", "vit_dynamo.onnx"] {
        let model = file.split('_').next().unwrap();
        let spec = torch_oracle::spec(&dir, file, Some(-100), Default::default());
        let batches = torch_oracle::batches(&dir.join(format!("{model}.pb")), 4, 2);
        let losses = |r: Run| -> Vec<f64> { r.losses.into_iter().chain([r.eval]).collect() };
        let gpu = losses(train_model(Arc::new(EmulatedGpu::new()), &spec, &batches[..1], &opts, 3));
        let cpu = losses(train_model(Arc::new(CpuBackend::new()), &spec, &batches[..1], &opts, 3));
        let fp32 =
            losses(train_model(Arc::new(CpuBackend::new()), &spec, &batches[..1], &SessionOptions::new(adamw), 3));
        println!("{file} bf16: emulated {gpu:?}, CPU {cpu:?}; CPU fp32 {fp32:?}");
        for (k, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
            assert!(
                (g - c).abs() <= 3e-3 * c.abs(),
                "{file}, loss {k} (the last: evaluation): emulated GPU {g}, CPU {c}"
            );
        }
        // ...and bf16 is what ran: the losses round away from fp32's.
        assert!(gpu.iter().zip(&fp32).any(|(g, f)| (g - f).abs() > 1e-5 * f.abs()), "{file}: no rounding seen");
    }
}

/// SqueezeNet 1.1 on 32×32 images: convolutions (3×3 stride 2, 1×1, padded 3×3), ceil-mode max
/// pooling, dropout, global average pooling and their gradients.
/// Mixed precision on the emulated kernels: bf16 and fp16 GPT-2 (products through the
/// half-precision GEMM, fused attention, elementwise ops on half storage, bias gradients summed
/// from half) and bf16 SqueezeNet (half convolutions and pooling) train to the CPU backend's
/// mixed-precision losses. The two differ in where f32 sums are rounded (the GPU rounds a
/// product before adding its bias), so a half value can land one unit in its last place apart:
/// the bound is half precision's.
#[test]
fn mixed_precision_trains_on_the_emulated_kernels_to_the_cpu_losses() {
    let adamw = Update::Adam { beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1, decoupled: true };
    let gpt2 = ModelSpec {
        gpt2: Some(Gpt2Config {
            layers: 2,
            heads: 2,
            embed: 32,
            seq_len: 8,
            vocab: 48,
            dropout: 0.1,
            ..Default::default()
        }),
        ..Default::default()
    };
    let tokens: Vec<_> = (0..2).map(|k| batch(2, 8, 48, k)).collect();
    let squeezenet =
        ModelSpec { squeezenet: Some(SqueezeNetConfig { classes: 4, image_size: 32 }), ..Default::default() };
    let (images, size) = (3, 32);
    let pixels: Vec<f32> = (0..images * 3 * size * size).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let pictures = vec![[
        ("image".to_string(), Tensor::from_vec(&[images, 3, size, size], pixels)),
        ("labels".to_string(), Tensor::from_vec(&[images], vec![0i64, 3, 1])),
    ]
    .into_iter()
    .collect::<BTreeMap<_, _>>()];
    let sgd = Update::Sgd { momentum: 0.9, nesterov: false, weight_decay: 1e-4 };
    let fp16_scaler = Some(LossScaler::new(0.0, DynamicLossScale::default()));
    for (what, spec, batches, update, half, scaler, rtol) in [
        ("GPT-2 bf16", &gpt2, &tokens, adamw, DType::BF16, None, 2e-3),
        ("GPT-2 fp16", &gpt2, &tokens, adamw, DType::F16, fp16_scaler.clone(), 3e-4),
        ("SqueezeNet bf16", &squeezenet, &pictures, sgd, DType::BF16, None, 3e-3),
    ] {
        let opts = SessionOptions {
            half: Some(half),
            loss_scaler: scaler,
            recompute: Recompute::Gelu,
            ..SessionOptions::new(update)
        };
        // Each step's loss, then the evaluation loss.
        let losses = |r: Run| -> Vec<f64> { r.losses.into_iter().chain([r.eval]).collect() };
        let emulated = Arc::new(EmulatedGpu::new());
        let gpu = losses(train_model(emulated.clone(), spec, batches, &opts, 3));
        let cpu = losses(train_model(Arc::new(CpuBackend::new()), spec, batches, &opts, 3));
        for (k, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
            assert!(
                (g - c).abs() <= rtol * c.abs(),
                "{what}, loss {k} (the last: evaluation): emulated GPU {g}, CPU {c}"
            );
        }
        println!("{what}: emulated {gpu:?}, CPU {cpu:?}");
        // GPT-2's heads of 16 half elements run on the tensor-core attention.
        assert_eq!(tensor_core_launches(&emulated) > 0, spec.gpt2.is_some(), "{what}: tensor-core attention");
    }
}

#[test]
fn squeezenet_trains_on_the_emulated_kernels_to_the_cpu_losses() {
    let spec = ModelSpec { squeezenet: Some(SqueezeNetConfig { classes: 4, image_size: 32 }), ..Default::default() };
    let (images, size) = (3, 32);
    let pixels: Vec<f32> = (0..images * 3 * size * size).map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0).collect();
    let batch: BTreeMap<String, Tensor> = [
        ("image".to_string(), Tensor::from_vec(&[images, 3, size, size], pixels)),
        ("labels".to_string(), Tensor::from_vec(&[images], vec![0i64, 3, 1])),
    ]
    .into_iter()
    .collect();
    let batches = [batch];
    // SGD: Adam's normalisation would turn the two backends' rounding in near-zero gradients
    // into whole-step differences in the weights (GPT-2 above covers Adam's kernels).
    let sgd = Update::Sgd { momentum: 0.9, nesterov: false, weight_decay: 1e-4 };
    let opts = SessionOptions::new(sgd);
    let gpu = train_model(Arc::new(EmulatedGpu::new()), &spec, &batches, &opts, 3);
    let cpu = train_model(Arc::new(CpuBackend::new()), &spec, &batches, &opts, 3);
    assert_same("SqueezeNet, SGD with momentum", &gpu, &cpu);
    // Small steps move the weights less than assert_same's tolerance: the updates themselves
    // must agree, to 0.1% of each tensor's largest, plus the rounding of the weights they are
    // read from (two ulps).
    for (name, c) in &cpu.weights {
        let (w0, g, c) =
            (cpu.initial[name].as_slice::<f32>(), gpu.weights[name].as_slice::<f32>(), c.as_slice::<f32>());
        let largest = c.iter().zip(w0).fold(0f32, |m, (c, w0)| m.max((c - w0).abs()));
        for (k, ((c, g), w0)) in c.iter().zip(g).zip(w0).enumerate() {
            let ulps = 2.0 * f32::EPSILON * w0.abs().max(c.abs());
            let diff = ((c - w0) - (g - w0)).abs();
            assert!(
                diff <= 1e-3 * largest + ulps,
                "the update of {name}[{k}] differs by {diff} (the tensor's largest update is {largest})"
            );
        }
    }
}

/// Runs one op on `backend`: uploads `inputs`, launches into outputs of `out_shapes`, and
/// downloads them.
fn run_op<B: Backend>(backend: &B, op: &Op, inputs: &[Tensor], out_shapes: &[Vec<usize>]) -> Vec<Tensor> {
    let out_metas: Vec<Meta> = out_shapes.iter().map(|s| Meta::new(DType::F32, s)).collect();
    run_typed(backend, op, inputs, &out_metas)
}

/// Every f32 output within 1e-5 of the CPU's largest magnitude.
fn assert_close(what: &str, gpu: &[Tensor], cpu: &[Tensor]) {
    close_as_f32(what, gpu, cpu, 1e-5);
}

/// The window ops one at a time, in the geometries SqueezeNet does not have: groups, dilation,
/// uneven pads, 1-D, ceil-mode average pooling with and without the padding counted; and
/// BatchNormalization, which SqueezeNet 1.1 does not use.
#[test]
fn cnn_ops_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let convs = [
        (
            "2-D, 2 groups, stride 2, dilation 2, uneven pads",
            vec![2, 4, 9, 11],
            vec![6, 2, 3, 2],
            2,
            Window::explicit(&[3, 2], &[2, 2], &[2, 1], &[1, 0, 2, 1], false),
        ),
        (
            "2-D pointwise",
            vec![2, 5, 4, 3],
            vec![3, 5, 1, 1],
            1,
            Window::explicit(&[1, 1], &[1, 1], &[1, 1], &[0, 0, 0, 0], false),
        ),
        ("1-D, stride 3", vec![3, 2, 13], vec![4, 2, 3], 1, Window::explicit(&[3], &[3], &[1], &[1, 2], false)),
        // Planes of 512 positions or more run a product per image; the smaller ones above fold
        // their images into one product's columns.
        (
            "2-D, a plane of 24 × 24",
            vec![2, 2, 24, 24],
            vec![3, 2, 3, 3],
            1,
            Window::explicit(&[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], false),
        ),
        (
            "2-D pointwise, a plane of 16 × 32",
            vec![2, 3, 16, 32],
            vec![2, 3, 1, 1],
            1,
            Window::explicit(&[1, 1], &[1, 1], &[1, 1], &[0, 0, 0, 0], false),
        ),
    ];
    for (what, x_shape, w_shape, group, win) in convs {
        let spatial = window_output(&win, &x_shape[2..]).unwrap();
        let y_shape: Vec<usize> = [x_shape[0], w_shape[0]].into_iter().chain(spatial).collect();
        let n = |s: &[usize]| s.iter().product::<usize>();
        let (x, w) =
            (Tensor::from_vec(&x_shape, values(n(&x_shape), 1)), Tensor::from_vec(&w_shape, values(n(&w_shape), 2)));
        let b = Tensor::from_vec(&[w_shape[0]], values(w_shape[0], 3));
        let conv = Op::Conv { window: win.clone(), group };
        let conv_inputs = [x.clone(), w.clone(), b];
        let dy = Tensor::from_vec(&y_shape, values(n(&y_shape), 4));
        let grad = Op::ConvGrad { window: win, group };
        let shapes = [x_shape.clone(), w_shape.clone(), vec![w_shape[0]]];
        let grad_inputs = [dy, x, w];
        // All the images at once, then two at a time (f32 temporaries of the folded layouts,
        // which hold at most (kdim + m) · plane values an image): three images make chunks of
        // two and one.
        let (kdim, plane) = (n(&w_shape[1..]), n(&y_shape[2..]));
        for budget in [64 << 20, 2 * (kdim + w_shape[0]) * plane * 4] {
            gpu.scratch_budget.store(budget, std::sync::atomic::Ordering::Relaxed);
            assert_close(
                &format!("{what}, scratch budget {budget}"),
                &run_op(&gpu, &conv, &conv_inputs, std::slice::from_ref(&y_shape)),
                &run_op(&cpu, &conv, &conv_inputs, std::slice::from_ref(&y_shape)),
            );
            assert_close(
                &format!("{what}, scratch budget {budget}: gradient"),
                &run_op(&gpu, &grad, &grad_inputs, &shapes),
                &run_op(&cpu, &grad, &grad_inputs, &shapes),
            );
        }
    }
    gpu.scratch_budget.store(64 << 20, std::sync::atomic::Ordering::Relaxed);
    let pools = [
        ("max, dilation 2, ceil mode", PoolKind::Max, Window::explicit(&[2, 3], &[2, 2], &[2, 1], &[1, 1, 0, 1], true)),
        (
            "average, padding counted, ceil mode",
            PoolKind::Average { count_include_pad: true },
            Window::explicit(&[3, 3], &[2, 2], &[1, 1], &[1, 0, 1, 1], true),
        ),
        (
            "average, padding not counted",
            PoolKind::Average { count_include_pad: false },
            Window::explicit(&[3, 2], &[1, 2], &[1, 1], &[1, 1, 1, 0], false),
        ),
    ];
    let x_shape = vec![2, 3, 7, 8];
    let x = Tensor::from_vec(&x_shape, values(2 * 3 * 7 * 8, 5));
    for (what, kind, win) in pools {
        let y_shape: Vec<usize> = [2, 3].into_iter().chain(window_output(&win, &x_shape[2..]).unwrap()).collect();
        let pool = Op::Pool { kind, window: win.clone() };
        let inputs = [x.clone()];
        assert_close(
            what,
            &run_op(&gpu, &pool, &inputs, std::slice::from_ref(&y_shape)),
            &run_op(&cpu, &pool, &inputs, std::slice::from_ref(&y_shape)),
        );
        let dy = Tensor::from_vec(&y_shape, values(y_shape.iter().product(), 6));
        let grad = Op::PoolGrad { kind, window: win };
        let inputs = [dy, x.clone()];
        let shapes = [x_shape.clone()];
        assert_close(
            &format!("{what}: gradient"),
            &run_op(&gpu, &grad, &inputs, &shapes),
            &run_op(&cpu, &grad, &inputs, &shapes),
        );
    }
    // ResNet's max pool (3 × 3, stride 2, padding 1) over ReLU'd values: windows with tied
    // maxima (all zeros, or equal values), whose first takes dY. With a scratch budget below one
    // plane's windows, the gradient finds the maxima and gathers plane by plane.
    let win = Window::explicit(&[3, 3], &[2, 2], &[1, 1], &[1, 1, 1, 1], false);
    let relu_x = Tensor::from_vec(&x_shape, values(2 * 3 * 7 * 8, 7).iter().map(|v| v.max(0.0)).collect());
    let y_shape: Vec<usize> = [2, 3].into_iter().chain(window_output(&win, &x_shape[2..]).unwrap()).collect();
    let inputs = [Tensor::from_vec(&y_shape, values(y_shape.iter().product(), 8)), relu_x];
    let grad = Op::PoolGrad { kind: PoolKind::Max, window: win };
    let cpu_dx = run_op(&cpu, &grad, &inputs, std::slice::from_ref(&x_shape));
    for budget in [64 << 20, 16] {
        gpu.scratch_budget.store(budget, std::sync::atomic::Ordering::Relaxed);
        let what = format!("max 3 × 3, stride 2, ties: gradient, scratch budget {budget}");
        assert_close(&what, &run_op(&gpu, &grad, &inputs, std::slice::from_ref(&x_shape)), &cpu_dx);
    }
    gpu.scratch_budget.store(64 << 20, std::sync::atomic::Ordering::Relaxed);
    // Pooling over 3 spatial dims of unequal sizes, each with its own window, in f32 (with
    // MaxPool's Indices) and in integer types (pooled in f64).
    let x3_shape = vec![1, 2, 5, 6, 7];
    let x3 = Tensor::from_vec(&x3_shape, values(420, 7));
    // Ceil mode: the last windows along the last two dims hang off the padded input's end.
    let win3 = Window::explicit(&[2, 3, 2], &[1, 2, 3], &[2, 1, 1], &[0, 1, 1, 1, 0, 1], true);
    let y3_shape: Vec<usize> = [1, 2].into_iter().chain(window_output(&win3, &x3_shape[2..]).unwrap()).collect();
    let kinds =
        [PoolKind::Max, PoolKind::Average { count_include_pad: true }, PoolKind::Average { count_include_pad: false }];
    for kind in kinds {
        let pool = Op::Pool { kind, window: win3.clone() };
        let mut outs = vec![Meta::new(DType::F32, &y3_shape)];
        if kind == PoolKind::Max {
            outs.push(Meta::new(DType::I64, &y3_shape));
        }
        let what = format!("3-D {kind:?}");
        let inputs = std::slice::from_ref(&x3);
        assert_close(&what, &run_typed(&gpu, &pool, inputs, &outs), &run_typed(&cpu, &pool, inputs, &outs));
        for t in [DType::U8, DType::I32] {
            let x = x3.as_slice::<f32>().iter().map(|v| (v * 100.0) as f64).collect();
            let x = Tensor::from_vec(&x3_shape, x).cast(t);
            let outs = [Meta::new(t, &y3_shape)];
            let (g, c) = (run_typed(&gpu, &pool, std::slice::from_ref(&x), &outs), run_typed(&cpu, &pool, &[x], &outs));
            assert_eq!(g[0].to_f64_vec(), c[0].to_f64_vec(), "{what} of {t}");
        }
    }
    // BatchNormalization: training (with the running statistics' update), inference, gradient.
    let c = 3;
    let stats = |salt| Tensor::from_vec(&[c], values(c, salt).iter().map(|v| v.abs() + 0.5).collect());
    let (scale, bias, mean, var) = (stats(7), stats(8), stats(9), stats(10));
    let with_stats = [x.clone(), scale.clone(), bias, mean, var];
    let train = Op::BatchNorm { epsilon: 1e-5, momentum: 0.9, training: true };
    let shapes = [x_shape.clone(), vec![c], vec![c]];
    assert_close(
        "BatchNormalization, training",
        &run_op(&gpu, &train, &with_stats, &shapes),
        &run_op(&cpu, &train, &with_stats, &shapes),
    );
    let infer = Op::BatchNorm { epsilon: 1e-5, momentum: 0.9, training: false };
    let shapes = [x_shape.clone()];
    assert_close(
        "BatchNormalization, inference",
        &run_op(&gpu, &infer, &with_stats, &shapes),
        &run_op(&cpu, &infer, &with_stats, &shapes),
    );
    let grad = Op::BatchNormGrad { epsilon: 1e-5 };
    let inputs = [Tensor::from_vec(&x_shape, values(x.numel(), 11)), x.clone(), scale];
    let shapes = [x_shape.clone(), vec![c], vec![c]];
    assert_close(
        "BatchNormalization's gradient",
        &run_op(&gpu, &grad, &inputs, &shapes),
        &run_op(&cpu, &grad, &inputs, &shapes),
    );
    let gap = Op::GlobalAveragePool;
    let inputs = [x];
    assert_close(
        "GlobalAveragePool",
        &run_op(&gpu, &gap, &inputs, &[vec![2, 3, 1, 1]]),
        &run_op(&cpu, &gap, &inputs, &[vec![2, 3, 1, 1]]),
    );
}

/// Half-precision kernels one op at a time, bf16 and f16: the elementwise ops, casts, dropout
/// and Where give the CPU backend's bits exactly (both compute in f32 and round to nearest even
/// once); a sum (a bias gradient, a product) may round one unit in the last place apart, its
/// f32 accumulation running in another order.
#[test]
fn half_precision_ops_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    for (t, ulp) in [(DType::BF16, 2f32.powi(-8)), (DType::F16, 2f32.powi(-11))] {
        let half = |shape: &[usize], salt: usize| {
            let n = shape.iter().product();
            Tensor::from_vec(shape, values(n, salt).iter().map(|v| v * 3.0).collect()).cast(t)
        };
        let exact = |what: &str, op: &Op, inputs: &[Tensor], outs: &[Meta]| {
            let (g, c) = (run_typed(&gpu, op, inputs, outs), run_typed(&cpu, op, inputs, outs));
            for (k, (g, c)) in g.iter().zip(&c).enumerate() {
                assert_eq!(g.bytes(), c.bytes(), "{t} {what}, output {k}: the bits differ");
            }
        };
        let within_ulp = |what: &str, op: &Op, inputs: &[Tensor], outs: &[Meta]| {
            let (g, c) = (run_typed(&gpu, op, inputs, outs), run_typed(&cpu, op, inputs, outs));
            close_as_f32(&format!("{t} {what}"), &g, &c, ulp);
        };
        let (a, b) = (half(&[2, 3, 4], 1), half(&[4], 2));
        let out = [Meta::new(t, &[2, 3, 4])];
        for op in [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div] {
            exact(&format!("{op:?}"), &Op::Binary(op), &[a.clone(), b.clone()], &out);
        }
        let less = [Meta::new(DType::Bool, &[2, 3, 4])];
        exact("Less", &Op::Binary(Binary::Less), &[a.clone(), b.clone()], &less);
        for u in [Unary::Neg, Unary::Relu, Unary::Abs] {
            exact(&format!("{u:?}"), &Op::Unary(u), std::slice::from_ref(&a), &out);
        }
        within_ulp("Gelu", &Op::Unary(Unary::Gelu), std::slice::from_ref(&a), &out);
        within_ulp("GeluGrad", &Op::UnaryGrad(Unary::Gelu), &[half(&[2, 3, 4], 3), a.clone()], &out);
        let wide = Tensor::from_vec(&[2, 3, 4], values(24, 4).iter().map(|v| v * 1000.0 + 0.3).collect());
        exact("Cast from f32", &Op::Cast { to: t }, std::slice::from_ref(&wide), &out);
        exact(
            "Cast to f32",
            &Op::Cast { to: DType::F32 },
            std::slice::from_ref(&a),
            &[Meta::new(DType::F32, &[2, 3, 4])],
        );
        let dropout = Op::Dropout { ratio: 0.3, training: true, seed: 7 };
        exact("Dropout", &dropout, std::slice::from_ref(&a), &[out[0].clone(), less[0].clone()]);
        let mask =
            Tensor::from_vec(&[2, 3, 4], (0..24).map(|i| (i % 3 != 0) as u8).collect::<Vec<u8>>()).cast(DType::Bool);
        exact("DropoutGrad", &Op::DropoutGrad { ratio: 0.3 }, &[a.clone(), mask.clone()], &out);
        exact("Where", &Op::Where, &[mask, a.clone(), b.clone()], &out);
        within_ulp("ReduceSumTo", &Op::ReduceSumTo { shape: vec![4] }, std::slice::from_ref(&a), &[Meta::new(t, &[4])]);
        within_ulp(
            "ReduceSumTo (a middle axis)",
            &Op::ReduceSumTo { shape: vec![2, 1, 4] },
            std::slice::from_ref(&a),
            &[Meta::new(t, &[2, 1, 4])],
        );
        within_ulp("MatMul", &Op::MatMul, &[a.clone(), half(&[4, 5], 5)], &[Meta::new(t, &[2, 3, 5])]);
        // The bias in the product's epilogue (added by the emulator's stand-in for cuBLASLt
        // before D's rounding): the right vector, added per output column.
        let fused = Op::FusedMatMul { trans_a: false, trans_b: true, activation: None };
        let ins = [a.clone(), half(&[5, 4], 11), half(&[5], 12)];
        within_ulp("FusedMatMul with a bias", &fused, &ins, &[Meta::new(t, &[2, 3, 5])]);
        // GELU in the epilogue, keeping its input (training's MLP), and GELU's gradient in the
        // epilogue of the product that is its output's gradient.
        let gelu = Op::FusedMatMul { trans_a: false, trans_b: true, activation: Some(Unary::GeluTanh) };
        let y = Meta::new(t, &[2, 3, 5]);
        within_ulp("FusedMatMul with a bias and GELU", &gelu, &ins, &[y.clone(), y.clone()]);
        let gelu_grad = Op::MatMulUnaryGrad { trans_a: false, trans_b: true, activation: Unary::GeluTanh };
        let ins = [a.clone(), half(&[5, 4], 13), half(&[2, 3, 5], 14)];
        within_ulp("MatMulUnaryGrad of GELU", &gelu_grad, &ins, std::slice::from_ref(&y));
        // Windows: a grouped, strided convolution and its gradient, max and average pooling and
        // their gradients, global average pooling (sums of many terms: within one unit).
        let win = Window::explicit(&[3, 2], &[2, 1], &[1, 1], &[1, 0, 1, 1], false);
        let (x, w, bias) = (half(&[2, 4, 7, 6], 6), half(&[6, 2, 3, 2], 7), half(&[6], 8));
        let y_shape: Vec<usize> = [2, 6].into_iter().chain(window_output(&win, &[7, 6]).unwrap()).collect();
        let conv = Op::Conv { window: win.clone(), group: 2 };
        let conv_ins = [x.clone(), w.clone(), bias];
        let conv_outs = [Meta::new(t, &y_shape)];
        let conv_cpu = run_typed(&cpu, &conv, &conv_ins, &conv_outs);
        let grad = Op::ConvGrad { window: win, group: 2 };
        let grad_outs = [Meta::new(t, &[2, 4, 7, 6]), Meta::new(t, &[6, 2, 3, 2]), Meta::new(t, &[6])];
        let grad_ins = [half(&y_shape, 9), x.clone(), w];
        let grad_cpu = run_typed(&cpu, &grad, &grad_ins, &grad_outs);
        // The second budget (bytes of temporaries) is less than one image's: the images go
        // through one at a time (im2col, col2im and dW's product), later ones adding into dW's
        // f32 sums.
        for budget in [64 << 20, 16] {
            gpu.scratch_budget.store(budget, std::sync::atomic::Ordering::Relaxed);
            let what = format!("{t}, scratch budget {budget}");
            // The GPU rounds the product before adding the bias, the CPU once: two units apart.
            let g = run_typed(&gpu, &conv, &conv_ins, &conv_outs);
            close_as_f32(&format!("{what}: Conv"), &g, &conv_cpu, 2.0 * ulp);
            // dX sums taps of columns the GPU stored in half: a few units apart from the CPU's
            // single rounding. dW sums the products in f32 and rounds once, as the CPU does,
            // and so does dB: within a unit.
            let g = run_typed(&gpu, &grad, &grad_ins, &grad_outs);
            close_as_f32(&format!("{what}: ConvGrad's dX"), &g[..1], &grad_cpu[..1], 4.0 * ulp);
            close_as_f32(&format!("{what}: ConvGrad's dW and dB"), &g[1..], &grad_cpu[1..], ulp);
        }
        gpu.scratch_budget.store(64 << 20, std::sync::atomic::Ordering::Relaxed);
        for kind in [PoolKind::Max, PoolKind::Average { count_include_pad: false }] {
            let win = Window::explicit(&[3, 3], &[2, 2], &[1, 1], &[1, 1, 1, 1], false);
            let y_shape: Vec<usize> = [2, 4].into_iter().chain(window_output(&win, &[7, 6]).unwrap()).collect();
            let pool = Op::Pool { kind, window: win.clone() };
            within_ulp(&format!("{kind:?} pool"), &pool, std::slice::from_ref(&x), &[Meta::new(t, &y_shape)]);
            let grad = Op::PoolGrad { kind, window: win };
            within_ulp(
                &format!("{kind:?} pool gradient"),
                &grad,
                &[half(&y_shape, 10), x.clone()],
                &[Meta::new(t, &[2, 4, 7, 6])],
            );
        }
        within_ulp(
            "GlobalAveragePool",
            &Op::GlobalAveragePool,
            std::slice::from_ref(&x),
            &[Meta::new(t, &[2, 4, 1, 1])],
        );
    }
}

/// Fused attention forward and backward, causal and not, in f32, bf16 and f16. A head of 40
/// (not a multiple of the warp, lanes past it idle) runs on the warp kernels in every type; heads
/// of 16, 64, 96 and 128 in half precision run on the tensor-core kernels (attention_mma.cu),
/// both register tiers with heads that fill them and heads that do not, sequences that end
/// inside a tile, several key tiles, more tiles than one block, and fewer queries than keys;
/// some with fewer key heads than query heads (grouped-query attention), on both kernel
/// families. The tensor-core kernels round the probabilities (and the scores' gradient) to the
/// half type before their products, as FlashAttention does, so they are held to a few of its
/// units rather than one. Each case runs in each layout: [groups, T, D]; token-major
/// [B, T, H, D], whose results on the CPU are the first layout's, transposed, bit for bit; and,
/// where the heads and rows allow, packed [B, T, 3, H, D], whose results on the CPU (dq, dk and
/// dv in one dqkv) are the token-major ones, bit for bit; and
/// the CPU's grouped-query results in f32 are, bit for bit, those of its attention over the key
/// heads repeated (dk and dv summed over the repeats).
#[test]
fn fused_attention_matches_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let mut ran_on_tensor_cores = 0;
    // (groups, key groups, queries, keys, head); a causal mask needs as many queries as keys.
    let cases = [
        (3, 3, 11, 11, 40),
        (2, 2, 75, 75, 64),
        (3, 3, 9, 9, 16),
        (1, 1, 37, 37, 128),
        (2, 2, 70, 70, 96),
        (2, 2, 21, 50, 64),
        (4, 2, 75, 75, 64),
        (3, 1, 37, 37, 128),
        (6, 2, 13, 13, 40),
        // Two forward blocks of 128 query rows per group (heads up to 64), the second partial.
        (2, 1, 150, 150, 64),
    ];
    for (groups, kv_groups, tq, tk, d) in cases {
        let (q_shape, k_shape) = (vec![groups, tq, d], vec![kv_groups, tk, d]);
        // Token-major: two batch elements of groups / 2 heads, or one of all.
        let b = if groups % 2 == 0 && kv_groups % 2 == 0 { 2 } else { 1 };
        let tokens = |x: &Tensor| heads_to_tokens(&cpu, x, b, x.shape()[0] / b);
        for causal in [true, false].into_iter().filter(|&c| !c || tq == tk) {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let x = |shape: &[usize], salt: usize| {
                    let n = shape.iter().product();
                    Tensor::from_vec(shape, values(n, salt).iter().map(|v| v * 1.7).collect()).cast(dtype)
                };
                let (q, k, v, dy) = (x(&q_shape, 1), x(&k_shape, 2), x(&k_shape, 3), x(&q_shape, 4));
                let tensor_cores = dtype != DType::F32 && d % 16 == 0;
                let what = format!(
                    "Attention over heads of {d}, {groups} groups reading {kv_groups}, {tq} queries, {tk} keys, \
                     causal {causal}, {dtype}"
                );
                let unit = match dtype {
                    DType::F32 => 1e-5,
                    DType::BF16 => 2f32.powi(-8),
                    _ => 2f32.powi(-11),
                };
                let (fwd, bwd) = if tensor_cores { (2.0 * unit, 4.0 * unit) } else { (unit, 2.0 * unit) };
                let (fwd, bwd) = if dtype == DType::F32 { (1e-5, 1e-5) } else { (fwd, bwd) };
                let scale = 1.0 / (d as f32).sqrt();
                let (mut heads_first, mut token_major): (Vec<Tensor>, Vec<Tensor>) = (Vec::new(), Vec::new());
                // Packed where q, k and v can be one projection's parts: as many heads and rows.
                let packs = groups == kv_groups && tq == tk;
                let layouts = [AttentionLayout::HeadsFirst, AttentionLayout::TokenMajor, AttentionLayout::Packed];
                for layout in layouts.into_iter().filter(|&l| packs || l != AttentionLayout::Packed) {
                    let what = format!("{what}, {layout:?}");
                    let heads_first_layout = layout == AttentionLayout::HeadsFirst;
                    let lay = |x: &Tensor| if heads_first_layout { x.clone() } else { tokens(x) };
                    let lse_shape = if heads_first_layout { vec![groups, tq] } else { vec![b, groups / b, tq] };
                    let (q, k, v, dy) = (lay(&q), lay(&k), lay(&v), lay(&dy));
                    let operands = match layout {
                        AttentionLayout::Packed => vec![pack(&cpu, [&q, &k, &v])],
                        _ => vec![q.clone(), k.clone(), v.clone()],
                    };
                    let op = Op::Attention { scale, causal, layout };
                    let outs = [Meta::new(dtype, q.shape()), Meta::new(DType::F32, &lse_shape)];
                    let before = tensor_core_launches(&gpu);
                    let (g, c) = (run_typed(&gpu, &op, &operands, &outs), run_typed(&cpu, &op, &operands, &outs));
                    close_as_f32(&what, &g, &c, fwd);
                    let grad = Op::AttentionGrad { scale, causal, layout };
                    let ins: Vec<Tensor> =
                        [dy].into_iter().chain(operands.clone()).chain([c[0].clone(), c[1].clone()]).collect();
                    let outs: Vec<Meta> = operands.iter().map(|x| Meta::new(dtype, x.shape())).collect();
                    let (g, cg) = (run_typed(&gpu, &grad, &ins, &outs), run_typed(&cpu, &grad, &ins, &outs));
                    close_as_f32(&format!("{what}: gradient"), &g, &cg, bwd);
                    // The forward kernel, the backward sweep and dq's last pass; none for the warp kernels'.
                    let expected = if tensor_cores { 3 } else { 0 };
                    assert_eq!(tensor_core_launches(&gpu) - before, expected, "{what}: tensor-core launches");
                    ran_on_tensor_cores += tensor_cores as usize;
                    let results: Vec<Tensor> = c.iter().chain(&cg).cloned().collect();
                    if layout == AttentionLayout::Packed {
                        // y, lse, and dq, dk and dv packed as q, k and v were: the same bits.
                        let [y, lse, dq, dk, dv] = &token_major[..] else { unreachable!("five results") };
                        let want = [y.clone(), lse.clone(), pack(&cpu, [dq, dk, dv])];
                        let same = results.iter().zip(&want).all(|(p, t)| p.bytes() == t.bytes());
                        assert!(same, "{what}: the CPU's results differ from the token-major ones");
                        continue;
                    }
                    if heads_first_layout {
                        if kv_groups < groups && dtype == DType::F32 {
                            let ins = [ins[0].clone(), q.clone(), k.clone(), v.clone()];
                            assert_repeated_heads_agree(&cpu, &what, (scale, causal), ins, &results);
                        }
                        heads_first = results;
                        continue;
                    }
                    token_major = results.clone();
                    // y, lse (the same layout in both), dq, dk, dv.
                    for (i, (tm, hf)) in results.iter().zip(&heads_first).enumerate() {
                        let hf = if i == 1 { hf.clone().reshaped(&lse_shape) } else { tokens(hf) };
                        assert!(
                            tm.bytes() == hf.bytes(),
                            "{what}: the CPU's output {i} differs from the heads-first one"
                        );
                    }
                }
            }
        }
    }
    assert_eq!(ran_on_tensor_cores, 76);
}

/// The CPU's grouped-query attention (heads-first dY, q, k, v; its y, lse, dq, dk, dv as
/// `results`) against its attention over each key head repeated to the query heads it serves,
/// whose dk and dv are then summed over the repeats in order: the same bits.
fn assert_repeated_heads_agree(
    cpu: &CpuBackend,
    what: &str,
    (scale, causal): (f32, bool),
    [dy, q, k, v]: [Tensor; 4],
    results: &[Tensor],
) {
    let (groups, kv_groups) = (q.shape()[0], k.shape()[0]);
    let rep = groups / kv_groups;
    let widen = |x: &Tensor| x.cast(DType::F32).as_slice::<f32>().to_vec();
    let repeat = |x: &Tensor| {
        let (rows, per) = (x.shape()[1], x.shape()[1] * x.shape()[2]);
        let all: Vec<f32> = widen(x).chunks(per).flat_map(|head| (0..rep).flat_map(move |_| head.to_vec())).collect();
        Tensor::from_vec(&[groups, rows, x.shape()[2]], all).cast(x.dtype())
    };
    let (k_all, v_all) = (repeat(&k), repeat(&v));
    let outs = [Meta::new(q.dtype(), q.shape()), Meta::new(DType::F32, &q.shape()[..2])];
    let op = Op::Attention { scale, causal, layout: AttentionLayout::HeadsFirst };
    let mut all = run_typed(cpu, &op, &[q.clone(), k_all.clone(), v_all.clone()], &outs);
    let grad = Op::AttentionGrad { scale, causal, layout: AttentionLayout::HeadsFirst };
    let ins = [dy, q.clone(), k_all.clone(), v_all, all[0].clone(), all[1].clone()];
    let outs =
        [Meta::new(q.dtype(), q.shape()), Meta::new(q.dtype(), k_all.shape()), Meta::new(q.dtype(), k_all.shape())];
    all.extend(run_typed(cpu, &grad, &ins, &outs));
    // dk and dv of the repeated heads, each summed over its repeats.
    for which in [3, 4] {
        let per = k.numel();
        let summed: Vec<f32> = widen(&all[which])
            .chunks(per / kv_groups * rep)
            .flat_map(|reps| {
                let chunks: Vec<&[f32]> = reps.chunks(per / kv_groups).collect();
                (0..per / kv_groups).map(move |e| chunks.iter().skip(1).fold(chunks[0][e], |s, c| s + c[e]))
            })
            .collect();
        all[which] = Tensor::from_vec(k.shape(), summed).cast(k.dtype());
    }
    for (i, (got, want)) in results.iter().zip(&all).enumerate() {
        assert!(got.bytes() == want.bytes(), "{what}: output {i} differs from the repeated heads'");
    }
}

/// [B·H, T, D] → [B, T, H, D], by the CPU's Transpose.
/// Token-major q, k and v [b, t, h, d] as one packed operand [b, t, 3, h, d].
fn pack(cpu: &CpuBackend, parts: [&Tensor; 3]) -> Tensor {
    let s = parts[0].shape();
    let (lone, packed) = ([s[0], s[1], 1, s[2], s[3]], [s[0], s[1], 3, s[2], s[3]]);
    let lone = parts.map(|x| x.clone().reshaped(&lone));
    run_typed(cpu, &Op::Concat { axis: 2 }, &lone, &[Meta::new(parts[0].dtype(), &packed)]).remove(0)
}

fn heads_to_tokens(cpu: &CpuBackend, x: &Tensor, b: usize, h: usize) -> Tensor {
    let (t, d) = (x.shape()[1], x.shape()[2]);
    let op = Op::Transpose { perm: Some(vec![0, 2, 1, 3]) };
    run_typed(cpu, &op, &[x.clone().reshaped(&[b, h, t, d])], &[Meta::new(x.dtype(), &[b, t, h, d])]).remove(0)
}

/// LayerNorm and RMSNorm (`rms`) forward and backward against the CPU's, with Y written and dY
/// read in f32, bf16 and f16 (`layer_norm_casts`), over rows of a few columns to more than a
/// block's threads, after a residual add (`residual_layer_norm`), and the gradient with another
/// added to dX (`layer_norm_grad_add`) and with dX's half copy (`layer_norm_grad_half`).
#[test]
fn layer_norm_matches_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    // Few rows and many (the column sums' chunks of 64 rows: 3, and 33 with a last of 53 rows),
    // few columns and many more than a block's threads.
    let shapes = [(130, 48), (2101, 40), (3, 768), (2, 4096 + 40), (2, 8192 + 64)];
    for (rows, cols) in shapes {
        let x = |shape: &[usize], salt: usize| Tensor::from_vec(shape, values(shape.iter().product(), salt));
        let (a, scale, bias, dy) = (x(&[rows, cols], 1), x(&[cols], 2), x(&[cols], 3), x(&[rows, cols], 4));
        let added = x(&[rows, cols], 5);
        let stat = Meta::new(DType::F32, &[rows, 1]);
        for (half, rms) in [DType::F32, DType::BF16, DType::F16].into_iter().flat_map(|h| [(h, false), (h, true)]) {
            let what = format!("{} of [{rows}, {cols}], {half} Y and dY", if rms { "RMSNorm" } else { "LayerNorm" });
            let ln = Op::LayerNorm { axis: -1, epsilon: 1e-5, rms };
            let outs = [Meta::new(half, &[rows, cols]), stat.clone(), stat.clone()];
            let ins = if rms { vec![a.clone(), scale.clone()] } else { vec![a.clone(), scale.clone(), bias.clone()] };
            let (g, c) = (run_typed(&gpu, &ln, &ins, &outs), run_typed(&cpu, &ln, &ins, &outs));
            close_as_f32(&what, &g, &c, if half == DType::F32 { 1e-5 } else { 2f32.powi(-8) });
            // With the residual add before it (residual_layer_norm): the branch of Y's type, the
            // sum written exactly, Y and the statistics as the LayerNorm's of the sum.
            let residual = Op::ResidualLayerNorm { axis: -1, epsilon: 1e-5, rms };
            let branch = added.cast(half);
            let mut r_ins = vec![a.clone(), branch.clone(), scale.clone()];
            r_ins.extend((!rms).then(|| bias.clone()));
            let r_outs = [outs[0].clone(), Meta::new(DType::F32, &[rows, cols]), stat.clone(), stat.clone()];
            let (g_r, c_r) = (run_typed(&gpu, &residual, &r_ins, &r_outs), run_typed(&cpu, &residual, &r_ins, &r_outs));
            let widened = branch.cast(DType::F32);
            let sum: Vec<f32> = a.as_slice::<f32>().iter().zip(widened.as_slice::<f32>()).map(|(x, b)| x + b).collect();
            close_as_f32(
                &format!("{what}: the residual's sum"),
                &g_r[1..2],
                &[Tensor::from_vec(&[rows, cols], sum)],
                0.0,
            );
            close_as_f32(
                &format!("{what} after a residual add"),
                &g_r,
                &c_r,
                if half == DType::F32 { 1e-5 } else { 2f32.powi(-8) },
            );
            let mut ins = vec![dy.cast(half), a.clone(), scale.clone(), c[1].clone(), c[2].clone()];
            let grad = Op::LayerNormGrad { axis: -1, rms };
            let f32s = |shape: &[usize]| Meta::new(DType::F32, shape);
            let outs = [f32s(&[rows, cols]), f32s(&[cols]), f32s(&[cols])];
            let (g, c) = (run_typed(&gpu, &grad, &ins, &outs), run_typed(&cpu, &grad, &ins, &outs));
            close_as_f32(&format!("{what}: gradient"), &g, &c, 1e-5);
            // With a gradient added to dX (layer_norm_grad_add): dX plus it, the sums unchanged.
            ins.push(added.clone());
            let (g_added, c_added) = (run_typed(&gpu, &grad, &ins, &outs), run_typed(&cpu, &grad, &ins, &outs));
            let sum: Vec<f32> =
                c[0].as_slice::<f32>().iter().zip(added.as_slice::<f32>()).map(|(d, e)| d + e).collect();
            let expected = [Tensor::from_vec(&[rows, cols], sum), c[1].clone(), c[2].clone()];
            close_as_f32(&format!("{what}: gradient plus another (CPU)"), &c_added, &expected, 1e-5);
            close_as_f32(&format!("{what}: gradient plus another"), &g_added, &c_added, 1e-5);
            if half == DType::F32 {
                continue;
            }
            // With dX's half copy as well (layer_norm_grad_half): dX rounded, bit for bit.
            let copying = [&outs[..], &[Meta::new(half, &[rows, cols])]].concat();
            let (g_half, c_half) = (run_typed(&gpu, &grad, &ins, &copying), run_typed(&cpu, &grad, &ins, &copying));
            for (who, run) in [("emulated", &g_half), ("CPU", &c_half)] {
                let rounded = run[0].cast(half);
                assert!(run[3] == rounded, "{what}: the {who} half copy of dX is not dX rounded");
            }
            close_as_f32(&format!("{what}: gradient with its half copy"), &g_half[..3], &c_half[..3], 1e-5);
            close_as_f32(&format!("{what}: dX's half copy"), &g_half[3..], &c_half[3..], 2f32.powi(-8));
        }
    }
    let launches = launches_of(&gpu, &["layer_norm"]);
    let per_type = |family: &str| ["f32", "f16", "bf16"].map(|t| launches.get(&format!("{family}_{t}")).copied());
    // The gradient: each shape and norm plain, with a gradient added, and (half dY) with dX's
    // half copy as well.
    let grads = [Some(20), Some(30), Some(30)];
    assert_eq!((per_type("layer_norm_rows"), per_type("layer_norm_grad_rows")), ([Some(20); 3], grads));
}

/// The attention kernels' loops over more rows (the warp kernels, f32) and tiles (the tensor-core
/// kernels, bf16) than their grid has blocks: with a grid of 2 blocks the same results, bit for
/// bit, as with a block for every tile.
#[test]
fn attention_kernels_stride_past_their_grid_on_the_emulated_kernels() {
    use std::sync::atomic::Ordering;
    let gpu = EmulatedGpu::new();
    // Two tiles of queries (forward) and three of keys (backward) per group.
    let (groups, t, d) = (2, 150, 64);
    let shape = vec![groups, t, d];
    let (scale, causal) = (0.125, true);
    for dtype in [DType::F32, DType::BF16] {
        let x = |salt: usize| Tensor::from_vec(&shape, values(groups * t * d, salt)).cast(dtype);
        let (q, k, v, dy) = (x(1), x(2), x(3), x(4));
        let run = |limit: usize| {
            gpu.attention_grid_limit.store(limit, Ordering::Relaxed);
            let outs = [Meta::new(dtype, &shape), Meta::new(DType::F32, &[groups, t])];
            let op = Op::Attention { scale, causal, layout: AttentionLayout::HeadsFirst };
            let mut all = run_typed(&gpu, &op, &[q.clone(), k.clone(), v.clone()], &outs);
            let ins = [dy.clone(), q.clone(), k.clone(), v.clone(), all[0].clone(), all[1].clone()];
            let outs = [Meta::new(dtype, &shape), Meta::new(dtype, &shape), Meta::new(dtype, &shape)];
            all.extend(run_typed(
                &gpu,
                &Op::AttentionGrad { scale, causal, layout: AttentionLayout::HeadsFirst },
                &ins,
                &outs,
            ));
            all
        };
        let (wide, narrow) = (run(1 << 20), run(2));
        gpu.attention_grid_limit.store(1 << 20, Ordering::Relaxed);
        for (k, (w, n)) in wide.iter().zip(&narrow).enumerate() {
            assert!(w.bytes() == n.bytes(), "{dtype}, output {k} of y, lse, dq, dk, dv: differs on a grid of 2 blocks");
        }
    }
}

/// The launches so far of the kernels whose names start with one of `prefixes`, by name.
fn launches_of(gpu: &EmulatedGpu, prefixes: &[&str]) -> BTreeMap<String, usize> {
    let launches = gpu.launches.lock().unwrap();
    launches
        .iter()
        .filter(|(name, _)| prefixes.iter().any(|p| name.starts_with(p)))
        .map(|(k, &n)| (k.clone(), n))
        .collect()
}

fn tensor_core_launches(gpu: &EmulatedGpu) -> usize {
    let launches = gpu.launches.lock().unwrap();
    launches.iter().filter(|(name, _)| name.starts_with("attention_mma")).map(|(_, n)| n).sum()
}

/// Where cuBLASLt offers no algorithm for an epilogue, the backend runs the product plain and
/// applies the bias, the GELU (keeping its input or not) or the GELU's gradient with kernels
/// after it (`launch::apply_epilogue`); the emulator declines every epilogue here, and the
/// results still match the CPU's (in bf16 within a unit: the kernels' GELU reads D rounded).
#[test]
fn epilogues_applied_after_a_plain_product_match_the_cpu_backend() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    gpu.declines_epilogues.store(true, std::sync::atomic::Ordering::Relaxed);
    for (t, tol) in [(DType::F32, 1e-6), (DType::BF16, 2f32.powi(-7))] {
        let x = |shape: &[usize], salt: usize| {
            let n = shape.iter().product();
            Tensor::from_vec(shape, values(n, salt).iter().map(|v| v * 3.0).collect()).cast(t)
        };
        let (a, w, bias, pre) = (x(&[2, 3, 4], 1), x(&[8, 4], 2), x(&[8], 3), x(&[2, 3, 8], 4));
        let y = Meta::new(t, &[2, 3, 8]);
        let fused = |activation| Op::FusedMatMul { trans_a: false, trans_b: true, activation };
        let gelu_grad = Op::MatMulUnaryGrad { trans_a: false, trans_b: true, activation: Unary::GeluTanh };
        let with_bias = [a.clone(), w.clone(), bias];
        let cases = [
            ("a bias", fused(None), &with_bias[..], 1),
            ("a bias and GELU", fused(Some(Unary::GeluTanh)), &with_bias[..], 1),
            ("a bias and GELU, keeping its input", fused(Some(Unary::GeluTanh)), &with_bias[..], 2),
            ("GELU without a bias", fused(Some(Unary::GeluTanh)), &with_bias[..2], 2),
            ("GELU's gradient", gelu_grad, &[a.clone(), w.clone(), pre.clone()][..], 1),
        ];
        for (what, op, ins, outputs) in cases {
            let outs = vec![y.clone(); outputs];
            let (g, c) = (run_typed(&gpu, &op, ins, &outs), run_typed(&cpu, &op, ins, &outs));
            close_as_f32(&format!("{t} product with {what} applied after it"), &g, &c, tol);
        }
    }
    let declined = gpu.launches.lock().unwrap().get("unary_f32").copied().unwrap_or(0);
    assert!(declined > 0, "no epilogue ran as a kernel");
}

/// Adasum's kernels (`Backend::adasum`) against `kernels::adasum::combine_pair`: tensors of
/// several 32 Ki-element pieces and a remainder, an empty one, all at offsets in one buffer per
/// side; the lower and the higher partner end with the same bits.
#[test]
fn adasum_kernels_match_the_cpu_combination_on_the_emulated_kernels() {
    use tensorfleet_worker::backend::Arg;
    use tensorfleet_worker::kernels::adasum::combine_pair;
    let gpu = EmulatedGpu::new();
    let sizes = [2 * 32768 + 1234, 0, 77, 40000];
    let metas: Vec<Meta> = sizes.iter().map(|&n| Meta::new(DType::F32, &[n])).collect();
    // Offsets of 64 bytes past each tensor, as the executor lays values out.
    let offsets: Vec<usize> =
        sizes.iter().scan(64, |at, &n| Some(std::mem::replace(at, *at + (4 * n).next_multiple_of(64) + 64))).collect();
    let bytes = offsets.last().unwrap() + 4 * sizes.last().unwrap();
    let side = |salt: usize| -> Vec<Vec<f32>> {
        sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| values(n, salt + k).iter().map(|v| v * (k + 1) as f32).collect())
            .collect()
    };
    let (lower, higher) = (side(1), side(7));
    // One partner's view: its values and the other's, combined with its role; what it ends with.
    let combine_on_gpu = |mine: &[Vec<f32>], theirs: &[Vec<f32>], mine_is_lower: bool| -> Vec<Vec<f32>> {
        let (m_buf, t_buf) = (gpu.alloc(bytes).unwrap(), gpu.alloc(bytes).unwrap());
        let args =
            |buf| -> Vec<_> { offsets.iter().zip(&metas).map(|(&offset, meta)| Arg { buf, offset, meta }).collect() };
        let (m_args, t_args): (Vec<_>, Vec<_>) = (args(&m_buf), args(&t_buf));
        for (k, n) in sizes.iter().enumerate() {
            gpu.upload(&Tensor::from_vec(&[*n], mine[k].clone()), m_args[k]).unwrap();
            gpu.upload(&Tensor::from_vec(&[*n], theirs[k].clone()), t_args[k]).unwrap();
        }
        gpu.adasum(&m_args, &t_args, mine_is_lower).unwrap();
        m_args.iter().map(|a| gpu.download(*a).unwrap().as_slice::<f32>().to_vec()).collect()
    };
    let low = combine_on_gpu(&lower, &higher, true);
    let high = combine_on_gpu(&higher, &lower, false);
    for (k, n) in sizes.iter().enumerate() {
        assert!(
            low[k].iter().zip(&high[k]).all(|(a, b)| a.to_bits() == b.to_bits()),
            "tensor {k}: the partners differ"
        );
        let (mut want, mut other) = (lower[k].clone(), higher[k].clone());
        combine_pair(&mut want, &mut other, true);
        let largest = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let worst = low[k].iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 1e-6 * largest, "tensor {k} of {n}: differs from the CPU's combination by {worst}");
    }
}

/// Products with nothing to multiply, which never reach cuBLASLt: no terms (an inner dim of 0:
/// the bias alone, through GELU), no rows, no batch.
#[test]
fn empty_products_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let empty = |shape: &[usize]| Tensor::from_vec(shape, Vec::<f32>::new());
    let bias = Tensor::from_vec(&[3], vec![0.5f32, -1.0, 2.0]);
    let fused = Op::FusedMatMul { trans_a: false, trans_b: false, activation: Some(Unary::GeluTanh) };
    let no_terms = [empty(&[2, 0]), empty(&[0, 3]), bias];
    let outs = [Meta::new(DType::F32, &[2, 3]), Meta::new(DType::F32, &[2, 3])];
    let (g, c) = (run_typed(&gpu, &fused, &no_terms, &outs), run_typed(&cpu, &fused, &no_terms, &outs));
    assert_close("a product of no terms with a bias and GELU", &g, &c);
    assert!(g[0].as_slice::<f32>().iter().all(|v| *v != 0.0), "the bias went through GELU: {:?}", g[0]);
    let matmul = Op::MatMul;
    for (what, a, b, y) in [
        ("no rows", empty(&[0, 4]), Tensor::from_vec(&[4, 3], values(12, 1)), vec![0, 3]),
        ("no batch", empty(&[0, 2, 4]), Tensor::from_vec(&[0, 4, 3], Vec::<f32>::new()), vec![0, 2, 3]),
        ("no terms", empty(&[3, 0]), empty(&[0, 2]), vec![3, 2]),
    ] {
        let ins = [a, b];
        let outs = std::slice::from_ref(&y);
        assert_close(what, &run_op(&gpu, &matmul, &ins, outs), &run_op(&cpu, &matmul, &ins, outs));
    }
}

/// Tensor parallelism's vocab-parallel ops and the row reductions, one at a time: ids and
/// labels inside and outside this rank's slice, an ignored label, each loss reduction.
#[test]
fn tensor_parallel_ops_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let check = |what: &str, op: &Op, inputs: &[Tensor], shapes: &[Vec<usize>]| {
        assert_close(what, &run_op(&gpu, op, inputs, shapes), &run_op(&cpu, op, inputs, shapes));
    };
    // The embedding's rows 3..8 of a 10-row table.
    let table = Tensor::from_vec(&[5, 4], values(20, 1));
    let ids = Tensor::from_vec(&[2, 3], vec![0i64, 3, 7, 9, 5, 3]);
    check("ShardGather", &Op::ShardGather { start: 3 }, &[table, ids.clone()], &[vec![2, 3, 4]]);
    let dy = Tensor::from_vec(&[2, 3, 4], values(24, 2));
    check("ShardGatherGrad", &Op::ShardGatherGrad { start: 3, rows: 5 }, &[dy, ids], &[vec![5, 4]]);
    // Classes 7..14 of 20, six rows; labels in the slice, before it, just past it, one ignored.
    let scores = Tensor::from_vec(&[6, 7], values(42, 3));
    let labels = Tensor::from_vec(&[6], vec![7i64, 13, 2, -100, 10, 14]);
    let max = Tensor::from_vec(&[6], values(6, 4).iter().map(|v| v + 1.5).collect());
    let ignore_index = Some(-100);
    let shard = Op::VocabShardCrossEntropy { start: 7, classes: 20, ignore_index };
    check("VocabShardCrossEntropy", &shard, &[scores.clone(), labels.clone(), max.clone()], &[vec![6], vec![6]]);
    let (dsums, dtargets) = (Tensor::from_vec(&[6], values(6, 5)), Tensor::from_vec(&[6], values(6, 6)));
    let grad = Op::VocabShardCrossEntropyGrad { start: 7, ignore_index };
    check("VocabShardCrossEntropyGrad", &grad, &[dsums, dtargets, scores.clone(), labels.clone(), max], &[vec![6, 7]]);
    let sums = Tensor::from_vec(&[6], values(6, 7).iter().map(|v| v + 2.0).collect());
    let targets = Tensor::from_vec(&[6], values(6, 8));
    for (reduction, shape) in
        [(LossReduction::Mean, vec![]), (LossReduction::Sum, vec![]), (LossReduction::None, vec![6])]
    {
        let what = format!("VocabParallelLoss, {reduction:?}");
        let loss = Op::VocabParallelLoss { reduction, ignore_index };
        check(&what, &loss, &[sums.clone(), targets.clone(), labels.clone()], std::slice::from_ref(&shape));
        let dloss = Tensor::from_vec(&shape, values(shape.iter().product(), 9));
        let grad = Op::VocabParallelLossGrad { reduction, ignore_index };
        check(&format!("{what}: gradient"), &grad, &[dloss, sums.clone(), labels.clone()], &[vec![6], vec![6]]);
    }
    // Reductions over trailing axes.
    let x = Tensor::from_vec(&[2, 3, 4], values(24, 10));
    for kind in [Reduce::Max, Reduce::Min, Reduce::Sum, Reduce::Mean, Reduce::SumSquare] {
        for (axes, shape) in [(vec![2], vec![2, 3]), (vec![2, 1], vec![2])] {
            let op = Op::ReduceOp { kind, axes: Some(axes.clone()), keepdims: false, noop_with_empty_axes: false };
            check(&format!("{kind:?} over {axes:?}"), &op, std::slice::from_ref(&x), &[shape]);
        }
    }
}

const EVERY_TYPE: [DType; 13] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::F64,
    DType::I8,
    DType::U8,
    DType::I16,
    DType::U16,
    DType::I32,
    DType::U32,
    DType::I64,
    DType::U64,
    DType::Bool,
];

/// Outputs equal bit for bit (any NaN equal to any NaN).
fn assert_same_values(what: &str, gpu: &[Tensor], cpu: &[Tensor]) {
    for (k, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        assert_eq!(g.dtype(), c.dtype(), "{what}, output {k}: element types");
        let (gv, cv) = (g.to_f64_vec(), c.to_f64_vec());
        let same = if g.dtype().is_float() {
            gv.iter().zip(&cv).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
        } else {
            g.bytes() == c.bytes()
        };
        assert!(same, "{what}, output {k} ({}): GPU {gv:?}\n  CPU {cv:?}", g.dtype());
    }
}

/// A column of `t`'s edge values: for an integer type [MIN, −1 (MAX for an unsigned type), 0,
/// 1, 3, 7, MAX], for a float type [−∞, −1, 0, 1, 3, 7, ∞, NaN].
fn edge_column(t: DType) -> Tensor {
    macro_rules! ints {
        ($t:ty) => {
            Tensor::from_vec(&[7], vec![<$t>::MIN, <$t>::MIN.wrapping_add(<$t>::MAX), 0, 1, 3, 7, <$t>::MAX])
        };
    }
    match t {
        DType::I8 => ints!(i8),
        DType::U8 => ints!(u8),
        DType::I16 => ints!(i16),
        DType::U16 => ints!(u16),
        DType::I32 => ints!(i32),
        DType::U32 => ints!(u32),
        DType::I64 => ints!(i64),
        DType::U64 => ints!(u64),
        _ => Tensor::from_vec(&[8], vec![f64::NEG_INFINITY, -1.0, 0.0, 1.0, 3.0, 7.0, f64::INFINITY, f64::NAN]).cast(t),
    }
}

/// Cast between every pair of element types, arithmetic and comparisons at the edges of each
/// numeric type (wrapping, division by zero, MIN / −1, saturating Pow, NaN through Max and
/// Min), Pow with an exponent of another type, and the reductions of the types that reduce in
/// f64: all equal to the CPU backend's results.
#[test]
fn every_element_type_matches_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let check = |what: &str, op: &Op, ins: &[Tensor], outs: &[Meta]| {
        assert_same_values(what, &run_typed(&gpu, op, ins, outs), &run_typed(&cpu, op, ins, outs));
    };

    // Integers' ends and wraps, fractions, a subnormal f32, and halfway cases of the half types'
    // rounding (an f32 just past bf16's halfway point, an f64 just below one, an int32 that
    // rounds up to bf16 from f32, an f64 just past f16's halfway point).
    let edges: Vec<f64> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        2.5,
        -2.5,
        127.9,
        128.0,
        -129.0,
        255.0,
        256.0,
        65535.5,
        -32769.0,
        3e9,
        -3e9,
        1e19,
        -1e10,
        3e38,
        1e-40,
        0.1,
        f32::from_bits(0x3F80_8001) as f64,
        1.0 + 2f64.powi(-7) + 2f64.powi(-8) - 2f64.powi(-30),
        1086324735.0,
        1.0 + 2f64.powi(-11) + 2f64.powi(-40),
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
    ];
    let edges = Tensor::from_vec(&[edges.len()], edges);
    for from in EVERY_TYPE {
        let x = edges.cast(from);
        for to in EVERY_TYPE {
            let outs = [Meta::new(to, x.shape())];
            check(&format!("Cast {from} to {to}"), &Op::Cast { to }, std::slice::from_ref(&x), &outs);
        }
    }

    let ops = [
        Binary::Add,
        Binary::Sub,
        Binary::Mul,
        Binary::Div,
        Binary::Pow,
        Binary::Max,
        Binary::Min,
        Binary::Equal,
        Binary::Less,
        Binary::Greater,
        Binary::LessOrEqual,
        Binary::GreaterOrEqual,
    ];
    for t in EVERY_TYPE.into_iter().filter(|t| *t != DType::Bool) {
        // Every pair of edge values: a column against a row.
        let column = edge_column(t);
        let k = column.numel();
        let (a, b) = (column.clone().reshaped(&[k, 1]), column.reshaped(&[1, k]));
        for op in ops {
            let out = if op.is_predicate() { DType::Bool } else { t };
            check(&format!("{op:?} of {t}"), &Op::Binary(op), &[a.clone(), b.clone()], &[Meta::new(out, &[k, k])]);
        }
        if t != DType::F32 {
            let pow = Op::Binary(Binary::Pow);
            let exponents = Tensor::from_vec(&[1, 3], vec![0.5f32, 2.0, -1.0]);
            check(&format!("Pow of {t} to f32 exponents"), &pow, &[a.clone(), exponents], &[Meta::new(t, &[k, 3])]);
            let bases = Tensor::from_vec(&[2, 1], vec![2.0f32, -1.5]);
            let outs = [Meta::new(DType::F32, &[2, k])];
            check(&format!("Pow of f32 to {t} exponents"), &pow, &[bases, b.clone()], &outs);
        }
    }

    let grid: Vec<f64> = (0..24).map(|i| ((i * 37 % 19) as f64 - 9.0) * 1.5).collect();
    let grid = Tensor::from_vec(&[2, 3, 4], grid);
    for t in
        [DType::F64, DType::I32, DType::U8, DType::I8, DType::I64, DType::U64, DType::Bool, DType::F16, DType::BF16]
    {
        let x = grid.cast(t);
        for kind in [Reduce::Sum, Reduce::Mean, Reduce::Max, Reduce::Min, Reduce::SumSquare] {
            for (axes, shape) in [(vec![2], vec![2, 3]), (vec![0, 2], vec![3])] {
                let op = Op::ReduceOp { kind, axes: Some(axes.clone()), keepdims: false, noop_with_empty_axes: false };
                let what = format!("{kind:?} of {t} over {axes:?}");
                check(&what, &op, std::slice::from_ref(&x), &[Meta::new(t, &shape)]);
            }
        }
    }
}

/// Softmax and LogSoftmax over an axis that is not the last, forward and backward (the strided
/// kernels; the last axis is GPT-2's and trained above).
#[test]
fn softmax_over_a_leading_axis_matches_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let shape = vec![2, 3, 4];
    let x = Tensor::from_vec(&shape, values(24, 12));
    let dy = Tensor::from_vec(&shape, values(24, 13));
    for axis in [0, 1] {
        for (forward, backward) in
            [(Op::Softmax { axis }, Op::SoftmaxGrad { axis }), (Op::LogSoftmax { axis }, Op::LogSoftmaxGrad { axis })]
        {
            let shapes = std::slice::from_ref(&shape);
            let (g, c) = (
                run_op(&gpu, &forward, std::slice::from_ref(&x), shapes),
                run_op(&cpu, &forward, std::slice::from_ref(&x), shapes),
            );
            assert_close(&format!("{forward:?}"), &g, &c);
            let inputs = [dy.clone(), c[0].clone()];
            assert_close(
                &format!("{backward:?}"),
                &run_op(&gpu, &backward, &inputs, shapes),
                &run_op(&cpu, &backward, &inputs, shapes),
            );
        }
    }
}

/// SoftmaxCrossEntropyLoss over [N, C, d1, d2] scores (moved to rows of C and back), with an
/// ignored label and class weights, forward and backward.
#[test]
fn cross_entropy_over_spatial_scores_matches_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let (n, c, d) = (2, 5, [3, 2]);
    let scores = Tensor::from_vec(&[n, c, d[0], d[1]], values(n * c * 6, 14));
    let labels = Tensor::from_vec(&[n, d[0], d[1]], vec![0i64, 4, 2, -1, 1, 3, 3, 0, 4, 2, 1, 1]);
    let weights = Tensor::from_vec(&[c], vec![1.0f32, 0.5, 2.0, 1.5, 0.25]);
    for reduction in [LossReduction::Mean, LossReduction::Sum, LossReduction::None] {
        let loss_shape = if reduction == LossReduction::None { vec![n, d[0], d[1]] } else { vec![] };
        let forward = Op::SoftmaxCrossEntropyLoss { reduction, ignore_index: Some(-1) };
        let inputs = [scores.clone(), labels.clone(), weights.clone()];
        let shapes = [loss_shape.clone(), scores.shape().to_vec()];
        let (g, c_out) = (run_op(&gpu, &forward, &inputs, &shapes), run_op(&cpu, &forward, &inputs, &shapes));
        assert_close(&format!("SoftmaxCrossEntropyLoss, {reduction:?}"), &g, &c_out);
        let dloss = Tensor::from_vec(&loss_shape, values(loss_shape.iter().product(), 15));
        let backward = Op::SoftmaxCrossEntropyLossGrad { reduction, ignore_index: Some(-1) };
        let inputs = [dloss, c_out[1].clone(), labels.clone(), weights.clone()];
        let shapes = [scores.shape().to_vec()];
        assert_close(
            &format!("SoftmaxCrossEntropyLossGrad, {reduction:?}"),
            &run_op(&gpu, &backward, &inputs, &shapes),
            &run_op(&cpu, &backward, &inputs, &shapes),
        );
    }
}

/// A class label past the classes is bad data on both backends: the CPU's kernel refuses it at
/// once; the GPU's records it in the fault word and the next wait reports it. Either way the
/// worker exits 3 (corrupt input), where the GPU's used to read as a retryable failure (exit 1)
/// and restart the gang into the same label.
#[test]
fn a_label_past_the_classes_is_bad_data_on_both_backends() {
    use tensorfleet_worker::backend::{Arg, BackendError};
    use tensorfleet_worker::error::Error;
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let scores = Tensor::from_vec(&[2, 3], values(6, 3));
    let labels = Tensor::from_vec(&[2], vec![1i64, 7]);
    let op = Op::SoftmaxCrossEntropyLoss { reduction: LossReduction::Mean, ignore_index: None };
    fn launch<B: Backend>(b: &B, op: &Op, inputs: &[&Tensor]) -> Result<(), BackendError> {
        let metas: Vec<Meta> = inputs.iter().map(|t| Meta::new(t.dtype(), t.shape())).collect();
        let outs = [Meta::new(DType::F32, &[]), Meta::new(DType::F32, &[2, 3])];
        let bufs: Vec<B::Buffer> = metas.iter().chain(&outs).map(|m| b.alloc(m.bytes()).unwrap()).collect();
        for (i, t) in inputs.iter().enumerate() {
            b.upload(t, Arg { buf: &bufs[i], offset: 0, meta: &metas[i] }).unwrap();
        }
        let ins: Vec<_> = metas.iter().zip(&bufs).map(|(m, buf)| Some(Arg { buf, offset: 0, meta: m })).collect();
        let out: Vec<_> = outs.iter().zip(&bufs[2..]).map(|(m, buf)| Arg { buf, offset: 0, meta: m }).collect();
        b.launch(op, &ins, &out, None)?;
        b.synchronize()
    }
    for (name, result) in
        [("cpu", launch(&cpu, &op, &[&scores, &labels])), ("gpu", launch(&gpu, &op, &[&scores, &labels]))]
    {
        let e = result.expect_err(name);
        assert!(matches!(e, BackendError::BadData(_)), "{name}: {e:?}");
        assert_eq!(Error::from(e).exit_code(), 3, "{name}");
    }
    // The fault is reported once: the next work on the GPU runs clean.
    let fine = Tensor::from_vec(&[2], vec![1i64, 2]);
    launch(&gpu, &op, &[&scores, &fine]).unwrap();
}

/// The cross-entropy's kernels on scores of each float type (mixed precision's loss reads bf16
/// logits as they are), over rows wider than a block, with masked classes (−∞) where a thread's
/// first elements are, in the middle and at the end: the loss and the log-probabilities against
/// the CPU's (a masked class's log-probability is −∞ on both), and the gradient written in the
/// scores' type.
#[test]
fn cross_entropy_reads_half_scores_and_masked_classes_like_the_cpu_backend() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let (rows, cols) = (3, 300);
    let masked = |r: usize, j: usize| j < 3 || (r == 1 && (j == 256 || j == 257)) || (r == 2 && j >= 290);
    let scores: Vec<f32> = (0..rows * cols)
        .map(|i| if masked(i / cols, i % cols) { f32::NEG_INFINITY } else { ((i * 37 % 101) as f32 / 20.0) - 2.5 })
        .collect();
    let labels = Tensor::from_vec(&[rows], vec![5i64, 100, 289]);
    for t in [DType::F32, DType::BF16, DType::F16] {
        let scores = Tensor::from_vec(&[rows, cols], scores.clone()).cast(t);
        let forward = Op::SoftmaxCrossEntropyLoss { reduction: LossReduction::Mean, ignore_index: None };
        let outs = [Meta::new(DType::F32, &[]), Meta::new(DType::F32, &[rows, cols])];
        let inputs = [scores.clone(), labels.clone()];
        let (g, c) = (run_typed(&gpu, &forward, &inputs, &outs), run_typed(&cpu, &forward, &inputs, &outs));
        let (gl, cl) = (g[0].to_f64_vec()[0], c[0].to_f64_vec()[0]);
        assert!(gl.is_finite() && (gl - cl).abs() <= 1e-5 * cl.abs(), "{t}: loss {gl} on the GPU, {cl} on the CPU");
        for (i, (a, b)) in g[1].to_f64_vec().iter().zip(c[1].to_f64_vec()).enumerate() {
            let same = if masked(i / cols, i % cols) {
                *a == f64::NEG_INFINITY && b == f64::NEG_INFINITY
            } else {
                (a - b).abs() <= 1e-5
            };
            assert!(same, "{t}: log-probability {i}: {a} on the GPU, {b} on the CPU");
        }
        let backward = Op::SoftmaxCrossEntropyLossGrad { reduction: LossReduction::Mean, ignore_index: None };
        let inputs = [Tensor::from_vec(&[], vec![1.5f32]), c[1].clone(), labels.clone()];
        let outs = [Meta::new(t, &[rows, cols])];
        let (g, c) = (run_typed(&gpu, &backward, &inputs, &outs), run_typed(&cpu, &backward, &inputs, &outs));
        assert_eq!(g[0].dtype(), t);
        // Within rounding: the CPU's exp gives about 1e-38 rather than 0 below −87 (fastmath.rs).
        close_as_f32(&format!("the gradient in {t}"), &g, &c, if t == DType::F32 { 1e-6 } else { 1e-2 });
    }
}

/// The log-sum-exp form of the loss (fuse::loss_lse) against the log-probability form, on each
/// backend, for each float type, reduction, class weights and an ignored label: the same loss
/// and the same gradient, bit for bit (both compute exp(x − lse) from the same lse), and the GPU's
/// within rounding of the CPU's.
#[test]
fn cross_entropy_keeping_log_sum_exp_gives_the_same_bits_on_both_backends() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let (rows, cols) = (4, 300);
    let scores: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 / 20.0) - 2.5).collect();
    let labels = Tensor::from_vec(&[rows], vec![5i64, -1, 299, 0]);
    let weights = Tensor::from_vec(&[cols], (0..cols).map(|j| 0.5 + (j % 4) as f32 / 4.0).collect());
    for t in [DType::F32, DType::BF16, DType::F16] {
        let scores = Tensor::from_vec(&[rows, cols], scores.clone()).cast(t);
        for reduction in [LossReduction::Mean, LossReduction::Sum, LossReduction::None] {
            let what = format!("{t}, {reduction:?}");
            let loss_shape = if reduction == LossReduction::None { vec![rows] } else { vec![] };
            let (ignore_index, f32_of) = (Some(-1), |s: &[usize]| Meta::new(DType::F32, s));
            let inputs = [scores.clone(), labels.clone(), weights.clone()];
            let logp_form = Op::SoftmaxCrossEntropyLoss { reduction, ignore_index };
            let lse_form = Op::SoftmaxCrossEntropyLse { reduction, ignore_index };
            let logp_outs = [f32_of(&loss_shape), f32_of(&[rows, cols])];
            let lse_outs = [f32_of(&loss_shape), f32_of(&[rows])];
            let dloss = Tensor::from_vec(&loss_shape, values(loss_shape.iter().product(), 15));
            let on_gpu = |o: &Op, i: &[Tensor], m: &[Meta]| run_typed(&gpu, o, i, m);
            let on_cpu = |o: &Op, i: &[Tensor], m: &[Meta]| run_typed(&cpu, o, i, m);
            let mut grads = Vec::new();
            for backend in [&on_gpu as &dyn Fn(&Op, &[Tensor], &[Meta]) -> Vec<Tensor>, &on_cpu] {
                let by_logp = backend(&logp_form, &inputs, &logp_outs);
                let by_lse = backend(&lse_form, &inputs, &lse_outs);
                assert_eq!(by_logp[0], by_lse[0], "{what}: the loss");
                let g_logp = Op::SoftmaxCrossEntropyLossGrad { reduction, ignore_index };
                let ins = [dloss.clone(), by_logp[1].clone(), labels.clone(), weights.clone()];
                let by_logp = backend(&g_logp, &ins, &[Meta::new(t, &[rows, cols])]);
                let g_lse = Op::SoftmaxCrossEntropyLseGrad { reduction, ignore_index };
                let ins = [dloss.clone(), scores.clone(), by_lse[1].clone(), labels.clone(), weights.clone()];
                let by_lse = backend(&g_lse, &ins, &[Meta::new(t, &[rows, cols])]);
                assert_eq!(by_logp, by_lse, "{what}: the gradient");
                grads.push(by_lse);
            }
            close_as_f32(
                &format!("{what}: the gradient"),
                &grads[0],
                &grads[1],
                if t == DType::F32 { 1e-6 } else { 1e-2 },
            );
        }
    }
}

/// Sizes that make the kernels' loops go round more than once: rows wider than a block's 256
/// threads, and an elementwise op over more than the 4096 × 256 threads of its largest grid;
/// and an empty batch, for which nothing is launched.
#[test]
fn loops_past_one_grid_and_one_block_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let check = |what: &str, op: &Op, inputs: &[Tensor], shapes: &[Vec<usize>]| {
        assert_close(what, &run_op(&gpu, op, inputs, shapes), &run_op(&cpu, op, inputs, shapes));
    };
    let n = 4096 * 256 + 1000;
    let (a, b) = (Tensor::from_vec(&[n], values(n, 16)), Tensor::from_vec(&[n], values(n, 17)));
    check("Add over more than one grid", &Op::Binary(Binary::Add), &[a, b], &[vec![n]]);
    let wide = Tensor::from_vec(&[3, 700], values(2100, 18));
    check("Softmax over 700 columns", &Op::Softmax { axis: 1 }, std::slice::from_ref(&wide), &[vec![3, 700]]);
    for kind in [Reduce::Max, Reduce::Sum] {
        let op = Op::ReduceOp { kind, axes: Some(vec![1]), keepdims: false, noop_with_empty_axes: false };
        check(&format!("{kind:?} over 700 columns"), &op, std::slice::from_ref(&wide), &[vec![3]]);
    }
    let image = Tensor::from_vec(&[2, 3, 12, 12], values(864, 19));
    let plane = [vec![2, 3, 1, 1]];
    check("GlobalAveragePool over 144 × 2 values", &Op::GlobalAveragePool, std::slice::from_ref(&image), &plane);
    let big = Tensor::from_vec(&[1, 2, 20, 20], values(800, 20));
    check("GlobalAveragePool over 400 values", &Op::GlobalAveragePool, &[big], &[vec![1, 2, 1, 1]]);
    let ones = Tensor::from_vec(&[3], vec![1.0f32, 0.5, 2.0]);
    let bn_inputs = [image.clone(), ones.clone(), ones.clone(), ones.clone(), ones.clone()];
    let train = Op::BatchNorm { epsilon: 1e-5, momentum: 0.9, training: true };
    check("BatchNormalization over 288 values a channel", &train, &bn_inputs, &[vec![2, 3, 12, 12], vec![3], vec![3]]);
    let dy = Tensor::from_vec(&[2, 3, 12, 12], values(864, 21));
    let grad = Op::BatchNormGrad { epsilon: 1e-5 };
    check("its gradient", &grad, &[dy, image, ones], &[vec![2, 3, 12, 12], vec![3], vec![3]]);
    let empty = Tensor::from_vec(&[0, 3, 4, 4], Vec::<f32>::new());
    check("GlobalAveragePool of no images", &Op::GlobalAveragePool, &[empty], &[vec![0, 3, 1, 1]]);
}

/// BatchNormalization's kernels cut each channel into shares of 16,384 values that a block each
/// sums, add the shares per channel, then normalize element-wise (four at a time where a plane's
/// length is a multiple of four): a channel over two shares whose values sit far from 0 (the
/// statistics summed around the channel's first value, so the mean does not swamp the
/// variance), an odd plane, and an empty batch; training (running statistics too), inference
/// and the gradient all match the CPU's two-pass f64 statistics, in f32 and, as mixed precision
/// runs them, in bf16 and f16; so do training and the gradient with the ReLU after the norm
/// fused (`batch_norm_relu`), the gradient masked by the fused output itself.
#[test]
fn batch_normalization_over_many_blocks_a_channel_matches_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let check = |what: &str, op: &Op, inputs: &[Tensor], shapes: &[Vec<usize>]| {
        assert_close(what, &run_op(&gpu, op, inputs, shapes), &run_op(&cpu, op, inputs, shapes));
    };
    let train = Op::BatchNorm { epsilon: 1e-5, momentum: 0.9, training: true };
    let infer = Op::BatchNorm { epsilon: 1e-5, momentum: 0.9, training: false };
    let grad = Op::BatchNormGrad { epsilon: 1e-5 };
    let (train_relu, grad_relu) =
        (Op::BatchNormRelu { epsilon: 1e-5, momentum: 0.9 }, Op::BatchNormReluGrad { epsilon: 1e-5 });
    for (what, shape, offset) in [
        ("two shares a channel", vec![4, 3, 70, 70], 0.0),
        ("two shares a channel, far from 0", vec![4, 3, 70, 70], 1000.0),
        ("a plane of 7 × 7", vec![3, 5, 7, 7], 0.0),
        ("no images", vec![0, 3, 4, 4], 0.0),
    ] {
        let (n, c) = (shape.iter().product::<usize>(), shape[1]);
        let x = Tensor::from_vec(&shape, values(n, 31).iter().map(|v| v + offset).collect());
        let stats = |salt| Tensor::from_vec(&[c], values(c, salt).iter().map(|v| v.abs() + 0.5).collect());
        let with_stats = [x.clone(), stats(32), stats(33), stats(34), stats(35)];
        check(&format!("{what}: training"), &train, &with_stats, &[shape.clone(), vec![c], vec![c]]);
        check(&format!("{what}: inference"), &infer, &with_stats, std::slice::from_ref(&shape));
        let dy = Tensor::from_vec(&shape, values(n, 36));
        let sums = [shape.clone(), vec![c], vec![c]];
        check(&format!("{what}: the gradient"), &grad, &[dy.clone(), x.clone(), stats(37)], &sums);
        check(&format!("{what}: training, the ReLU fused"), &train_relu, &with_stats, &sums);
        let z = run_op(&cpu, &train_relu, &with_stats, &sums).remove(0);
        check(
            &format!("{what}: the gradient through the fused ReLU"),
            &grad_relu,
            &[dy, x.clone(), stats(37), z],
            &sums,
        );
        // Under mixed precision X, Y, dY and dX are half (beside f32 parameters and statistics):
        // within a unit of the half type of the CPU, which computes in f32 and rounds.
        for (t, unit) in [(DType::BF16, 1.0 / 256.0), (DType::F16, 1.0 / 2048.0)] {
            let (f32_of, x) = (|shape: &[usize]| Meta::new(DType::F32, shape), x.cast(t));
            let ins = [x.clone(), stats(32), stats(33), stats(34), stats(35)];
            let outs = [Meta::new(t, &shape), f32_of(&[c]), f32_of(&[c])];
            let (g, c_) = (run_typed(&gpu, &train, &ins, &outs), run_typed(&cpu, &train, &ins, &outs));
            close_as_f32(&format!("{what}, {t}: training"), &g[..1], &c_[..1], unit);
            assert_close(&format!("{what}, {t}: the running statistics"), &g[1..], &c_[1..]);
            let (g, c_) = (run_typed(&gpu, &infer, &ins, &outs[..1]), run_typed(&cpu, &infer, &ins, &outs[..1]));
            close_as_f32(&format!("{what}, {t}: inference"), &g, &c_, unit);
            let ins = [Tensor::from_vec(&shape, values(n, 36)).cast(t), x, stats(37)];
            let outs = [Meta::new(t, &shape), f32_of(&[c]), f32_of(&[c])];
            let (g, c_) = (run_typed(&gpu, &grad, &ins, &outs), run_typed(&cpu, &grad, &ins, &outs));
            close_as_f32(&format!("{what}, {t}: the gradient"), &g, &c_, unit);
            // The ReLU fused: Z, and dX through it masked by that Z.
            let with_stats = [ins[1].clone(), stats(32), stats(33), stats(34), stats(35)];
            let (g, c_) =
                (run_typed(&gpu, &train_relu, &with_stats, &outs), run_typed(&cpu, &train_relu, &with_stats, &outs));
            close_as_f32(&format!("{what}, {t}: training, the ReLU fused"), &g[..1], &c_[..1], unit);
            let ins = [ins[0].clone(), ins[1].clone(), stats(37), c_[0].clone()];
            let (g, c_) = (run_typed(&gpu, &grad_relu, &ins, &outs), run_typed(&cpu, &grad_relu, &ins, &outs));
            close_as_f32(&format!("{what}, {t}: the gradient through the fused ReLU"), &g, &c_, unit);
        }
    }
}

/// Outputs that each reduce at least 256 inputs take one block each (`reduce_strided_blocks`):
/// every kind but LogSumExp and Prod, in f32 and bf16, over outer and inner axes at once, and a
/// convolution's bias gradient (N·H·W values a channel, what made ResNet-50's ConvGrad take
/// 180 ms on an H200); the results match the CPU's within rounding.
#[test]
fn reductions_over_many_inputs_run_a_block_each_and_match_the_cpu_backend() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let positive: Vec<f32> = values(3 * 5 * 120, 22).iter().map(|v| v.abs() + 0.5).collect();
    let kinds = [
        Reduce::Sum,
        Reduce::Mean,
        Reduce::Max,
        Reduce::Min,
        Reduce::SumSquare,
        Reduce::L1,
        Reduce::L2,
        Reduce::LogSum,
    ];
    for (t, tolerance) in [(DType::F32, 1e-6), (DType::BF16, 2f32.powi(-8))] {
        let x = Tensor::from_vec(&[3, 5, 120], positive.clone()).cast(t);
        for kind in kinds {
            let op = Op::ReduceOp { kind, axes: Some(vec![0, 2]), keepdims: false, noop_with_empty_axes: false };
            let out = [Meta::new(t, &[5])];
            let x = std::slice::from_ref(&x);
            let (g, c) = (run_typed(&gpu, &op, x, &out), run_typed(&cpu, &op, x, &out));
            close_as_f32(&format!("{t} {kind:?} of 360 values"), &g, &c, tolerance);
        }
    }
    let blocks = launches_of(&gpu, &["reduce_strided_blocks"]).values().sum::<usize>();
    assert_eq!(blocks, 16, "every reduction of 360 values took one block per output");

    let (x_shape, w_shape, y_shape) = (vec![4, 3, 10, 10], vec![2, 3, 3, 3], vec![4, 2, 10, 10]);
    let n = |s: &[usize]| s.iter().product::<usize>();
    let inputs = [
        Tensor::from_vec(&y_shape, values(n(&y_shape), 23)),
        Tensor::from_vec(&x_shape, values(n(&x_shape), 24)),
        Tensor::from_vec(&w_shape, values(n(&w_shape), 25)),
    ];
    let grad = Op::ConvGrad { window: Window::explicit(&[3, 3], &[1, 1], &[1, 1], &[1, 1, 1, 1], false), group: 1 };
    let shapes = [x_shape, w_shape, vec![2]];
    let (g, c) = (run_op(&gpu, &grad, &inputs, &shapes), run_op(&cpu, &grad, &inputs, &shapes));
    assert_close("ConvGrad whose dB sums 400 values a channel", &g, &c);
    let blocks_now = launches_of(&gpu, &["reduce_strided_blocks"]).values().sum::<usize>();
    assert_eq!(blocks_now, blocks + 1, "the bias gradient took one block per channel");
}

/// A training step waits for the device once, where the gradient norm and the loss are read
/// (issue 7: no host synchronisation inside a step except for the loss), however many weights
/// and micro-batches; fp16's overflow check and clipping take their figures from that one read,
/// and LAMB's trust ratios stay on the device. Adam updates a parameter group's weights in one
/// launch: two here, the decayed matrices and the undecayed biases and norms.
#[test]
fn a_training_step_waits_for_the_device_once() {
    let spec = ModelSpec {
        gpt2: Some(Gpt2Config {
            layers: 2,
            heads: 2,
            embed: 32,
            seq_len: 8,
            vocab: 48,
            dropout: 0.1,
            ..Default::default()
        }),
        ..Default::default()
    };
    let batches: Vec<_> = (0..2).map(|k| batch(2, 8, 48, k)).collect();
    let adamw = Update::Adam { beta1: 0.9, beta2: 0.95, epsilon: 1e-8, weight_decay: 0.1, decoupled: true };
    let lamb = Update::Lamb { beta1: 0.9, beta2: 0.999, epsilon: 1e-6, weight_decay: 0.01 };
    for (what, opts) in [
        ("f32", SessionOptions::new(adamw)),
        (
            "fp16 with loss scaling",
            SessionOptions {
                half: Some(DType::F16),
                loss_scaler: Some(LossScaler::new(0.0, DynamicLossScale::default())),
                ..SessionOptions::new(adamw)
            },
        ),
        ("LAMB", SessionOptions::new(lamb)),
    ] {
        let gpu = Arc::new(EmulatedGpu::new());
        let model = models::load(&spec, 11).unwrap();
        let mut s = Session::new(gpu.clone(), &model, &batches[0], batches.len(), &opts).unwrap();
        let weights = s.weights().unwrap().len();
        let adam_launches = || gpu.launches.lock().unwrap().get("adam_f32").copied().unwrap_or(0);
        for k in 0..3 {
            let before = gpu.waits.load(std::sync::atomic::Ordering::Relaxed);
            let adam_before = adam_launches();
            let r = s.step(&batches, 3e-3, 1.0, k).unwrap();
            let waits = gpu.waits.load(std::sync::atomic::Ordering::Relaxed) - before;
            // The norm's partial sums, then the loss (already computed by then).
            assert_eq!(waits, 2, "{what}, step {}: {waits} waits for the device ({weights} weights)", k + 1);
            let adam = adam_launches() - adam_before;
            let want = if matches!(opts.update, Update::Adam { .. }) && !r.skipped { 2 } else { 0 };
            assert_eq!(adam, want, "{what}, step {}: {adam} Adam launches for {weights} weights", k + 1);
        }
    }
}

/// Transpose, Split, Concat, Slice and Expand move whole words where the layout allows
/// (`strided_move`: 16 bytes where the innermost run, every stride and both addresses are
/// multiples of 16, then 8, 4, 2), with merged dimensions, rows of 512 bytes or more of a
/// rank-2 move a block each (`rows_*`), and a plain copy where the move is contiguous; each case equals the CPU's bit for
/// bit, and the kernels expected are used.
#[test]
fn strided_moves_in_words_match_the_cpu_backend_on_the_emulated_kernels() {
    let gpu = EmulatedGpu::new();
    let cpu = CpuBackend::new();
    let data = |shape: &[usize], t: DType, salt: usize| {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| (i * 7 + salt) as f32 - 100.0).collect();
        Tensor::from_vec(shape, v).cast(t)
    };
    let slice =
        |starts: Vec<i64>, ends: Vec<i64>, axes: Vec<i64>, steps: Vec<i64>| Op::Slice { starts, ends, axes, steps };
    // What, the op, its inputs, its outputs, and the kernel expected to move them (None: a copy).
    type Case = (&'static str, Op, Vec<Tensor>, Vec<Meta>, Option<&'static str>);
    let cases: Vec<Case> = vec![
        // Heads of 8 bf16 values (16 bytes) swapped with positions: words of 16 bytes.
        (
            "transpose, heads of 16 bytes",
            Op::Transpose { perm: Some(vec![0, 2, 1, 3]) },
            vec![data(&[2, 4, 3, 8], DType::BF16, 1)],
            vec![Meta::new(DType::BF16, &[2, 3, 4, 8])],
            Some("strided_copy_b128"),
        ),
        (
            "transpose, heads of 8 bytes",
            Op::Transpose { perm: Some(vec![0, 2, 1, 3]) },
            vec![data(&[2, 4, 3, 4], DType::BF16, 2)],
            vec![Meta::new(DType::BF16, &[2, 3, 4, 4])],
            Some("strided_copy_b64"),
        ),
        (
            "transpose of a matrix",
            Op::Transpose { perm: Some(vec![1, 0]) },
            vec![data(&[5, 7], DType::F32, 3)],
            vec![Meta::new(DType::F32, &[7, 5])],
            Some("strided_copy_b32"),
        ),
        (
            "split of columns",
            Op::Split { axis: 1, sizes: vec![8, 8, 8], num_outputs: None },
            vec![data(&[6, 24], DType::BF16, 4)],
            vec![Meta::new(DType::BF16, &[6, 8]); 3],
            Some("strided_copy_b128"),
        ),
        (
            "split of rows (contiguous: copies)",
            Op::Split { axis: 0, sizes: vec![2, 4], num_outputs: None },
            vec![data(&[6, 5], DType::F32, 5)],
            vec![Meta::new(DType::F32, &[2, 5]), Meta::new(DType::F32, &[4, 5])],
            None,
        ),
        (
            "concat of columns",
            Op::Concat { axis: 1 },
            vec![data(&[6, 8], DType::BF16, 6), data(&[6, 8], DType::BF16, 7), data(&[6, 8], DType::BF16, 8)],
            vec![Meta::new(DType::BF16, &[6, 24])],
            Some("strided_store_b128"),
        ),
        (
            "concat of odd columns",
            Op::Concat { axis: 1 },
            vec![data(&[3, 3], DType::F16, 9), data(&[3, 5], DType::F16, 10)],
            vec![Meta::new(DType::F16, &[3, 8])],
            Some("strided_store_b16"),
        ),
        // Runs of 64 bytes every 80, but from an address 4 bytes past a word's.
        (
            "slice starting 4 bytes in",
            slice(vec![1], vec![17], vec![1], vec![1]),
            vec![data(&[4, 20], DType::F32, 11)],
            vec![Meta::new(DType::F32, &[4, 16])],
            Some("strided_copy_b32"),
        ),
        (
            "slice backwards",
            slice(vec![-1, 7], vec![-100, 0], vec![1, 0], vec![-2, -3]),
            vec![data(&[8, 9], DType::BF16, 12)],
            vec![Meta::new(DType::BF16, &[3, 5])],
            Some("strided_copy_b16"),
        ),
        (
            "expand of a row",
            Op::Expand,
            vec![data(&[1, 8], DType::F32, 13), Tensor::from_vec(&[2], vec![5i64, 8])],
            vec![Meta::new(DType::F32, &[5, 8])],
            Some("strided_copy_b128"),
        ),
        // Rows of 512 bytes and more go a block per row: 600-byte rows in 8-byte words, and
        // 1040-byte rows (written 2080 bytes apart) in 16-byte ones.
        (
            "split of wide columns",
            Op::Split { axis: 1, sizes: vec![300, 300, 300], num_outputs: None },
            vec![data(&[4, 900], DType::BF16, 14)],
            vec![Meta::new(DType::BF16, &[4, 300]); 3],
            Some("rows_b64"),
        ),
        (
            "concat of wide columns",
            Op::Concat { axis: 1 },
            vec![data(&[3, 260], DType::F32, 15), data(&[3, 260], DType::F32, 16)],
            vec![Meta::new(DType::F32, &[3, 520])],
            Some("rows_b128"),
        ),
    ];
    for (what, op, inputs, outs, kernel) in cases {
        gpu.launches.lock().unwrap().clear();
        let g = run_typed(&gpu, &op, &inputs, &outs);
        let c = run_typed(&cpu, &op, &inputs, &outs);
        assert_same_values(what, &g, &c);
        let used = launches_of(&gpu, &["strided_", "rows_"]);
        match kernel {
            Some(k) => assert!(used.contains_key(k), "{what}: {k} expected, launched {used:?}"),
            None => assert!(used.is_empty(), "{what}: a plain copy expected, launched {used:?}"),
        }
    }
}

/// Products whose rows are not 16-byte aligned (GPT-2's 50257 logits a row) run on padded
/// copies (`padded_product`): the tied LM head's three products, in bf16 and f32, over 37
/// columns, equal the CPU's, and the padding's copies ran.
#[test]
fn products_over_unaligned_rows_match_the_cpu_backend_on_the_emulated_kernels() {
    let gpu = EmulatedGpu::new();
    let cpu = CpuBackend::new();
    let (m, k, v) = (24, 16, 37);
    let mm = |trans_a, trans_b| Op::FusedMatMul { trans_a, trans_b, activation: None };
    for t in [DType::BF16, DType::F32] {
        let x = Tensor::from_vec(&[m, k], values(m * k, 1)).cast(t);
        let w = Tensor::from_vec(&[v, k], values(v * k, 2)).cast(t);
        let dy = Tensor::from_vec(&[m, v], values(m * v, 3)).cast(t);
        let cases = [
            ("logits = x·wᵀ", mm(false, true), vec![x.clone(), w.clone()], [m, v]),
            ("dx = dy·w", mm(false, false), vec![dy.clone(), w.clone()], [m, k]),
            ("dw = dyᵀ·x", mm(true, false), vec![dy.clone(), x.clone()], [v, k]),
        ];
        for (what, op, inputs, out) in cases {
            gpu.launches.lock().unwrap().clear();
            let out = [Meta::new(t, &out)];
            let g = run_typed(&gpu, &op, &inputs, &out);
            let c = run_typed(&cpu, &op, &inputs, &out);
            let what = format!("{what} in {t}");
            close_as_f32(&what, &g, &c, if t == DType::F32 { 1e-6 } else { 1e-2 });
            assert!(!launches_of(&gpu, &["rows_"]).is_empty(), "{what}: no padded copy ran");
        }
    }
}

/// Every pointwise function of issue 20 (those of Hugging Face and torchvision exports, and the
/// SiLU that `fuse::silu` makes of them), its gradient, the predicates and the new binary ops
/// on the emulated kernels against the CPU backend: f32 and f64 within a few units of f32's
/// last place (both call the C library's functions, the CPU in f64), bf16 within one of its
/// units (both compute in f32 and round once).
/// The inputs cover both sides of every kink (−3, 0, 3, the Clip bounds) and ±∞ and NaN for
/// the predicates.
#[test]
fn pointwise_ops_of_exported_models_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    use Unary::*;
    #[rustfmt::skip]
    let activations = [
        Sin, Cos, Tan, Atan, Sinh, Cosh, Asinh, Sign, Round, Softplus, Softsign, Mish, HardSwish,
        HardSigmoid { alpha: 0.2, beta: 0.5 }, LeakyRelu { alpha: 0.01 }, Elu { alpha: 1.5 },
        Selu { alpha: 1.673_263_2, gamma: 1.050_701 }, Celu { alpha: 0.7 }, ThresholdedRelu { alpha: 0.5 },
        Clip { min: -1.5, max: 2.5 }, Clip { min: 0.0, max: 6.0 }, Silu,
    ];
    let inverse = [Asin, Acos, Atanh];
    let n = 48;
    // −4.7 … 4.7 in steps that pass through the kinks' neighbourhoods and round halves.
    let wide: Vec<f32> = (0..n).map(|i| -4.7 + i as f32 * 0.2).chain([-3.0, 0.0, 2.5, 3.0, 6.0, 0.5]).collect();
    let unit: Vec<f32> = values(n, 5).iter().map(|v| v * 0.9).collect();
    for (t, tol) in [(DType::F32, 4e-6), (DType::F64, 4e-6), (DType::BF16, 2f32.powi(-8))] {
        let tensor = |v: &[f32]| Tensor::from_vec(&[v.len()], v.to_vec()).cast(t);
        let dy = |len: usize| Tensor::from_vec(&[len], values(len, 9)).cast(t);
        let cases = activations.iter().map(|u| (*u, &wide)).chain(inverse.iter().map(|u| (*u, &unit)));
        for (u, xs) in cases {
            let (x, out) = (tensor(xs), [Meta::new(t, &[xs.len()])]);
            for (what, op, inputs) in [
                ("forward", Op::Unary(u), vec![x.clone()]),
                ("gradient", Op::UnaryGrad(u), vec![dy(xs.len()), x.clone()]),
            ] {
                let (g, c) = (run_typed(&gpu, &op, &inputs, &out), run_typed(&cpu, &op, &inputs, &out));
                close_as_f32(&format!("{t} {u:?} {what}"), &g, &c, tol);
            }
        }
        let special = tensor(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -1.0, 1e30]);
        let flags = [Meta::new(DType::Bool, &[6])];
        for u in [IsNaN, IsInf { negative: true, positive: true }, IsInf { negative: false, positive: true }] {
            let (g, c) = (
                run_typed(&gpu, &Op::Unary(u), std::slice::from_ref(&special), &flags),
                run_typed(&cpu, &Op::Unary(u), std::slice::from_ref(&special), &flags),
            );
            assert_eq!(g[0].bytes(), c[0].bytes(), "{t} {u:?}");
        }
        // [12, 4] by a divisor or slope per column.
        let (a, b) = (tensor(&wide[..n]).reshaped(&[n / 4, 4]), tensor(&[1.5, -2.0, 0.75, -0.5]));
        let out = [Meta::new(t, &[n / 4, 4])];
        for op in [Binary::Mod, Binary::Fmod, Binary::PRelu] {
            let inputs = [a.clone(), b.clone()];
            let (g, c) =
                (run_typed(&gpu, &Op::Binary(op), &inputs, &out), run_typed(&cpu, &Op::Binary(op), &inputs, &out));
            close_as_f32(&format!("{t} {op:?}"), &g, &c, tol);
        }
    }
    // Integers: Mod with the divisor's sign, Fmod with the dividend's, Clip, Sign and Xor exact.
    let ints = Tensor::from_vec(&[8], vec![-7i32, 7, -7, 7, 0, i32::MIN, 5, -5]);
    let divisors = Tensor::from_vec(&[8], vec![3i32, -3, -3, 3, 4, -1, 0, 2]);
    let out = [Meta::new(DType::I32, &[8])];
    for op in [Binary::Mod, Binary::Fmod] {
        let inputs = [ints.clone(), divisors.clone()];
        let (g, c) = (run_typed(&gpu, &Op::Binary(op), &inputs, &out), run_typed(&cpu, &Op::Binary(op), &inputs, &out));
        assert_eq!(g[0].as_slice::<i32>(), c[0].as_slice::<i32>(), "i32 {op:?}");
    }
    for u in [Clip { min: -5.0, max: 6.0 }, Sign, Neg, Abs] {
        let (g, c) = (
            run_typed(&gpu, &Op::Unary(u), std::slice::from_ref(&ints), &out),
            run_typed(&cpu, &Op::Unary(u), std::slice::from_ref(&ints), &out),
        );
        assert_eq!(g[0].as_slice::<i32>(), c[0].as_slice::<i32>(), "i32 {u:?}");
    }
    let bools = |v: &[u8]| Tensor::from_vec(&[4], v.to_vec()).cast(DType::Bool);
    let (p, q) = (bools(&[0, 0, 1, 1]), bools(&[0, 1, 0, 1]));
    let flags = [Meta::new(DType::Bool, &[4])];
    let xor = run_typed(&gpu, &Op::Binary(Binary::Xor), &[p.clone(), q], &flags);
    assert_eq!(xor[0].bytes(), &[0, 1, 1, 0], "Xor");
    let not = run_typed(&gpu, &Op::Unary(Not), &[p], &flags);
    assert_eq!(not[0].bytes(), &[1, 1, 0, 0], "Not");
}

/// SwiGLU (`fuse::swiglu`) and its gradient on the emulated kernels against the CPU backend:
/// f32 and f64 within a few units of f32's last place, bf16 within one of its units.
#[test]
fn swiglu_and_its_gradient_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let n = 200;
    for (t, tol) in [(DType::F32, 4e-6), (DType::F64, 4e-6), (DType::BF16, 2f32.powi(-8))] {
        let tensor = |salt, scale: f32| {
            Tensor::from_vec(&[n / 8, 8], values(n, salt).iter().map(|v| v * scale).collect()).cast(t)
        };
        let (gate, up, dy) = (tensor(3, 4.0), tensor(7, 1.0), tensor(11, 1.0));
        let one = [Meta::new(t, &[n / 8, 8])];
        let (g, c) = (
            run_typed(&gpu, &Op::Swiglu, &[gate.clone(), up.clone()], &one),
            run_typed(&cpu, &Op::Swiglu, &[gate.clone(), up.clone()], &one),
        );
        close_as_f32(&format!("{t} Swiglu"), &g, &c, tol);
        let two = [one[0].clone(), one[0].clone()];
        let inputs = [dy, gate, up];
        let (g, c) = (run_typed(&gpu, &Op::SwigluGrad, &inputs, &two), run_typed(&cpu, &Op::SwigluGrad, &inputs, &two));
        close_as_f32(&format!("{t} SwigluGrad"), &g, &c, tol);
    }
}

/// The rotary embedding (`fuse::rotary`) and its gradient on the emulated kernels against the
/// CPU backend, its tables reaching x [B, H, T, D] each way a binary op's operand may: its own
/// layout, repeated along the leading dims ([T, D], [1, 1, T, D]) and through strides
/// ([B, 1, T, D], Hugging Face's with a batch of positions). f32 and f64 within a few units of
/// f32's last place (the GPU may fuse a product into the sum), bf16 within one of its units.
#[test]
fn rotary_and_its_gradient_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let x_shape = [2, 3, 5, 8];
    let n: usize = x_shape.iter().product();
    for (t, tol) in [(DType::F32, 4e-6), (DType::F64, 4e-6), (DType::BF16, 2f32.powi(-8))] {
        let tensor = |shape: &[usize], salt| {
            let len = shape.iter().product();
            Tensor::from_vec(shape, values(len, salt)).cast(t)
        };
        let (x, out) = (tensor(&x_shape, 3), [Meta::new(t, &x_shape)]);
        for table in [&x_shape[..], &[5, 8], &[1, 1, 5, 8], &[2, 1, 5, 8]] {
            let (cos, sin) = (tensor(table, 7), tensor(table, 13));
            for op in [Op::Rotary, Op::RotaryGrad] {
                let inputs = [x.clone(), cos.clone(), sin.clone()];
                let (g, c) = (run_typed(&gpu, &op, &inputs, &out), run_typed(&cpu, &op, &inputs, &out));
                close_as_f32(&format!("{t} {op:?}, tables {table:?} against x of {n}"), &g, &c, tol);
            }
        }
    }
}

/// GatherElements along each axis of a 3-D tensor, with repeated and negative indices, and its
/// gradient (a scatter-add where indices repeat) on the emulated kernels against the CPU.
#[test]
fn gather_elements_and_its_gradient_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let data = Tensor::from_vec(&[3, 4, 5], values(60, 3));
    let idx_shape = [3, 2, 4];
    for axis in 0..3i64 {
        let dim = [3i64, 4, 5][axis as usize];
        let ids: Vec<i64> = (0..24).map(|i| (i * 7 % (2 * dim)) - dim).collect();
        let idx = Tensor::from_vec(&idx_shape, ids);
        let op = Op::GatherElements { axis };
        let out = [Meta::new(DType::F32, &idx_shape)];
        let inputs = [data.clone(), idx.clone()];
        assert_same_values(
            &format!("GatherElements axis {axis}"),
            &run_typed(&gpu, &op, &inputs, &out),
            &run_typed(&cpu, &op, &inputs, &out),
        );
        let grad = Op::GatherElementsGrad { axis, data_shape: vec![3, 4, 5] };
        let inputs = [Tensor::from_vec(&idx_shape, values(24, 8)), idx];
        let out = [Meta::new(DType::F32, &[3, 4, 5])];
        assert_close(
            &format!("GatherElementsGrad axis {axis}"),
            &run_typed(&gpu, &grad, &inputs, &out),
            &run_typed(&cpu, &grad, &inputs, &out),
        );
    }
}

/// Every Reduce kind over trailing and leading axes, in f32, f64 and bf16, and of i32 (through
/// f64) on the emulated kernels against the CPU backend; LogSumExp also with a row of −∞ and
/// values that would overflow e^x unshifted.
#[test]
fn reductions_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    use Reduce::*;
    let mut big = values(24, 6).iter().map(|v| v * 3.0 + 0.5).collect::<Vec<f32>>();
    big[0..4].copy_from_slice(&[800.0, 801.0, 799.5, 800.0]);
    for (t, tol) in [(DType::F32, 2e-6), (DType::F64, 2e-6), (DType::BF16, 2f32.powi(-7))] {
        let x = Tensor::from_vec(&[2, 3, 4], big.clone()).cast(t);
        for kind in [Sum, Mean, Max, Min, SumSquare, L1, L2, LogSum, LogSumExp, Prod] {
            for (axes, shape) in [(vec![2i64], vec![2, 3]), (vec![0i64, 1], vec![1, 1, 4])] {
                let op = Op::ReduceOp {
                    kind,
                    axes: Some(axes.clone()),
                    keepdims: shape.len() == 3,
                    noop_with_empty_axes: false,
                };
                let out = [Meta::new(t, &shape)];
                let inputs = [x.clone()];
                let (g, c) = (run_typed(&gpu, &op, &inputs, &out), run_typed(&cpu, &op, &inputs, &out));
                close_as_f32(&format!("{t} {kind:?} over {axes:?}"), &g, &c, tol);
            }
        }
    }
    let lse = Op::ReduceOp { kind: LogSumExp, axes: Some(vec![1]), keepdims: false, noop_with_empty_axes: false };
    let x =
        Tensor::from_vec(&[2, 3], vec![f32::NEG_INFINITY; 3].into_iter().chain([1.0, f32::INFINITY, 2.0]).collect());
    let out = [Meta::new(DType::F32, &[2])];
    let g = run_typed(&gpu, &lse, std::slice::from_ref(&x), &out);
    assert_eq!(g[0].as_slice::<f32>(), run_typed(&cpu, &lse, &[x], &out)[0].as_slice::<f32>());
    assert_eq!(g[0].as_slice::<f32>(), &[f32::NEG_INFINITY, f32::INFINITY]);
    let ints = Tensor::from_vec(&[2, 3], vec![3i32, -2, 5, 7, 1, -4]);
    for kind in [Prod, L1, Max] {
        let op = Op::ReduceOp { kind, axes: Some(vec![1]), keepdims: false, noop_with_empty_axes: false };
        let out = [Meta::new(DType::I32, &[2])];
        let (g, c) = (
            run_typed(&gpu, &op, std::slice::from_ref(&ints), &out),
            run_typed(&cpu, &op, std::slice::from_ref(&ints), &out),
        );
        assert_eq!(g[0].as_slice::<i32>(), c[0].as_slice::<i32>(), "i32 {kind:?}");
    }
}

/// ArgMax and ArgMin along each axis, with ties broken first and last, a NaN, and of i64 and bf16
/// elements, on the emulated kernels against the CPU backend.
#[test]
fn arg_extremes_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    // Values from a set of 7, so that every row has ties; one NaN.
    let mut v: Vec<f32> = (0..60).map(|i| ((i * 5) % 7) as f32 - 3.0).collect();
    v[17] = f32::NAN;
    for t in [DType::F32, DType::BF16, DType::I64] {
        let x = Tensor::from_vec(&[3, 4, 5], v.clone()).cast(t);
        for (max, last, axis) in (0..8).map(|k| (k & 1 == 1, k & 2 == 2, (k % 3) as i64)) {
            let op = Op::ArgExtreme { max, axis, keepdims: true, select_last_index: last };
            let mut shape = vec![3, 4, 5];
            shape[axis as usize] = 1;
            let out = [Meta::new(DType::I64, &shape)];
            let (g, c) = (
                run_typed(&gpu, &op, std::slice::from_ref(&x), &out),
                run_typed(&cpu, &op, std::slice::from_ref(&x), &out),
            );
            assert_eq!(g[0].as_slice::<i64>(), c[0].as_slice::<i64>(), "{t} {op:?}");
        }
    }
}

/// TopK's indices along each axis, largest and smallest, of f32, bf16, f64 and i64 elements with
/// ties in every line and two NaNs, k from 1 to the whole line, on the emulated kernels against
/// the CPU backend.
#[test]
fn top_k_indices_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    // Values from a set of 5, so that every line has ties; NaNs at two places.
    let mut v: Vec<f32> = (0..60).map(|i| ((i * 3) % 5) as f32 - 2.0).collect();
    v[17] = f32::NAN;
    v[44] = f32::NAN;
    let shape = [3, 4, 5];
    for t in [DType::F32, DType::BF16, DType::F64, DType::I64] {
        let x = Tensor::from_vec(&shape, v.clone()).cast(t);
        for (largest, axis) in (0..6).map(|c| (c % 2 == 0, c / 2)) {
            for k in [1, 2, shape[axis]] {
                let op = Op::TopKIndices { axis: axis as i64, k, largest };
                let mut out_shape = shape.to_vec();
                out_shape[axis] = k;
                let out = [Meta::new(DType::I64, &out_shape)];
                let (g, c) = (
                    run_typed(&gpu, &op, std::slice::from_ref(&x), &out),
                    run_typed(&cpu, &op, std::slice::from_ref(&x), &out),
                );
                assert_eq!(g[0].as_slice::<i64>(), c[0].as_slice::<i64>(), "{t} {op:?}");
            }
        }
    }
}

/// MatMul of f64, i32 and i64 matrices (the products cuBLASLt's path does not take, which an
/// Einsum of them is written out as), batch-broadcast and not, on the emulated kernels against
/// the CPU backend.
#[test]
fn plain_products_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    for (a_shape, b_shape, y_shape) in [
        (vec![3, 4], vec![4, 2], vec![3, 2]),
        (vec![2, 1, 3, 4], vec![3, 4, 5], vec![2, 3, 3, 5]),
        (vec![2, 3, 4], vec![4, 5], vec![2, 3, 5]),
    ] {
        for t in [DType::F64, DType::I32, DType::I64] {
            // Integers from -9 to 9 (values' [-1, 1) scaled), negative products included.
            let operand = |s: &[usize], salt| {
                let v: Vec<f32> = values(s.iter().product(), salt).iter().map(|v| v * 9.0).collect();
                Tensor::from_vec(s, v).cast(t)
            };
            let (a, b) = (operand(&a_shape, 1), operand(&b_shape, 2));
            let out = [Meta::new(t, &y_shape)];
            let (g, c) = (
                run_typed(&gpu, &Op::MatMul, &[a.clone(), b.clone()], &out),
                run_typed(&cpu, &Op::MatMul, &[a, b], &out),
            );
            assert_same_values(&format!("{t} MatMul {a_shape:?} × {b_shape:?}"), &g, &c);
        }
    }
}

/// Pad in every mode over two axes (one cropped), of f32, bf16 and i64, and its gradient, on the
/// emulated kernels against the CPU backend.
#[test]
fn pad_and_its_gradient_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let pads = vec![1i64, 5, -1, 0, 2, 3];
    let (input, output) = ([3usize, 4, 2], vec![9usize, 3, 5]);
    for mode in [PadMode::Constant, PadMode::Reflect, PadMode::Edge, PadMode::Wrap] {
        for t in [DType::F32, DType::BF16, DType::I64] {
            let x = Tensor::from_vec(&input, values(24, 2)).cast(t);
            let op = Op::Pad { mode, pads: pads.clone(), value: 1.5 };
            let out = [Meta::new(t, &output)];
            let (g, c) = (
                run_typed(&gpu, &op, std::slice::from_ref(&x), &out),
                run_typed(&cpu, &op, std::slice::from_ref(&x), &out),
            );
            assert_same_values(&format!("{t} Pad {mode:?}"), &g, &c);
        }
        let grad = Op::PadGrad { mode, pads: pads.clone(), input_shape: input.to_vec() };
        let dy = Tensor::from_vec(&output, values(135, 4));
        let out = [Meta::new(DType::F32, &input)];
        let (g, c) = (
            run_typed(&gpu, &grad, std::slice::from_ref(&dy), &out),
            run_typed(&cpu, &grad, std::slice::from_ref(&dy), &out),
        );
        assert_close(&format!("PadGrad {mode:?}"), &g, &c);
    }
}

/// GatherND (with and without batch dims, whole-slice and element tuples), its gradient, and
/// ScatterND with every reduction and a repeated tuple, on the emulated kernels against the CPU.
#[test]
fn gather_nd_and_scatter_nd_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let data = Tensor::from_vec(&[2, 3, 4], values(24, 1));
    for (batch_dims, idx, out_shape) in [
        (0, Tensor::from_vec(&[2, 2], vec![1i64, 2, -2, 0]), vec![2, 4]),
        (0, Tensor::from_vec(&[3, 1], vec![1i64, 0, 1]), vec![3, 3, 4]),
        (1, Tensor::from_vec(&[2, 2, 2], vec![2i64, 3, 0, -1, 1, 1, 2, 0]), vec![2, 2]),
    ] {
        let op = Op::GatherND { batch_dims };
        let out = [Meta::new(DType::F32, &out_shape)];
        let inputs = [data.clone(), idx.clone()];
        let what = format!("GatherND {:?} batch_dims {batch_dims}", idx.shape());
        assert_same_values(&what, &run_typed(&gpu, &op, &inputs, &out), &run_typed(&cpu, &op, &inputs, &out));
        let grad = Op::GatherNDGrad { batch_dims, data_shape: vec![2, 3, 4] };
        let n = out_shape.iter().product();
        let inputs = [Tensor::from_vec(&out_shape, values(n, 5)), idx];
        let out = [Meta::new(DType::F32, &[2, 3, 4])];
        assert_close(
            &format!("{what}'s gradient"),
            &run_typed(&gpu, &grad, &inputs, &out),
            &run_typed(&cpu, &grad, &inputs, &out),
        );
    }
    use ScatterReduction::*;
    let idx = Tensor::from_vec(&[3, 2], vec![1i64, 2, 0, -1, 1, 2]);
    for t in [DType::F32, DType::BF16] {
        let (x, u) = (data.cast(t), Tensor::from_vec(&[3, 4], values(12, 7)).cast(t));
        for reduction in [None, Add, Mul, Max, Min] {
            let op = Op::ScatterND { reduction };
            let out = [Meta::new(t, &[2, 3, 4])];
            let inputs = [x.clone(), idx.clone(), u.clone()];
            let what = format!("{t} ScatterND {reduction:?}");
            assert_same_values(&what, &run_typed(&gpu, &op, &inputs, &out), &run_typed(&cpu, &op, &inputs, &out));
        }
    }
}

/// NegativeLogLikelihoodLoss and its gradient with every reduction, weights and an ignored label,
/// over [N, C] and [N, C, D] log-probabilities in f32 and f64, on the emulated kernels against the
/// CPU backend.
#[test]
fn negative_log_likelihood_matches_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    for (shape, labels) in [
        (vec![5usize, 4], Tensor::from_vec(&[5], vec![0i64, 3, -1, 1, 2])),
        (vec![2, 4, 3], Tensor::from_vec(&[2, 3], vec![0i64, 3, 1, -1, 2, 0])),
    ] {
        let label_shape = labels.shape().to_vec();
        for t in [DType::F32, DType::F64] {
            let x = Tensor::from_vec(&shape, values(shape.iter().product(), 3)).cast(t);
            let w = Tensor::from_vec(&[4], vec![0.5f32, 1.0, 2.0, 1.5]).cast(t);
            for reduction in [LossReduction::Mean, LossReduction::Sum, LossReduction::None] {
                for weighted in [false, true] {
                    let ignore_index = Some(-1);
                    let loss_shape = if reduction == LossReduction::None { label_shape.clone() } else { vec![] };
                    let mut inputs = vec![x.clone(), labels.clone()];
                    let mut grad_inputs = vec![
                        Tensor::from_vec(&loss_shape, values(loss_shape.iter().product(), 6)).cast(t),
                        labels.clone(),
                    ];
                    if weighted {
                        inputs.push(w.clone());
                        grad_inputs.push(w.clone());
                    }
                    let what = format!("{t} {shape:?} {reduction:?} weighted {weighted}");
                    let op = Op::NegativeLogLikelihoodLoss { reduction, ignore_index };
                    let out = [Meta::new(t, &loss_shape)];
                    close_as_f32(
                        &what,
                        &run_typed(&gpu, &op, &inputs, &out),
                        &run_typed(&cpu, &op, &inputs, &out),
                        1e-6,
                    );
                    let grad =
                        Op::NegativeLogLikelihoodLossGrad { reduction, ignore_index, input_shape: shape.clone() };
                    let out = [Meta::new(t, &shape)];
                    let (g, c) =
                        (run_typed(&gpu, &grad, &grad_inputs, &out), run_typed(&cpu, &grad, &grad_inputs, &out));
                    close_as_f32(&format!("{what}, gradient"), &g, &c, 1e-6);
                }
            }
        }
    }
}

/// CumSum each way along each axis, of f32, bf16, f64 and i64, on the emulated kernels against the
/// CPU backend.
#[test]
fn cumsum_matches_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    for t in [DType::F32, DType::BF16, DType::F64, DType::I64] {
        let x = Tensor::from_vec(&[3, 4, 5], values(60, 2).iter().map(|v| v * 10.0).collect()).cast(t);
        for axis in 0..3 {
            for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
                let op = Op::CumSum { axis, exclusive, reverse };
                let out = [Meta::new(t, &[3, 4, 5])];
                let (g, c) = (
                    run_typed(&gpu, &op, std::slice::from_ref(&x), &out),
                    run_typed(&cpu, &op, std::slice::from_ref(&x), &out),
                );
                assert_same_values(&format!("{t} {op:?}"), &g, &c);
            }
        }
    }
}

/// ScatterElements along each axis with every reduction, repeated and negative indices, in f32,
/// bf16 and (reduction none) i64, on the emulated kernels against the CPU backend.
#[test]
fn scatter_elements_matches_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    use ScatterReduction::*;
    for axis in 0..2i64 {
        let dim = [3i64, 4][axis as usize];
        let idx = Tensor::from_vec(&[2, 3], (0..6).map(|i| (i * 5 % (2 * dim)) - dim).collect::<Vec<i64>>());
        for t in [DType::F32, DType::BF16, DType::I64] {
            let x = Tensor::from_vec(&[3, 4], values(12, 1)).cast(t);
            let u = Tensor::from_vec(&[2, 3], values(6, 8).iter().map(|v| v * 4.0).collect()).cast(t);
            let reductions: &[ScatterReduction] = if t == DType::I64 { &[None] } else { &[None, Add, Mul, Max, Min] };
            for &reduction in reductions {
                let op = Op::ScatterElements { axis, reduction };
                let out = [Meta::new(t, &[3, 4])];
                let inputs = [x.clone(), idx.clone(), u.clone()];
                let what = format!("{t} ScatterElements axis {axis} {reduction:?}");
                assert_same_values(&what, &run_typed(&gpu, &op, &inputs, &out), &run_typed(&cpu, &op, &inputs, &out));
            }
        }
    }
}

/// ConvTranspose (2-D grouped with strides, dilations, uneven pads and output padding, 1-D,
/// pointwise, and 3-D on its direct kernel) with its gradient, and Resize in each mode (nearest,
/// linear over three axes, cubic, tf_crop_and_resize's extrapolation) with its gradient, in f32
/// and bf16, on the emulated kernels against the CPU backend.
#[test]
fn conv_transpose_and_resize_match_the_cpu_backend_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    let n = |s: &[usize]| s.iter().product::<usize>();
    // (what, x shape, W shape, group, window, output padding)
    let convs = [
        (
            "2-D, 2 groups, stride 2, dilation 2, uneven pads, output padding",
            vec![2, 4, 5, 4],
            vec![4, 3, 3, 2],
            2,
            Window::explicit(&[3, 2], &[2, 3], &[2, 1], &[1, 0, 2, 1], false),
            vec![1, 2],
        ),
        (
            "2-D pointwise",
            vec![2, 5, 4, 3],
            vec![5, 3, 1, 1],
            1,
            Window::explicit(&[1, 1], &[1, 1], &[1, 1], &[0; 4], false),
            vec![0, 0],
        ),
        ("1-D, stride 3", vec![3, 2, 6], vec![2, 4, 3], 1, Window::explicit(&[3], &[3], &[1], &[1, 2], false), vec![1]),
        (
            "3-D",
            vec![2, 4, 3, 2, 3],
            vec![4, 1, 2, 3, 2],
            2,
            Window::explicit(&[2, 3, 2], &[2, 1, 2], &[1, 2, 1], &[1, 0, 1, 0, 1, 0], false),
            vec![1, 0, 0],
        ),
    ];
    for (what, x_shape, w_shape, group, win, output_padding) in convs {
        let k = x_shape.len() - 2;
        let mut y_shape = vec![x_shape[0], w_shape[1] * group];
        for i in 0..k {
            let span = win.strides[i] * (x_shape[2 + i] - 1) + (win.kernel[i] - 1) * win.dilations[i] + 1;
            y_shape.push(span + output_padding[i] - win.pads[i] - win.pads[k + i]);
        }
        let op = Op::ConvTranspose { window: win.clone(), group, output_padding, output_shape: None };
        let grad = Op::ConvTransposeGrad { window: win, group };
        let m = y_shape[1];
        for t in [DType::F32, DType::BF16] {
            let typed = |shape: &[usize], salt| Tensor::from_vec(shape, values(n(shape), salt)).cast(t);
            let (x, w, b) = (typed(&x_shape, 1), typed(&w_shape, 2), typed(&[m], 3));
            let what = format!("{t} ConvTranspose {what}");
            // bf16 products round their columns to bf16 before col2im sums them: a few units.
            let tol = if t == DType::F32 { 1e-5 } else { 2f32.powi(-6) };
            let outs = [Meta::new(t, &y_shape)];
            let ins = [x.clone(), w.clone(), b];
            close_as_f32(&what, &run_typed(&gpu, &op, &ins, &outs), &run_typed(&cpu, &op, &ins, &outs), tol);
            if k == 3 {
                continue; // the gradient over 3 spatial dims has no CUDA kernel (a 3-D convolution)
            }
            let ins = [typed(&y_shape, 4), x, w];
            let outs = [Meta::new(t, &x_shape), Meta::new(t, &w_shape), Meta::new(t, &[m])];
            let (g, c) = (run_typed(&gpu, &grad, &ins, &outs), run_typed(&cpu, &grad, &ins, &outs));
            close_as_f32(&format!("{what}: gradient"), &g, &c, tol);
        }
    }
    let x_shape = [2, 3, 5, 4];
    let roi = vec![0.0, 0.0, -0.2, 0.1, 1.0, 1.0, 0.9, 1.3];
    let scaled = |mode, coordinates, scales: [f32; 4]| Resize::new(mode, coordinates, Target::Scales(scales.to_vec()));
    let resizes = [
        scaled(Interpolation::Nearest, Coordinates::HalfPixel, [1.0, 1.0, 1.6, 0.5]),
        scaled(Interpolation::Nearest, Coordinates::Asymmetric, [1.0, 1.0, 2.0, 3.0]),
        scaled(Interpolation::Linear, Coordinates::AlignCorners, [1.0, 1.0, 2.0, 1.5]),
        scaled(Interpolation::Linear, Coordinates::HalfPixel, [1.0, 1.7, 0.6, 2.0]),
        scaled(Interpolation::Cubic, Coordinates::HalfPixel, [1.0, 1.0, 1.5, 2.0]),
        // Outputs mapped outside the input take the extrapolation value.
        Resize {
            roi,
            extrapolation_value: -2.5,
            ..scaled(Interpolation::Linear, Coordinates::TfCropAndResize, [1.0, 1.0, 1.4, 2.0])
        },
    ];
    for r in resizes {
        let y_shape = r.geometry(&x_shape).unwrap().output;
        let what = format!("Resize {:?} {:?} to {y_shape:?}", r.mode, r.coordinates);
        let grad = Op::ResizeGrad { resize: r.clone(), input_shape: x_shape.to_vec() };
        let op = Op::Resize(r);
        for t in [DType::F32, DType::BF16] {
            let typed = |shape: &[usize], salt| Tensor::from_vec(shape, values(n(shape), salt)).cast(t);
            // Both sum the same terms in the same order in f32: bf16 rounds once, alike.
            let tol = if t == DType::F32 { 1e-5 } else { 2f32.powi(-8) };
            let x = typed(&x_shape, 5);
            let outs = [Meta::new(t, &y_shape)];
            let (g, c) = (run_typed(&gpu, &op, std::slice::from_ref(&x), &outs), run_typed(&cpu, &op, &[x], &outs));
            close_as_f32(&format!("{t} {what}"), &g, &c, tol);
            let dy = typed(&y_shape, 6);
            let outs = [Meta::new(t, &x_shape)];
            let (g, c) =
                (run_typed(&gpu, &grad, std::slice::from_ref(&dy), &outs), run_typed(&cpu, &grad, &[dy], &outs));
            close_as_f32(&format!("{t} {what}: gradient"), &g, &c, tol);
        }
    }
}

/// The gradients that scatter-add (Gather's, GatherElements', GatherND's, Pad's) of half values,
/// as mixed precision leaves them where an exported model gathers from an activation (the
/// recurrent nets' last step, a padded sequence): summed in f32 and rounded once, on the
/// emulated kernels as on the CPU backend, ids repeated so that rows add up.
#[test]
fn scatter_gradients_of_half_values_match_the_cpu_on_the_emulated_kernels() {
    let (gpu, cpu) = (EmulatedGpu::new(), CpuBackend::new());
    for t in [DType::BF16, DType::F16] {
        let dy = |shape: &[usize]| Tensor::from_vec(shape, values(shape.iter().product(), 3)).cast(t);
        let ids = |shape: &[usize], v: Vec<i64>| Tensor::from_vec(shape, v);
        let cases = [
            (
                Op::GatherGrad { axis: 1, data_shape: vec![2, 5, 3] },
                vec![dy(&[2, 4, 3]), ids(&[4], vec![4, 0, 4, -1])],
                vec![2, 5, 3],
            ),
            (
                Op::GatherElementsGrad { axis: 0, data_shape: vec![3, 4] },
                vec![dy(&[2, 4]), ids(&[2, 4], vec![0, 2, 2, 1, 0, 2, 1, 1])],
                vec![3, 4],
            ),
            (
                Op::GatherNDGrad { batch_dims: 0, data_shape: vec![3, 2, 4] },
                vec![dy(&[3, 4]), ids(&[3, 2], vec![0, 1, 2, 0, 0, 1])],
                vec![3, 2, 4],
            ),
            (
                Op::PadGrad { mode: PadMode::Reflect, pads: vec![0, 2, 0, 1], input_shape: vec![2, 4] },
                vec![dy(&[2, 7])],
                vec![2, 4],
            ),
        ];
        for (op, inputs, shape) in cases {
            let out = [Meta::new(t, &shape)];
            let (g, c) = (run_typed(&gpu, &op, &inputs, &out), run_typed(&cpu, &op, &inputs, &out));
            close_as_f32(&format!("{t} {}", op.onnx_name().0), &g, &c, 0.0);
        }
    }
}
