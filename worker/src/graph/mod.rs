//! The graph engine: IR (over the operator vocabulary, `crate::op`), ONNX conversion, static binding (shape
//! inference and folding, sequences resolved into their tensors, recurrent layers unrolled
//! over the sequence, Einsum written out as products) and fusion passes.

pub mod autocast;
pub mod einsum;
pub mod flops;
pub mod fuse;
pub mod infer;
pub mod ir;
pub mod onnx_io;
pub mod recurrent;
pub mod sequence;
