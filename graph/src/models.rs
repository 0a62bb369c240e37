//! Built-in models, emitted as StableHLO through pcp's [`ir`](crate::ir)
//! without Python.
//!
//! A builder returns a [`BuiltModel`]: a module whose `@main` takes the
//! parameters, then the integer data inputs, and returns a scalar loss, plus
//! the name, type and initializer of every parameter in argument order.

mod nanogpt;

pub use nanogpt::{NanoGptConfig, emit_mlir, nanogpt};

use crate::ir::{Module, TensorType};

/// How a parameter is initialised before training.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Independent normal samples with mean 0 and this standard deviation.
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
}

/// One parameter: an argument of the model's entry functions.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// A dotted name, as nanoGPT's PyTorch state dict spells it.
    pub name: String,
    /// Shape and element type.
    pub ty: TensorType,
    /// Initializer.
    pub init: Init,
}

/// A model built by pcp.
#[derive(Clone, Debug)]
pub struct BuiltModel {
    /// `@main(params…, data…) -> loss` and any other entry points.
    pub module: Module,
    /// The parameters, in argument order; they come first in every entry.
    pub params: Vec<ParamSpec>,
    /// The data inputs of `@main` (name, type), after the parameters.
    pub data: Vec<(String, TensorType)>,
}

impl BuiltModel {
    /// Total number of parameter elements.
    pub fn parameter_count(&self) -> i64 {
        self.params.iter().map(|p| p.ty.elements()).sum()
    }
}

/// Why a model could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// The configuration is inconsistent.
    #[error("invalid {model} configuration: {reason}")]
    Config {
        /// The model.
        model: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// The built-in presets' names, for messages.
pub const PRESETS: &str = "nanogpt-small, nanogpt-medium, gpt2-124m";

/// The nanoGPT preset called `name` (`nanogpt-small`, `nanogpt-medium`, `gpt2-124m`).
pub fn preset(name: &str) -> Option<NanoGptConfig> {
    match name {
        "nanogpt-small" => Some(NanoGptConfig::small()),
        "nanogpt-medium" => Some(NanoGptConfig::medium()),
        "gpt2-124m" => Some(NanoGptConfig::gpt2_124m()),
        _ => None,
    }
}
