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
    /// that still does not compile with them is compiled with [`Target::flags`] alone.
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
/// It tries [`Target::flags`] with [`Target::tuned_flags`] first and, when IREE refuses
/// those, the plain flags (a refusal is remembered in the cache as `<key>.refused`, so
/// it is not retried). `PCP_IREE_FLAGS="--iree-opt-level=O3 …"` adds flags to every
/// attempt, for experiments; `PCP_IREE_PLAIN=1` skips the tuned flags. Flags are part
/// of the cache key.
pub fn compile(module: &Module, target: &Target, cache_dir: Option<&Path>) -> Result<Artifact, CompileError> {
    let compiler = iree::compiler().map_err(CompileError::Unavailable)?;
    let text = module.to_mlir();
    let revision = compiler.get_revision().unwrap_or_default();
    let extra: Vec<String> = std::env::var("PCP_IREE_FLAGS")
        .map(|extra| extra.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    let plain = std::env::var("PCP_IREE_PLAIN").is_ok_and(|v| !v.is_empty() && v != "0");
    let tuned = if plain { Vec::new() } else { target.tuned_flags() };
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

    const MATMUL: &str = r#"func.func @main(%a: tensor<64x32xf32>, %b: tensor<32x16xf32>) -> tensor<64x16xf32> {
  %0 = "stablehlo.dot_general"(%a, %b) {dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>} : (tensor<64x32xf32>, tensor<32x16xf32>) -> tensor<64x16xf32>
  return %0 : tensor<64x16xf32>
}"#;

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
