//! How long an inner step takes: from a FLOP count and a device's sustained
//! FLOP/s, or from a measured step time (`pcp-node bench step`).

use serde::Serialize;

/// Device presets: sustained training FLOP/s, about 40% of the dense peak for
/// GPUs (bf16 tensor cores) and what pcp's IREE CPU step reaches on 2 cores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Device {
    /// Two CPU cores with pcp's IREE llvm-cpu step: about 100 GFLOP/s (nanoGPT-small at
    /// 124k tokens/s is 85 GFLOP/s by the formula, nanoGPT-medium at 5.5k tokens/s 110).
    #[value(name = "cpu-2core")]
    #[serde(rename = "cpu-2core")]
    Cpu2Core,
    /// NVIDIA RTX 4090: 165 TFLOP/s dense bf16 peak, 66 sustained.
    Rtx4090,
    /// NVIDIA A100: 312 TFLOP/s dense bf16 peak, 125 sustained.
    A100,
    /// NVIDIA H100 SXM: 989 TFLOP/s dense bf16 peak, 400 sustained.
    H100,
}

impl Device {
    /// Sustained FLOP/s on a training step.
    pub fn flops(self) -> f64 {
        match self {
            Self::Cpu2Core => 100e9,
            Self::Rtx4090 => 66e12,
            Self::A100 => 125e12,
            Self::H100 => 400e12,
        }
    }

    /// The preset's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu2Core => "cpu-2core",
            Self::Rtx4090 => "rtx4090",
            Self::A100 => "a100",
            Self::H100 => "h100",
        }
    }
}

/// The time of one inner step on a typical worker; stragglers multiply it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ComputeModel {
    /// Seconds per inner step.
    pub step_seconds: f64,
    /// Where the figure came from, for the report.
    pub source: String,
}

impl ComputeModel {
    /// `flops_per_step / device_flops` seconds a step.
    pub fn from_flops(flops_per_step: f64, device_flops: f64, device: &str) -> Self {
        Self {
            step_seconds: flops_per_step / device_flops.max(1.0),
            source: format!("{flops_per_step:.3e} FLOP/step on {device} at {device_flops:.3e} FLOP/s"),
        }
    }

    /// A measured step time.
    pub fn measured(step_seconds: f64) -> Self {
        Self { step_seconds, source: format!("measured {step_seconds} s/step") }
    }
}

/// Where a run's step time came from (the report says which).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StepTimeSource {
    /// The FLOPs per step over the `--device` preset's sustained FLOP/s.
    FlopModel,
    /// A measured `--step-seconds` (`pcp-node bench step`).
    Measured,
}

impl StepTimeSource {
    /// The source in words, for the printed header.
    pub fn describe(self) -> &'static str {
        match self {
            Self::FlopModel => "the device preset's FLOP model",
            Self::Measured => "a measured --step-seconds",
        }
    }
}
