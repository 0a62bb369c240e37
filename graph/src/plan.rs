//! What a compiled step costs on a GPU, dispatch by dispatch, without one.
//!
//! [`plan`] compiles a module for a GPU target as [`crate::compile()`] does,
//! keeping IREE's intermediate files, and reads from them:
//!
//! * each dispatch of a function and how often the function launches it (the
//!   `stream` phase's `stream.cmd.dispatch` sites);
//! * its compulsory bytes: what its `dispatch.tensor.load`s read and its
//!   `dispatch.tensor.store`s write (the executable sources);
//! * its floating-point work, `2·∏ loop ranges` for a contraction as IREE names it
//!   (`matmul_8192x3072x768_bf16xbf16xf32`: 8192×3072×768 multiply-adds), none for
//!   the rest;
//! * whether its code uses the target's matrix instructions: `mma`/`wgmma` in the
//!   PTX for CUDA, `v_mfma`/`v_wmma` in the assembly for ROCm.
//!
//! With a device's [`Peak`] each dispatch gets a roofline time: the longer of its
//! work at the matrix (or plain f32) rate and its bytes at the memory's rate.

use std::collections::BTreeMap;
use std::path::Path;

use crate::compile::{CompileError, compile_keeping_phases, extra_flags, target_text};
use crate::ir::{Module, TensorType};
use crate::target::{Backend, Target};

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The module did not compile.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// Only CUDA and ROCm targets are planned.
    #[error("gpu-plan plans cuda and rocm targets, not {0}")]
    Backend(Backend),
    /// IREE's intermediate files could not be written or read.
    #[error("IREE's intermediate files in {path}: {source}")]
    Files {
        /// The file or folder.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The function has no dispatches in IREE's `stream` phase.
    #[error("no dispatches of @{0} in IREE's stream phase")]
    NoDispatches(String),
}

/// A device's peak rates (dense, from its datasheet).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peak {
    /// The device the rates are for.
    pub device: &'static str,
    /// bf16 matrix TFLOP/s.
    pub bf16_tflops: f64,
    /// f32 TFLOP/s without TF32 (vector or matrix, whichever the device has).
    pub f32_tflops: f64,
    /// Memory GB/s.
    pub memory_gbs: f64,
}

/// The device a target's plan is priced at: an H100 SXM for CUDA, an MI300X for
/// ROCm's CDNA3 (`gfx942`), an MI250X for CDNA2 (`gfx90a`); none for others.
pub fn peak(target: &Target) -> Option<Peak> {
    match (target.backend, target.iree_name()) {
        (Backend::Cuda, _) => {
            Some(Peak { device: "NVIDIA H100 SXM", bf16_tflops: 989.4, f32_tflops: 66.9, memory_gbs: 3350.0 })
        }
        (Backend::Rocm, Some("gfx942") | None) => {
            Some(Peak { device: "AMD MI300X", bf16_tflops: 1307.4, f32_tflops: 163.4, memory_gbs: 5300.0 })
        }
        (Backend::Rocm, Some("gfx90a")) => {
            Some(Peak { device: "AMD MI250X", bf16_tflops: 383.0, f32_tflops: 95.7, memory_gbs: 3276.8 })
        }
        _ => None,
    }
}

/// One dispatch of the planned function.
#[derive(Clone, Debug, PartialEq)]
pub struct Dispatch {
    /// IREE's name for it (`train_step_dispatch_104_matmul_8192x3072x768_bf16xbf16xf32`).
    pub name: String,
    /// Launches per call of the function.
    pub launches: u32,
    /// Floating-point operations per launch (contractions only).
    pub flops: f64,
    /// Bytes read and written per launch.
    pub bytes: f64,
    /// Whether it is a contraction with bf16 or f16 operands.
    pub low_precision: bool,
    /// Whether its code uses matrix instructions; `None` where the code was not found.
    pub matrix_instructions: Option<bool>,
}

impl Dispatch {
    /// Whether IREE named it a contraction.
    pub fn is_contraction(&self) -> bool {
        self.flops > 0.0
    }

    /// Seconds per launch at `peak`: the longer of its work and its bytes.
    pub fn roofline_s(&self, peak: &Peak) -> f64 {
        let rate = if self.low_precision { peak.bf16_tflops } else { peak.f32_tflops } * 1e12;
        (self.flops / rate).max(self.bytes / (peak.memory_gbs * 1e9))
    }
}

/// The dispatches of one function for one target, in launch order of first use.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The target compiled for.
    pub target: Target,
    /// The function planned.
    pub function: String,
    /// Its dispatches.
    pub dispatches: Vec<Dispatch>,
    /// What the target's plan is priced at.
    pub peak: Option<Peak>,
}

impl Plan {
    /// Roofline seconds per call of the function, summed over launches.
    pub fn roofline_s(&self) -> Option<f64> {
        let peak = self.peak?;
        Some(self.dispatches.iter().map(|d| d.roofline_s(&peak) * f64::from(d.launches)).sum())
    }

    /// Launches per call.
    pub fn launches(&self) -> u32 {
        self.dispatches.iter().map(|d| d.launches).sum()
    }
}

/// Compiles `module` for `target` (CUDA or ROCm) with IREE's intermediate files
/// kept in a temporary folder, and plans `function`.
pub fn plan(module: &Module, target: &Target, function: &str) -> Result<Plan, PlanError> {
    if !matches!(target.backend, Backend::Cuda | Backend::Rocm) {
        return Err(PlanError::Backend(target.backend));
    }
    let dir = tempfile::tempdir().map_err(|source| PlanError::Files { path: "a temporary folder".into(), source })?;
    let (sources, code, phases) = (dir.path().join("sources"), dir.path().join("code"), dir.path().join("phases"));
    let (text, _) = target_text(module, target)?;
    let mut flags = target.flags();
    flags.extend(extra_flags(target));
    flags.push(format!("--iree-hal-dump-executable-sources-to={}", sources.display()));
    // PTX is the binary CUDA dumps; ROCm's assembly is an intermediate
    flags.push(format!("--iree-hal-dump-executable-binaries-to={}", code.display()));
    flags.push(format!("--iree-hal-dump-executable-intermediates-to={}", code.display()));
    compile_keeping_phases(&text, &flags, target, &phases)?;

    let launches = launches(&read_matching(&phases, ".stream.mlir")?, function);
    if launches.is_empty() {
        return Err(PlanError::NoDispatches(function.to_owned()));
    }
    let bytes = binding_bytes(&read_matching(&sources, ".mlir")?);
    let code = matrix_use(&read_matching(&code, ".ptx")?, &read_matching(&code, ".rocmasm")?);
    let dispatches = launches
        .into_iter()
        .map(|(name, count)| Dispatch {
            flops: contraction_flops(&name).unwrap_or(0.0),
            low_precision: is_low_precision_contraction(&name),
            bytes: bytes.get(&name).copied().unwrap_or(0.0),
            matrix_instructions: code.get(&name).copied(),
            launches: count,
            name,
        })
        .collect();
    Ok(Plan { target: target.clone(), function: function.to_owned(), dispatches, peak: peak(target) })
}

/// The text of every file in `dir` whose name ends with `suffix`, concatenated.
fn read_matching(dir: &Path, suffix: &str) -> Result<String, PlanError> {
    let files = |e| PlanError::Files { path: dir.display().to_string(), source: e };
    let mut text = String::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(text);
    };
    let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for p in paths.iter().filter(|p| p.to_string_lossy().ends_with(suffix)) {
        text.push_str(&std::fs::read_to_string(p).map_err(files)?);
        text.push('\n');
    }
    Ok(text)
}

/// Launches per call of `function`, by dispatch, in order of first launch, from the
/// `stream` phase (pretty or generic form).
fn launches(stream: &str, function: &str) -> Vec<(String, u32)> {
    let mut order: Vec<(String, u32)> = Vec::new();
    let mut inside = false;
    for line in stream.lines() {
        if line.contains("util.func") {
            inside = function_name(line).is_some_and(|n| n == function);
            continue;
        }
        if !inside || !line.contains("stream.cmd.dispatch") {
            continue;
        }
        // `@executable::@export`, or `entry_points = [@executable::@export]`
        let Some(at) = line.find("::@") else { continue };
        let name: String =
            line[at + 3..].chars().take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '.')).collect();
        match order.iter_mut().find(|(n, _)| *n == name) {
            Some((_, count)) => *count += 1,
            None => order.push((name, 1)),
        }
    }
    order
}

/// The name of the function a `util.func` line opens.
fn function_name(line: &str) -> Option<&str> {
    if let Some(at) = line.find("sym_name = \"") {
        let rest = &line[at + 12..];
        return rest.split('"').next();
    }
    let rest = &line[line.find('@')? + 1..];
    rest.split(['(', ' ']).next()
}

/// Bytes loaded and stored by each export of the executable sources (an executable's
/// loads and stores count for each of its exports).
fn binding_bytes(sources: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for executable in sources.split("\"hal.executable\"").skip(1) {
        let mut exports = Vec::new();
        let mut bytes = 0.0;
        for line in executable.lines() {
            if line.contains("\"hal.executable.export\"") {
                if let Some(at) = line.find("sym_name = \"") {
                    exports.push(line[at + 12..].split('"').next().unwrap_or_default().to_owned());
                }
            } else if line.contains("\"iree_tensor_ext.dispatch.tensor.load\"") {
                bytes += line.rsplit("-> ").next().map_or(0.0, tensor_bytes);
            } else if line.contains("\"iree_tensor_ext.dispatch.tensor.store\"") {
                bytes += line.split(": (").nth(1).map_or(0.0, tensor_bytes);
            }
        }
        for e in exports {
            out.insert(e, bytes);
        }
    }
    out
}

/// Bytes of the first `tensor<…>` type in `text`.
fn tensor_bytes(text: &str) -> f64 {
    let Some(start) = text.find("tensor<") else { return 0.0 };
    let Some(len) = text[start..].find('>') else { return 0.0 };
    TensorType::parse(&text[start..=start + len]).map_or(0.0, |t| t.bytes() as f64)
}

/// For each kernel of the PTX (`.entry name(`) or ROCm assembly (`name:` at a line's
/// start), whether its body uses matrix instructions.
fn matrix_use(ptx: &str, rocm: &str) -> BTreeMap<String, bool> {
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in ptx.lines() {
        if let Some(at) = line.find(".entry ") {
            let name: String = line[at + 7..].chars().take_while(|c| *c != '(' && !c.is_whitespace()).collect();
            out.insert(name.clone(), false);
            current = Some(name);
        } else if let Some(name) = &current
            && (line.contains("mma.sync") || line.contains("wgmma.") || line.contains("wmma.mma"))
        {
            out.insert(name.clone(), true);
        }
    }
    current = None;
    for line in rocm.lines() {
        if let Some(name) =
            line.strip_suffix(':').filter(|n| n.contains("_dispatch_") && !n.starts_with(['.', ' ', '\t']))
        {
            out.insert(name.to_owned(), false);
            current = Some(name.to_owned());
        } else if let Some(name) = &current
            && (line.contains("v_mfma") || line.contains("v_wmma") || line.contains("v_smfmac"))
        {
            out.insert(name.clone(), true);
        }
    }
    out
}

/// `2·∏ loop ranges` of a dispatch IREE names a contraction (`matmul_…`,
/// `batch_matmul_…`, `matvec_…`, `contract_…`), from the shape in its name.
pub fn contraction_flops(name: &str) -> Option<f64> {
    let at = ["batch_matmul", "matmul", "matvec", "vecmat", "contract"].iter().find_map(|k| name.find(k))?;
    let shape = name[at..]
        .split('_')
        .find(|part| part.split('x').all(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit())))?;
    Some(2.0 * shape.split('x').map(|d| d.parse::<f64>().unwrap_or(0.0)).product::<f64>())
}

fn is_low_precision_contraction(name: &str) -> bool {
    contraction_flops(name).is_some() && (name.contains("bf16xbf16") || name.contains("f16xf16"))
}

#[cfg(test)]
mod tests;
