//! tensorfleet-worker: the training engine.
//!
//! `config`, `error`, `files` and `progress` build everywhere (the operator embeds the configuration
//! type and reads the progress report); the engine needs the `engine` feature.
pub mod config;
#[cfg(feature = "engine")]
pub mod data;
pub mod error;
pub mod files;

#[cfg(feature = "engine")]
pub mod autodiff;
#[cfg(feature = "engine")]
pub mod backend;
#[cfg(feature = "engine")]
pub mod checkpoint;
#[cfg(feature = "engine")]
pub mod comm;
#[cfg(feature = "engine")]
pub mod exec;
#[cfg(feature = "engine")]
pub mod export;
#[cfg(feature = "engine")]
pub mod graph;
#[cfg(feature = "engine")]
pub mod host;
#[cfg(feature = "engine")]
pub mod inspect;
#[cfg(feature = "engine")]
pub mod kernels;
#[cfg(feature = "engine")]
pub mod models;
#[cfg(feature = "engine")]
pub mod monitor;
#[cfg(feature = "engine")]
pub mod onnx;
#[cfg(feature = "engine")]
pub mod op;
#[cfg(feature = "engine")]
pub mod optim;
#[cfg(feature = "engine")]
pub mod parallel;
#[cfg(feature = "cli")]
pub mod prepare;
pub mod progress;
#[cfg(feature = "engine")]
pub mod rng;
#[cfg(feature = "engine")]
pub mod runner;
#[cfg(feature = "engine")]
pub mod session;
#[cfg(feature = "engine")]
pub mod shape;
#[cfg(feature = "engine")]
pub mod tensor;
