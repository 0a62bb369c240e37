//! Compiling modules to IREE VMFB artifacts, per (backend, target), with a
//! content-addressed cache.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::ir::Module;
use crate::iree;

/// A hardware backend IREE can compile for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    /// llvm-cpu, run on IREE's `local-task` driver.
    Cpu,
    /// NVIDIA GPUs (PTX); target `sm_XX`.
    Cuda,
    /// AMD GPUs (HIP); target `gfx9XX`.
    Rocm,
    /// Vulkan (SPIR-V).
    Vulkan,
    /// Apple GPUs (Metal via SPIR-V).
    Metal,
}

impl Backend {
    /// Every backend.
    pub const ALL: [Backend; 5] = [Self::Cpu, Self::Cuda, Self::Rocm, Self::Vulkan, Self::Metal];

    /// The name used on the command line and the wire.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Rocm => "rocm",
            Self::Vulkan => "vulkan",
            Self::Metal => "metal",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown backend name.
#[derive(Debug, thiserror::Error)]
#[error("unknown backend {0:?}; expected one of cpu, cuda, rocm, vulkan, metal")]
pub struct UnknownBackend(String);

impl FromStr for Backend {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|b| b.name() == s).ok_or_else(|| UnknownBackend(s.to_owned()))
    }
}

/// What to compile for: a backend and an optional target (`sm_80`, `gfx942`,
/// an LLVM CPU name; `host` by default on cpu).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    /// The backend.
    pub backend: Backend,
    /// The device target, if any.
    pub target: Option<String>,
}

impl Target {
    /// The host CPU.
    pub fn host() -> Self {
        Self { backend: Backend::Cpu, target: None }
    }

    /// The `iree-compile` flags for this target.
    ///
    /// | backend | flags |
    /// | --- | --- |
    /// | cpu | `--iree-hal-target-backends=llvm-cpu --iree-llvmcpu-target-cpu=<target or host>` |
    /// | cuda | `--iree-hal-target-backends=cuda --iree-cuda-target=<sm_XX>` |
    /// | rocm | `--iree-hal-target-backends=rocm --iree-rocm-target=<gfx9XX>` |
    /// | vulkan | `--iree-hal-target-backends=vulkan-spirv [--iree-vulkan-target=<t>]` |
    /// | metal | `--iree-hal-target-backends=metal-spirv [--iree-metal-target-platform=<macos/ios>]` |
    pub fn flags(&self) -> Vec<String> {
        let t = self.target.as_deref();
        let (backend, target_flag) = match self.backend {
            Backend::Cpu => ("llvm-cpu", Some(format!("--iree-llvmcpu-target-cpu={}", t.unwrap_or("host")))),
            Backend::Cuda => ("cuda", t.map(|t| format!("--iree-cuda-target={t}"))),
            Backend::Rocm => ("rocm", t.map(|t| format!("--iree-rocm-target={t}"))),
            Backend::Vulkan => ("vulkan-spirv", t.map(|t| format!("--iree-vulkan-target={t}"))),
            Backend::Metal => ("metal-spirv", t.map(|t| format!("--iree-metal-target-platform={t}"))),
        };
        let mut flags = vec![format!("--iree-hal-target-backends={backend}")];
        flags.extend(target_flag);
        flags
    }

    /// Flags tried first, on top of [`Target::flags`], for speed. On cpu: data tiling with
    /// IREE's microkernels (matmuls become packed `mmt4d` calls), which makes
    /// nanogpt-medium's step about 1.5× faster on an AVX-512 host. The stack limit of a
    /// dispatch is raised from 32 to 64 KiB (IREE's task workers have 128 KiB stacks):
    /// a tiled matmul with a fused multi-output epilogue needs about 35 KiB. A module
    /// that still does not compile with them is compiled with [`Target::flags`] alone, and so
    /// is one whose matmuls are too narrow to gain from data tiling (see [`compile`]).
    pub fn tuned_flags(&self) -> Vec<String> {
        match self.backend {
            Backend::Cpu => vec![
                "--iree-opt-data-tiling=true".into(),
                "--iree-llvmcpu-enable-ukernels=all".into(),
                format!("--iree-llvmcpu-stack-allocation-limit={}", 64 * 1024),
            ],
            Backend::Cuda | Backend::Rocm | Backend::Vulkan | Backend::Metal => Vec::new(),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.target {
            Some(t) => write!(f, "{}:{t}", self.backend),
            None => write!(f, "{}", self.backend),
        }
    }
}

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
/// It tries [`Target::flags`] with [`Target::tuned_flags`] first when most of the
/// module's matmul work is in matmuls at least 128 wide (data tiling slows narrower ones
/// down) and, when IREE refuses those, the plain flags (a refusal is remembered in the
/// cache as `<key>.refused`, so it is not retried). `PCP_IREE_FLAGS="--iree-opt-level=O3 …"`
/// adds flags to every attempt, for experiments; `PCP_IREE_PLAIN=1` skips the tuned
/// flags. Flags are part of the cache key.
pub fn compile(module: &Module, target: &Target, cache_dir: Option<&Path>) -> Result<Artifact, CompileError> {
    let compiler = iree::compiler().map_err(CompileError::Unavailable)?;
    let text = module.to_mlir();
    let revision = compiler.get_revision().unwrap_or_default();
    let extra: Vec<String> = std::env::var("PCP_IREE_FLAGS")
        .map(|extra| extra.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    let plain = std::env::var("PCP_IREE_PLAIN").is_ok_and(|v| !v.is_empty() && v != "0");
    let tuned = if plain || !gains_from_data_tiling(module) { Vec::new() } else { target.tuned_flags() };
    let mut attempts = Vec::new();
    if !tuned.is_empty() {
        attempts.push([target.flags(), tuned, extra.clone()].concat());
    }
    attempts.push([target.flags(), extra].concat());

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
                    tracing::info!(%target, "IREE refused the tuned flags, compiling with the plain ones: {refusal}");
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
            let Some((batch, m, n, k)) = matmul_dims(f, op) else {
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

/// (batch, rows, columns, contraction) of a `stablehlo.dot_general` or `stablehlo.dot`
/// with static shapes.
fn matmul_dims(f: &crate::ir::Function, op: &crate::ir::Op) -> Option<(i64, i64, i64, i64)> {
    use crate::ir::attr::{lookup, parse_ints, struct_fields};
    let (lhs, rhs) = (f.ty(*op.operands.first()?), f.ty(*op.operands.get(1)?));
    let (lb, rb, lc, rc) = match op.name.as_str() {
        "stablehlo.dot" => (vec![], vec![], vec![lhs.rank() as i64 - 1], vec![0]),
        "stablehlo.dot_general" => {
            let fields = struct_fields(op.attr("dot_dimension_numbers")?);
            let ints = |key: &str| lookup(&fields, key).and_then(parse_ints).unwrap_or_default();
            (
                ints("lhs_batching_dimensions"),
                ints("rhs_batching_dimensions"),
                ints("lhs_contracting_dimensions"),
                ints("rhs_contracting_dimensions"),
            )
        }
        _ => return None,
    };
    // the product of `shape`'s sizes at `dims` (`None` for a dynamic size)
    let product = |shape: &[i64], dims: &[usize]| -> Option<i64> {
        dims.iter().map(|d| shape.get(*d).copied().filter(|n| *n >= 0)).product()
    };
    let free = |rank: usize, batch: &[i64], contract: &[i64]| -> Vec<usize> {
        (0..rank).filter(|d| !batch.contains(&(*d as i64)) && !contract.contains(&(*d as i64))).collect()
    };
    let at = |dims: &[i64]| -> Vec<usize> { dims.iter().map(|d| *d as usize).collect() };
    let batch = product(&lhs.shape, &at(&lb))?;
    let k = product(&lhs.shape, &at(&lc))?;
    let m = product(&lhs.shape, &free(lhs.rank(), &lb, &lc))?;
    let n = product(&rhs.shape, &free(rhs.rank(), &rb, &rc))?;
    Some((batch, m, n, k))
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

    #[test]
    fn flags_per_backend() {
        assert_eq!(Target::host().flags(), ["--iree-hal-target-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host"]);
        let rocm = Target { backend: Backend::Rocm, target: Some("gfx942".into()) };
        assert_eq!(rocm.flags(), ["--iree-hal-target-backends=rocm", "--iree-rocm-target=gfx942"]);
        assert_eq!(rocm.to_string(), "rocm:gfx942");
        assert!("tpu".parse::<Backend>().is_err());
        assert_eq!("cuda".parse::<Backend>().ok(), Some(Backend::Cuda));
    }

    #[test]
    fn cpu_alone_is_tuned() {
        let tuned = Target::host().tuned_flags();
        assert!(tuned.contains(&"--iree-opt-data-tiling=true".to_string()), "{tuned:?}");
        assert!(tuned.iter().all(|f| f.starts_with("--iree-")));
        for backend in [Backend::Cuda, Backend::Rocm, Backend::Vulkan, Backend::Metal] {
            assert!(Target { backend, target: None }.tuned_flags().is_empty(), "{backend}");
        }
    }

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
    fn data_tiling_only_for_wide_matmuls() -> anyhow::Result<()> {
        let module = crate::import_str("mixed", MIXED)?;
        let f = &module.functions[0];
        let dims: Vec<_> = f.ops.iter().filter_map(|op| matmul_dims(f, op)).collect();
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
    fn tuned_first_then_plain_after_a_refusal() -> anyhow::Result<()> {
        let module = crate::import_str("matmul", MATMUL)?;
        let target = Target::host();
        let dir = tempfile::tempdir()?;
        let first = compile(&module, &target, Some(dir.path()))?;
        assert!(!first.cached);
        assert_eq!(first.flags, [target.flags(), target.tuned_flags()].concat());
        let again = compile(&module, &target, Some(dir.path()))?;
        assert!(again.cached && again.key == first.key && again.vmfb == first.vmfb);

        // a refusal recorded for the tuned flags sends the next compile to the plain ones
        let other = tempfile::tempdir()?;
        std::fs::write(other.path().join(format!("{}.refused", first.key)), "stack allocation limit")?;
        let plain = compile(&module, &target, Some(other.path()))?;
        assert_eq!(plain.flags, target.flags());
        assert_ne!(plain.key, first.key);
        assert!(other.path().join(format!("{}.vmfb", plain.key)).exists());
        Ok(())
    }
}
