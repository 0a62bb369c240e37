//! The `graph` crate: StableHLO in, differentiated StableHLO out.
//!
//! * [`import`] reads a StableHLO loss module (pretty or generic form) through
//!   IREE's parser and melior into pcp's own [`ir`].
//! * [`attention`] fuses softmax attention into one op with a flash-style
//!   backward that never keeps the `T × T` probabilities, and [`gelu`] fuses
//!   GELU into one op whose backward reads only its input.
//! * [`autodiff`] derives exact reverse-mode gradients.
//! * [`train`] fuses forward, gradient and optimizer into `train_step`.
//! * [`precision`] runs a forward's matmuls in bf16 (mixed precision).
//! * [`recompute`] chooses activations the backward recomputes instead of keeping.
//! * [`models`] builds built-in models (nanoGPT) as StableHLO, no Python.
//! * [`target`] maps the GPU names users type to IREE's, and [`compile()`]
//!   builds a VMFB per (backend, target), cached by content.
//! * [`inspect`] summarises a model for `pcp-node graph inspect`.
//! * [`plan`] lists a GPU step's dispatches with their work, bytes, roofline time
//!   and whether they use the target's matrix instructions, without a GPU.
//!
//! MLIR contexts never leave the function that creates them, so everything
//! this crate returns is plain, `Send` Rust data.

pub mod attention;
pub mod autodiff;
pub mod compile;
pub mod cost;
pub mod gelu;
pub mod import;
pub mod inspect;
pub mod ir;
pub mod iree;
pub mod models;
pub mod plan;
pub mod precision;
pub mod recompute;
pub mod target;
pub mod train;

pub use attention::{Attention, UnknownAttention};
pub use autodiff::{GradError, Gradient, Signature, differentiate};
pub use compile::{Artifact, CompileError, compile};
pub use import::{ImportError, import_file, import_str};
pub use ir::{Function, Module, TensorType};
pub use models::{BuildError, BuiltModel, NanoGptConfig, nanogpt};
pub use precision::{Precision, UnknownPrecision, mixed_precision};
pub use recompute::{Recompute, UnknownRecompute};
pub use target::{Backend, Target, UnknownBackend, UnknownTarget};
pub use train::{Optimizer, SparseScreen, StepConfig, TrainModule, train_step};
