//! What to compile for: a [`Backend`] and an optional device [`Target`] name,
//! and the names users type mapped to the ones IREE 3.13 accepts.
//!
//! IREE 3.13 describes GPUs by compute capability (`sm_80`), ISA (`gfx942`),
//! microarchitecture (`ampere`, `cdna3`) or product (`a100`, `mi300x`), but not
//! every name a volunteer knows their card by. Notably it has no description
//! of Hopper or Blackwell data-centre parts (`sm_90`, `sm_90a` and `sm_100`
//! give "missing GPU target"): for those pcp compiles Ampere (`sm_80`) PTX,
//! which the CUDA driver JIT-compiles for the card at first load (PTX is
//! forward compatible). [`Target::note`] says so wherever it applies.

use std::fmt;
use std::str::FromStr;

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

    /// Whether IREE compiles for it through SPIR-V (Vulkan, Metal).
    pub fn is_spirv(self) -> bool {
        matches!(self, Self::Vulkan | Self::Metal)
    }

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

    /// The names this backend accepts as a target, each with the name IREE is given.
    /// Empty for cpu, which takes any LLVM CPU name (`host`, `znver4`, `x86-64-v3`, …).
    pub fn aliases(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Self::Cpu => &[],
            Self::Cuda => CUDA,
            Self::Rocm => ROCM,
            Self::Vulkan => VULKAN,
            Self::Metal => METAL,
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
        let s = s.trim().to_ascii_lowercase();
        let s = if s == "hip" { "rocm" } else { s.as_str() };
        Self::ALL.into_iter().find(|b| b.name() == s).ok_or_else(|| UnknownBackend(s.to_owned()))
    }
}

/// Hopper and Blackwell data-centre parts: IREE 3.13 has no description of them.
const AMPERE_PTX: &str = "sm_80";

/// cuda: the name typed, the name IREE is given. Hopper and Blackwell data-centre
/// parts get Ampere PTX (see the module docs).
const CUDA: &[(&str, &str)] = &[
    ("sm_60", "sm_60"),
    ("sm_61", "sm_61"),
    ("sm_62", "sm_62"),
    ("sm_70", "sm_70"),
    ("sm_72", "sm_72"),
    ("sm_75", "sm_75"),
    ("sm_80", "sm_80"),
    ("sm_86", "sm_86"),
    ("sm_87", "sm_87"),
    ("sm_89", "sm_89"),
    ("sm_90", AMPERE_PTX),
    ("sm_90a", AMPERE_PTX),
    ("sm_100", AMPERE_PTX),
    ("sm_100a", AMPERE_PTX),
    ("sm_120", "sm_120"),
    ("pascal", "pascal"),
    ("volta", "volta"),
    ("turing", "turing"),
    ("ampere", "ampere"),
    ("ada", "ada"),
    ("hopper", AMPERE_PTX),
    ("p100", "sm_60"),
    ("v100", "sm_70"),
    ("t4", "sm_75"),
    ("a100", "a100"),
    ("a10", "sm_86"),
    ("a40", "sm_86"),
    ("a6000", "sm_86"),
    ("l4", "sm_89"),
    ("l40", "sm_89"),
    ("l40s", "sm_89"),
    ("h100", AMPERE_PTX),
    ("h200", AMPERE_PTX),
    ("gh200", AMPERE_PTX),
    ("b200", AMPERE_PTX),
    ("rtx2080ti", "sm_75"),
    ("rtx3070", "rtx3070"),
    ("rtx3080", "rtx3080"),
    ("rtx3090", "rtx3090"),
    ("rtx4070", "sm_89"),
    ("rtx4080", "sm_89"),
    ("rtx4090", "rtx4090"),
    ("rtx5090", "sm_120"),
];

/// rocm (HIP): the name typed, the name IREE is given.
const ROCM: &[(&str, &str)] = &[
    ("gfx908", "gfx908"),
    ("gfx90a", "gfx90a"),
    ("gfx942", "gfx942"),
    ("gfx950", "gfx950"),
    ("gfx1100", "gfx1100"),
    ("gfx1101", "gfx1101"),
    ("gfx1102", "gfx1102"),
    ("gfx1103", "gfx1103"),
    ("gfx1150", "gfx1150"),
    ("gfx1151", "gfx1151"),
    ("gfx1200", "gfx1200"),
    ("gfx1201", "gfx1201"),
    ("cdna1", "gfx908"),
    ("cdna2", "gfx90a"),
    ("cdna3", "gfx942"),
    ("cdna4", "gfx950"),
    ("rdna3", "gfx1100"),
    ("rdna4", "gfx1201"),
    ("mi100", "mi100"),
    ("mi210", "mi210"),
    ("mi250", "mi250"),
    ("mi250x", "mi250x"),
    ("mi300a", "mi300a"),
    ("mi300x", "mi300x"),
    ("mi308x", "mi308x"),
    ("mi325x", "mi325x"),
    ("mi350x", "mi350x"),
    ("mi355x", "mi355x"),
    ("rx7700xt", "rx7700xt"),
    ("rx7800xt", "rx7800xt"),
    ("rx7900xt", "rx7900xt"),
    ("rx7900xtx", "rx7900xtx"),
    ("w7800", "w7800"),
    ("w7900", "w7900"),
    ("rx9060xt", "rx9060xt"),
    ("rx9070", "rx9070"),
    ("rx9070xt", "rx9070xt"),
];

/// vulkan: the name typed, IREE's Vulkan target. GPU names of the other backends
/// map to their architecture.
const VULKAN: &[(&str, &str)] = &[
    ("rdna2", "rdna2"),
    ("rdna3", "rdna3"),
    ("rdna4", "rdna4"),
    ("cdna3", "cdna3"),
    ("turing", "turing"),
    ("ampere", "ampere"),
    ("ada", "ada"),
    ("valhall", "valhall"),
    ("mali-g715", "mali-g715"),
    ("adreno", "adreno"),
    ("android", "vp_android_baseline_2022"),
    ("gfx1100", "rdna3"),
    ("gfx1030", "rdna2"),
    ("gfx1201", "rdna4"),
    ("gfx942", "cdna3"),
    ("rx7900xtx", "rdna3"),
    ("sm_75", "turing"),
    ("sm_80", "ampere"),
    ("sm_86", "ampere"),
    ("sm_89", "ada"),
    ("sm_90", "ampere"),
    ("a100", "ampere"),
    ("h100", "ampere"),
    ("rtx3090", "ampere"),
    ("rtx4090", "ada"),
];

/// metal: the platform.
const METAL: &[(&str, &str)] = &[("macos", "macos"), ("ios", "ios")];

/// What to compile for: a backend and an optional target (`sm_80`, `gfx942`,
/// an LLVM CPU name; `host` by default on cpu). `target` is the name as typed
/// (it keys artifacts on the wire); [`Target::iree_name`] is what IREE is given.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    /// The backend.
    pub backend: Backend,
    /// The device target, if any.
    pub target: Option<String>,
}

/// A target name the backend does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {backend} target {name:?}; accepted: {accepted}")]
pub struct UnknownTarget {
    /// The backend.
    pub backend: Backend,
    /// The name given.
    pub name: String,
    /// The accepted names, comma-separated.
    pub accepted: String,
}

impl Target {
    /// The host CPU.
    pub fn host() -> Self {
        Self { backend: Backend::Cpu, target: None }
    }

    /// `backend` with the target `name` as a user typed it (case-insensitive; empty
    /// means the backend's default), or a one-line error listing the accepted names.
    pub fn parse(backend: Backend, name: Option<&str>) -> Result<Self, UnknownTarget> {
        let name = name.map(str::trim).filter(|n| !n.is_empty());
        let Some(name) = name else {
            return Ok(Self { backend, target: None });
        };
        let unknown = || UnknownTarget {
            backend,
            name: name.to_owned(),
            accepted: match backend {
                Backend::Cpu => "host or an LLVM CPU name (znver4, x86-64-v3, skylake-avx512, …)".to_owned(),
                _ => backend.aliases().iter().map(|(typed, _)| *typed).collect::<Vec<_>>().join(", "),
            },
        };
        let name = match backend {
            // LLVM CPU names are case-sensitive and checked by IREE.
            Backend::Cpu if name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.+".contains(c)) => name.to_owned(),
            Backend::Cpu => return Err(unknown()),
            _ => {
                let lower = name.to_ascii_lowercase();
                if !backend.aliases().iter().any(|(typed, _)| *typed == lower) {
                    return Err(unknown());
                }
                lower
            }
        };
        Ok(Self { backend, target: Some(name) })
    }

    /// The target name IREE is given: the alias table's entry, else the name as is.
    pub fn iree_name(&self) -> Option<&str> {
        let name = self.target.as_deref()?;
        Some(self.backend.aliases().iter().find(|(typed, _)| *typed == name).map_or(name, |(_, iree)| *iree))
    }

    /// Why the artifact is built for another name than the one typed, if it is.
    pub fn note(&self) -> Option<String> {
        let typed = self.target.as_deref()?;
        let iree = self.iree_name()?;
        if self.backend == Backend::Cuda && iree == AMPERE_PTX && typed != AMPERE_PTX {
            return Some(format!(
                "IREE 3.13 has no {typed} description: compiling {AMPERE_PTX} PTX, which the CUDA driver \
                 JIT-compiles for the card at first load"
            ));
        }
        None
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
        let t = self.iree_name();
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
    /// IREE's `mmt4d` and `pack` microkernels (matmuls become packed `mmt4d` calls), which
    /// makes nanogpt-medium's step about 1.5× faster on an AVX-512 host. Not its `unpack`
    /// microkernel (`all` has it): with it, a batched matmul with a short contraction
    /// (attention's `q·kᵀ`, 32 or 64 deep) takes twice as long, nanogpt-medium's step
    /// 9% longer and gpt2-124m's bf16 step 10% (`docs/benchmarks.md`). The stack limit of a
    /// dispatch is raised from 32 to 64 KiB (IREE's task workers have 128 KiB stacks):
    /// a tiled matmul with a fused multi-output epilogue needs about 35 KiB. A module
    /// that still does not compile with them is compiled with [`Target::flags`] alone, and so
    /// is one whose matmuls are too narrow to gain from data tiling (see [`crate::compile()`]).
    pub fn tuned_flags(&self) -> Vec<String> {
        match self.backend {
            Backend::Cpu => vec![
                "--iree-opt-data-tiling=true".into(),
                "--iree-llvmcpu-enable-ukernels=mmt4d,pack".into(),
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
        assert_eq!("HIP".parse::<Backend>().ok(), Some(Backend::Rocm));
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

    #[test]
    fn names_users_type_map_to_iree_names() -> anyhow::Result<()> {
        let cases = [
            (Backend::Cuda, "sm_90a", "--iree-cuda-target=sm_80"),
            (Backend::Cuda, "H100", "--iree-cuda-target=sm_80"),
            (Backend::Cuda, "sm_89", "--iree-cuda-target=sm_89"),
            (Backend::Cuda, "l40s", "--iree-cuda-target=sm_89"),
            (Backend::Rocm, "mi300x", "--iree-rocm-target=mi300x"),
            (Backend::Rocm, "cdna3", "--iree-rocm-target=gfx942"),
            (Backend::Rocm, "gfx942", "--iree-rocm-target=gfx942"),
            (Backend::Vulkan, "rtx4090", "--iree-vulkan-target=ada"),
            (Backend::Vulkan, "gfx1100", "--iree-vulkan-target=rdna3"),
            (Backend::Cpu, "znver4", "--iree-llvmcpu-target-cpu=znver4"),
        ];
        for (backend, typed, flag) in cases {
            let target = Target::parse(backend, Some(typed))?;
            assert_eq!(target.flags()[1], flag, "{backend} {typed}");
        }
        let h100 = Target::parse(Backend::Cuda, Some("h100"))?;
        assert_eq!(h100.to_string(), "cuda:h100", "the typed name keys the artifact");
        assert!(h100.note().is_some_and(|n| n.contains("sm_80 PTX")));
        assert_eq!(Target::parse(Backend::Cuda, Some("sm_80"))?.note(), None);
        assert_eq!(Target::parse(Backend::Rocm, Some(""))?, Target { backend: Backend::Rocm, target: None });
        Ok(())
    }

    #[test]
    fn unknown_targets_list_the_accepted_names() {
        let err = Target::parse(Backend::Rocm, Some("gfx1030")).unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("unknown rocm target \"gfx1030\"; accepted: gfx908, gfx90a, gfx942"), "{text}");
        assert!(!text.contains('\n'));
        assert!(Target::parse(Backend::Cuda, Some("sm_999")).unwrap_err().to_string().contains("sm_90a"));
        assert!(Target::parse(Backend::Cpu, Some("host; rm")).is_err());
    }
}
