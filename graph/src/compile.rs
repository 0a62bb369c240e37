//! Compiling modules to IREE VMFB artifacts, per (backend, target), with a
//! content-addressed cache.

use std::path::{Path, PathBuf};

use crate::ir::Module;
use crate::iree;
use crate::target::{Backend, Target};

/// Why a module could not be compiled.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The IREE compiler library is missing.
    #[error("the IREE compiler is not available ({0}); run scripts/setup.sh or set EERIE_PYTHON")]
    Unavailable(String),
    /// IREE rejected the module.
    #[error("IREE could not compile for {target}: {message}")]
    Iree {
        /// The target.
        target: Target,
        /// IREE's first error.
        message: String,
    },
    /// A bf16 constant could not be rewritten for a SPIR-V backend.
    #[error("cannot compile for {target}: {source}")]
    Bf16Constant {
        /// The target.
        target: Target,
        /// The constant, and why.
        source: Box<iree::Bf16ConstantError>,
    },
    /// The artifact cache could not be used.
    #[error("artifact cache {path}: {source}")]
    Cache {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// A compiled artifact.
#[derive(Clone, Debug)]
pub struct Artifact {
    /// The VMFB bytes.
    pub vmfb: Vec<u8>,
    /// blake3 of (MLIR, flags, compiler revision), hex.
    pub key: String,
    /// Whether it came from the cache.
    pub cached: bool,
    /// The flags it was compiled with.
    pub flags: Vec<String>,
}

/// Compiles `module` for `target`, caching under `cache_dir` when given.
///
/// Modules for CUDA and ROCm first get [`iree::legalize_for_gpu`] (converted
/// slices as slices of one conversion, embedding gradients as one-hot matmuls);
/// `PCP_IREE_GPU_FORMS=1` gives the cpu those forms too, so that a test can check
/// their numbers where no GPU is. Modules for SPIR-V backends (Vulkan, Metal) first get
/// [`iree::legalize_for_spirv`], which emulates bf16 matmul operands and constants in
/// f32 (IREE 3.13's SPIR-V backend has no bf16 matmuls), or has IREE promote bf16 to
/// f32; a bf16 constant it cannot read (a missing or malformed resource) is
/// [`CompileError::Bf16Constant`].
///
/// It tries [`Target::flags`] with [`Target::tuned_flags`] first when most of the
/// module's matmul work is in matmuls at least 128 wide (data tiling slows narrower ones
/// down); when IREE refuses those, the same without multi-use fusion
/// ([`SINGLE_USE_FUSION`]), then the plain flags (a refusal is remembered in the cache
/// as `<key>.refused`, so it is not retried). `PCP_IREE_FLAGS="--iree-opt-level=O3 …"`
/// adds flags to every attempt, for experiments, and `PCP_IREE_GPU_FLAGS` to every
/// CUDA and ROCm attempt (`bench/gpu_profile.sh`'s variants); `PCP_IREE_PLAIN=1` skips the tuned
/// flags. Flags are part of the cache key.
pub fn compile(module: &Module, target: &Target, cache_dir: Option<&Path>) -> Result<Artifact, CompileError> {
    let compiler = iree::compiler().map_err(CompileError::Unavailable)?;
    let (text, promote_bf16) = target_text(module, target)?;
    let revision = [compiler.get_revision().unwrap_or_default(), iree::global_flags().join(" ")].join(" ");
    let extra = extra_flags(target);
    let plain = std::env::var("PCP_IREE_PLAIN").is_ok_and(|v| !v.is_empty() && v != "0");
    let tuned = if plain || !gains_from_data_tiling(module) { Vec::new() } else { target.tuned_flags() };
    let mut base = target.flags();
    if promote_bf16 {
        base.push("--iree-input-promote-bf16-to-f32".to_owned());
    }
    let attempts = attempts(base, tuned, extra);

    let last = attempts.len() - 1;
    let mut refusal = String::new();
    for (i, flags) in attempts.into_iter().enumerate() {
        let key = cache_key(&text, &flags, &revision);
        let path = cache_dir.map(|d| d.join(format!("{key}.vmfb")));
        let refused = cache_dir.map(|d| d.join(format!("{key}.refused")));
        if let Some(vmfb) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
            return Ok(Artifact { vmfb, key, cached: true, flags });
        }
        if i < last && refused.as_ref().is_some_and(|p| p.exists()) {
            continue;
        }
        let vmfb = match compiler.compile_bytes(text.as_bytes(), &flags) {
            Ok(vmfb) => vmfb,
            Err(e) => {
                refusal = iree::diagnostic(&e);
                if i < last {
                    tracing::info!(%target, "IREE refused the flags {}, trying the next: {refusal}", flags.join(" "));
                    if let (Some(refused), Some(dir)) = (&refused, cache_dir) {
                        let _ = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(refused, &refusal));
                    }
                }
                continue;
            }
        };
        if let (Some(path), Some(dir)) = (&path, cache_dir) {
            let cache = |source| CompileError::Cache { path: path.clone(), source };
            std::fs::create_dir_all(dir).map_err(cache)?;
            // Write to a temporary name, then rename: readers never see half a file.
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, &vmfb).map_err(cache)?;
            std::fs::rename(&tmp, path).map_err(cache)?;
        }
        return Ok(Artifact { vmfb, key, cached: false, flags });
    }
    Err(CompileError::Iree { target: target.clone(), message: refusal })
}

/// The MLIR text IREE compiles for `target`, after that target's rewrites, and
/// whether IREE must promote bf16 to f32 (a SPIR-V module whose bf16 use the
/// emulation leaves alone).
pub(crate) fn target_text(module: &Module, target: &Target) -> Result<(String, bool), CompileError> {
    let mut promote_bf16 = false;
    let text = if target.backend.is_spirv() {
        let mut spirv = module.clone();
        for f in &mut spirv.functions {
            let emulated = iree::legalize_for_spirv(f, module.resources.as_deref())
                .map_err(|source| CompileError::Bf16Constant { target: target.clone(), source: Box::new(source) })?;
            promote_bf16 |= !emulated;
        }
        spirv.to_mlir()
    } else if matches!(target.backend, Backend::Cuda | Backend::Rocm)
        || std::env::var_os("PCP_IREE_GPU_FORMS").is_some()
    {
        let mut gpu = module.clone();
        gpu.functions.iter_mut().for_each(iree::legalize_for_gpu);
        gpu.to_mlir()
    } else {
        module.to_mlir()
    };
    Ok((text, promote_bf16))
}

/// The experiment's flags for `target`: `PCP_IREE_FLAGS`, and `PCP_IREE_GPU_FLAGS` for
/// CUDA and ROCm.
pub(crate) fn extra_flags(target: &Target) -> Vec<String> {
    let mut extra = env_flags("PCP_IREE_FLAGS");
    if matches!(target.backend, Backend::Cuda | Backend::Rocm) {
        extra.extend(env_flags("PCP_IREE_GPU_FLAGS"));
    }
    extra
}

/// Compiles `text` with `flags` for `target`, as one attempt of [`compile`] does,
/// with the IR of each of IREE's compilation phases written into `phases`.
pub(crate) fn compile_keeping_phases(
    text: &str,
    flags: &[String],
    target: &Target,
    phases: &Path,
) -> Result<Vec<u8>, CompileError> {
    use eerie::compiler::{MemBufferOutput, Pipeline};
    let compiler = iree::compiler().map_err(CompileError::Unavailable)?;
    let refused = |e: eerie::compiler::CompilerError| CompileError::Iree {
        target: target.clone(),
        message: iree::diagnostic(&e),
    };
    let mut session = compiler.create_session();
    session.set_flags(flags.to_vec()).map_err(refused)?;
    let source = session.create_source_from_buf(text.as_bytes()).map_err(refused)?;
    let mut invocation = session.create_invocation();
    let mut output = MemBufferOutput::new(compiler).map_err(refused)?;
    invocation
        .set_dump_compilation_phases_to(phases)
        .map_err(refused)?
        .parse_source(source)
        .map_err(refused)?
        .set_verify_ir(true)
        .pipeline(Pipeline::Std)
        .map_err(refused)?
        .output_vm_byte_code(&mut output)
        .map_err(refused)?;
    Ok(output.map_memory().map_err(refused)?.to_vec())
}

/// The whitespace-separated flags of the environment variable `name`, for experiments.
fn env_flags(name: &str) -> Vec<String> {
    std::env::var(name).map(|extra| extra.split_whitespace().map(str::to_owned).collect()).unwrap_or_default()
}

/// The tuned flags' second try: IREE 3.13 fuses a producer that has several uses into
/// one dispatch with their packs for the next matmuls, and on the cpu the micro-batch
/// step of nanogpt-medium (4 sequences, `grad_step`) then gets a 32 KiB vector that it
/// refuses ("operations with large vector sizes"). Without that fusion the tuned flags
/// compile it, and its `grad_step` runs about 10% faster than with the plain flags.
const SINGLE_USE_FUSION: &str = "--iree-dispatch-creation-fuse-multi-use=false";

/// The flag sets to try in turn: the tuned ones, the tuned ones without multi-use
/// fusion ([`SINGLE_USE_FUSION`], unless the experiment's `extra` flags set that
/// option: LLVM refuses an option given twice), then the plain ones.
fn attempts(base: Vec<String>, tuned: Vec<String>, extra: Vec<String>) -> Vec<Vec<String>> {
    let mut attempts = Vec::new();
    if !tuned.is_empty() {
        attempts.push([base.clone(), tuned.clone(), extra.clone()].concat());
        let option = SINGLE_USE_FUSION.split('=').next().unwrap_or(SINGLE_USE_FUSION);
        if !extra.iter().any(|f| f.split('=').next() == Some(option)) {
            attempts.push([base.clone(), tuned, vec![SINGLE_USE_FUSION.to_owned()], extra.clone()].concat());
        }
    }
    attempts.push([base, extra].concat());
    attempts
}

/// Smallest matmul dimension (rows, columns or contraction) at which data tiling pays.
const WIDE: i64 = 128;

/// Whether most of `module`'s matmul work (by multiply-adds) is in matmuls whose every
/// dimension is at least [`WIDE`]. Data tiling packs both operands into 16×16 tiles
/// before each matmul; for nanogpt-medium's 256-wide matmuls that makes the step about
/// 1.5× faster, for nanogpt-small's 64-wide ones the packing costs more than it saves
/// (117k against 124k tokens/s), so such modules get the plain flags.
fn gains_from_data_tiling(module: &Module) -> bool {
    let (mut wide, mut total) = (0.0, 0.0);
    for f in &module.functions {
        for op in &f.ops {
            let Some((batch, m, n, k)) = crate::cost::matmul_dims(f, op) else {
                continue;
            };
            let work = [batch, m, n, k].iter().map(|d| *d as f64).product::<f64>();
            total += work;
            if m.min(n).min(k) >= WIDE {
                wide += work;
            }
        }
    }
    total > 0.0 && 2.0 * wide >= total
}

/// blake3 of (MLIR, flags, compiler revision), hex.
fn cache_key(text: &str, flags: &[String], revision: &str) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(text.as_bytes());
    for f in flags {
        hasher.update(b"\0");
        hasher.update(f.as_bytes());
    }
    hasher.update(b"\0iree ");
    hasher.update(revision.as_bytes());
    hasher.finalize().to_hex().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MATMUL: &str = r#"func.func @main(%a: tensor<256x128xf32>, %b: tensor<128x192xf32>) -> tensor<256x192xf32> {
  %0 = "stablehlo.dot_general"(%a, %b) {dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>} : (tensor<256x128xf32>, tensor<128x192xf32>) -> tensor<256x192xf32>
  return %0 : tensor<256x192xf32>
}"#;

    /// A wide matmul next to a narrow batched one with less work.
    const MIXED: &str = r#"func.func @main(%a: tensor<256x128xf32>, %b: tensor<128x192xf32>, %q: tensor<8x32x16xf32>, %k: tensor<8x16x32xf32>) -> (tensor<256x192xf32>, tensor<8x32x32xf32>) {
  %0 = "stablehlo.dot_general"(%a, %b) {dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>} : (tensor<256x128xf32>, tensor<128x192xf32>) -> tensor<256x192xf32>
  %1 = "stablehlo.dot_general"(%q, %k) {dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [0], rhs_batching_dimensions = [0], lhs_contracting_dimensions = [2], rhs_contracting_dimensions = [1]>} : (tensor<8x32x16xf32>, tensor<8x16x32xf32>) -> tensor<8x32x32xf32>
  return %0, %1 : tensor<256x192xf32>, tensor<8x32x32xf32>
}"#;

    #[test]
    fn the_tuned_flags_are_retried_without_multi_use_fusion_before_the_plain_ones() {
        let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let (base, tuned) = (strings(&["--base"]), strings(&["--tuned"]));
        assert_eq!(
            attempts(base.clone(), tuned.clone(), Vec::new()),
            [strings(&["--base", "--tuned"]), strings(&["--base", "--tuned", SINGLE_USE_FUSION]), base.clone()]
        );
        // an experiment that sets the option itself gets no second copy of it
        let theirs = strings(&["--iree-dispatch-creation-fuse-multi-use=true"]);
        let tries = attempts(base.clone(), tuned.clone(), theirs.clone());
        assert_eq!(tries, [[&base[..], &tuned, &theirs].concat(), [&base[..], &theirs].concat()]);
        // a module that gets no tuned flags is compiled once, plainly
        assert_eq!(attempts(base.clone(), Vec::new(), Vec::new()), [base]);
    }

    #[test]
    fn data_tiling_only_for_wide_matmuls() -> anyhow::Result<()> {
        let module = crate::import_str("mixed", MIXED)?;
        let f = &module.functions[0];
        let dims: Vec<_> = f.ops.iter().filter_map(|op| crate::cost::matmul_dims(f, op)).collect();
        assert_eq!(dims, [(1, 256, 192, 128), (8, 32, 32, 16)]);
        assert!(gains_from_data_tiling(&module), "most work is in the 128-wide matmul");
        let narrow = MATMUL.replace("256x128", "256x64").replace("128x192", "64x192");
        assert!(!gains_from_data_tiling(&crate::import_str("narrow", &narrow)?), "a 64-deep contraction");
        let presets = |c: crate::NanoGptConfig| crate::nanogpt(&c).map(|m| gains_from_data_tiling(&m.module));
        assert!(!presets(crate::NanoGptConfig::small())?, "nanogpt-small is 64 wide");
        assert!(presets(crate::NanoGptConfig::medium())?, "nanogpt-medium is 256 wide");
        Ok(())
    }

    /// Compiles with the tuned flags, caches, and skips tuned flags IREE refused before.
    #[test]
    fn tuned_first_then_without_multi_use_fusion_then_plain_after_refusals() -> anyhow::Result<()> {
        let module = crate::import_str("matmul", MATMUL)?;
        let target = Target::host();
        let dir = tempfile::tempdir()?;
        let first = compile(&module, &target, Some(dir.path()))?;
        assert!(!first.cached);
        assert_eq!(first.flags, [target.flags(), target.tuned_flags()].concat());
        let again = compile(&module, &target, Some(dir.path()))?;
        assert!(again.cached && again.key == first.key && again.vmfb == first.vmfb);

        // a refusal recorded for the tuned flags sends the next compile to them without
        // multi-use fusion, and one recorded for those too to the plain flags
        let other = tempfile::tempdir()?;
        std::fs::write(other.path().join(format!("{}.refused", first.key)), "large vector sizes")?;
        let retried = compile(&module, &target, Some(other.path()))?;
        assert_eq!(retried.flags, [target.flags(), target.tuned_flags(), vec![SINGLE_USE_FUSION.into()]].concat());
        let third = tempfile::tempdir()?;
        for key in [&first.key, &retried.key] {
            std::fs::write(third.path().join(format!("{key}.refused")), "stack allocation limit")?;
        }
        let plain = compile(&module, &target, Some(third.path()))?;
        assert_eq!(plain.flags, target.flags());
        assert!(plain.key != first.key && plain.key != retried.key);
        assert!(third.path().join(format!("{}.vmfb", plain.key)).exists());
        Ok(())
    }
}
