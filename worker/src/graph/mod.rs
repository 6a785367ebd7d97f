//! The graph engine: IR, the operator vocabulary, ONNX conversion, static binding (shape
//! inference and folding, sequences resolved into their tensors, recurrent layers unrolled
//! over the sequence, Einsum written out as products) and fusion passes.

pub mod autocast;
pub mod einsum;
pub mod flops;
pub mod fuse;
pub mod infer;
pub mod ir;
pub mod onnx_io;
pub mod op;
pub mod recurrent;
pub mod resize;
pub mod sequence;
