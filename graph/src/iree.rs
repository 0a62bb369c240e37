//! The IREE compiler library, loaded once per process through eerie, and
//! the rewrites its backends need.

mod legalize;

pub use legalize::{Bf16ConstantError, legalize, legalize_for_gpu, legalize_for_spirv};

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use eerie::compiler::{Compiler, CompilerError, MemBufferOutput};

/// The options IREE must print generic form with; set once per process.
pub(crate) const PRINT_FLAGS: [&str; 2] = ["--mlir-print-op-generic", "--mlir-print-debuginfo"];

static COMPILER: OnceLock<Result<Compiler, String>> = OnceLock::new();

/// The largest operand tile, in bytes, that IREE's cpu code generation gives one
/// workgroup of a data-tiled matmul (`--iree-llvmcpu-matmul-tile-bytes`, a
/// process-wide option; IREE's default is 256 KiB). Steady steps of
/// `iree-benchmark-module` on a 2-core Zen 4 EPYC (1 MiB of L2 per core):
///
/// | tile bytes | gpt2-124m f32 | gpt2-124m bf16 | nanogpt-medium f32 |
/// |---|---|---|---|
/// | 256 KiB | 36.1 s | | |
/// | 1 MiB | 31.6–32.2 s | 20.8–21.1 s | 1.44–1.45 s |
/// | 2 MiB | 32.0 s | 19.5–20.0 s | 1.49 s |
/// | 4 MiB | 31.6–32.1 s | 19.4–20.1 s | 1.36–1.38 s |
///
/// A long-`K` matmul's tile stays in cache while the microkernel streams it;
/// the weight gradients (`K` = the batch's 8192 tokens) gain most: gpt2's
/// `3072×768×8192` in bf16 took 93 instead of 123 ms at 4 MiB. At 16 MiB a
/// gpt2 dispatch needs 82 KiB of stack, over the 64 KiB limit.
pub const MATMUL_TILE_BYTES: usize = 4 << 20;

/// Process-wide compiler options (IREE reads these from its global command line,
/// not from a session's flags): [`MATMUL_TILE_BYTES`], then
/// `PCP_IREE_GLOBAL_FLAGS`, for experiments (one that sets the tile size replaces
/// pcp's). They are part of every artifact's cache key.
pub(crate) fn global_flags() -> Vec<String> {
    let extra: Vec<String> = std::env::var("PCP_IREE_GLOBAL_FLAGS")
        .map(|extra| extra.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    with_defaults(extra)
}

/// pcp's global options, less any that `extra` sets itself, then `extra`.
fn with_defaults(extra: Vec<String>) -> Vec<String> {
    const TILE: &str = "--iree-llvmcpu-matmul-tile-bytes";
    let mut flags = Vec::new();
    if !extra.iter().any(|f| f.split('=').next() == Some(TILE)) {
        flags.push(format!("{TILE}={MATMUL_TILE_BYTES}"));
    }
    flags.extend(extra);
    flags
}

/// The process's IREE compiler, or why it could not be loaded.
pub fn compiler() -> Result<&'static Compiler, String> {
    COMPILER.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Compiler, String> {
    let mut compiler = match find_library() {
        Some(lib) => {
            linker_beside(&lib, std::env::var_os("PATH"))?;
            Compiler::with_library(&lib).map_err(|e| format!("{}: {e}", lib.display()))?
        }
        None => Compiler::new().map_err(|e| first_line(&e.to_string()))?,
    };
    let mut argv = vec!["pcp-node".to_owned()];
    argv.extend(PRINT_FLAGS.iter().map(|f| (*f).to_owned()));
    argv.extend(global_flags());
    compiler.setup_global_cl(argv).map_err(|e| e.to_string())?;
    Ok(compiler)
}

/// IREE links every executable (CPU and GPU alike) with `iree-lld`, which it looks for
/// beside its library, then as `lld`/`ld.lld` on `PATH`. Without one, each compile fails
/// with "failed to link executable": say so once, at load, naming the path.
fn linker_beside(lib: &Path, path: Option<std::ffi::OsString>) -> Result<(), String> {
    let beside = lib.with_file_name("iree-lld");
    let on_path = || {
        path.is_some_and(|path| {
            std::env::split_paths(&path).any(|d| d.join("lld").is_file() || d.join("ld.lld").is_file())
        })
    };
    if beside.is_file() || on_path() {
        return Ok(());
    }
    Err(format!(
        "{}: IREE's linker is missing: no {} beside it and no lld on PATH (copy iree-lld from the same iree-base-compiler wheel)",
        lib.display(),
        beside.display()
    ))
}

/// `PCP_IREE_COMPILER_LIB`, else a `.venv` holding `iree-base-compiler` in the
/// working directory, the executable's directory, or one of their parents.
/// `None` lets eerie ask `EERIE_PYTHON` (or `python` on `PATH`).
fn find_library() -> Option<PathBuf> {
    if let Some(lib) = std::env::var_os("PCP_IREE_COMPILER_LIB") {
        return Some(PathBuf::from(lib));
    }
    if std::env::var_os("EERIE_PYTHON").is_some() {
        return None;
    }
    let starts = [std::env::current_dir().ok(), std::env::current_exe().ok()];
    starts
        .into_iter()
        .flatten()
        .flat_map(|s| s.ancestors().map(Path::to_path_buf).collect::<Vec<_>>())
        .find_map(|dir| venv_library(&dir.join(".venv")))
}

fn venv_library(venv: &Path) -> Option<PathBuf> {
    let lib = venv.join("lib");
    let entries = std::fs::read_dir(&lib).ok()?;
    entries
        .flatten()
        .map(|e| e.path().join("site-packages/iree/compiler/_mlir_libs/libIREECompiler.so"))
        .find(|p| p.is_file())
}

fn first_line(text: &str) -> String {
    text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("unknown error").to_owned()
}

/// Why IREE could not normalise a source.
#[derive(Debug)]
pub(crate) enum NormalizeError {
    /// The compiler library is not available.
    Unavailable(String),
    /// The source does not parse.
    Parse(String),
}

/// Parses `text` with IREE (which knows StableHLO's pretty form) and prints
/// it back in generic form with locations.
pub(crate) fn normalize(text: &str, path: Option<&Path>) -> Result<String, NormalizeError> {
    let compiler = compiler().map_err(NormalizeError::Unavailable)?;
    let session = compiler.create_session();
    let source = match path {
        Some(path) => session.create_source_from_file(path),
        None => session.create_source_from_buf(text.as_bytes()),
    }
    .map_err(|e| NormalizeError::Parse(diagnostic(&e)))?;
    let mut invocation = session.create_invocation();
    invocation.parse_source(source).map_err(|e| NormalizeError::Parse(diagnostic(&e)))?;
    let mut output = MemBufferOutput::new(compiler).map_err(|e| NormalizeError::Unavailable(diagnostic(&e)))?;
    invocation.output_ir(&mut output).map_err(|e| NormalizeError::Parse(diagnostic(&e)))?;
    let bytes = output.map_memory().map_err(|e| NormalizeError::Unavailable(diagnostic(&e)))?;
    String::from_utf8(bytes.to_vec()).map_err(|e| NormalizeError::Parse(e.to_string()))
}

/// The first error line of a compiler error.
pub(crate) fn diagnostic(error: &CompilerError) -> String {
    let text = match error {
        CompilerError::IREECompilerDiagnosticsError(d) => d.to_string(),
        CompilerError::IREECompilerError(e, d) => format!("{d}{e}"),
        other => other.to_string(),
    };
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("Error:"))
        .map(str::to_owned)
        .unwrap_or_else(|| first_line(&text));
    line.trim_start_matches("Error:").trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::{MATMUL_TILE_BYTES, linker_beside, with_defaults};

    #[test]
    fn pcp_sets_the_matmul_tile_size_unless_the_experiment_does() {
        let ours = format!("--iree-llvmcpu-matmul-tile-bytes={MATMUL_TILE_BYTES}");
        assert_eq!(with_defaults(Vec::new()), std::slice::from_ref(&ours));
        let other = vec!["--iree-llvmcpu-fail-on-out-of-bounds-stack-allocation=false".to_owned()];
        assert_eq!(with_defaults(other.clone()), [vec![ours], other].concat());
        // LLVM refuses an option given twice: the experiment's value replaces pcp's
        let theirs = vec!["--iree-llvmcpu-matmul-tile-bytes=65536".to_owned()];
        assert_eq!(with_defaults(theirs.clone()), theirs);
    }

    #[test]
    fn a_compiler_library_without_its_linker_is_one_line_naming_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lib = dir.path().join("libIREECompiler.so");
        let empty = tempfile::tempdir().expect("tempdir");
        let error = linker_beside(&lib, Some(empty.path().into())).expect_err("no linker anywhere");
        assert!(
            error.contains("iree-lld") && error.contains(&lib.display().to_string()) && !error.contains('\n'),
            "{error}"
        );
        // lld on PATH will do
        std::fs::write(empty.path().join("ld.lld"), b"").expect("write");
        linker_beside(&lib, Some(empty.path().into())).expect("ld.lld on PATH");
        // and so will iree-lld beside the library
        std::fs::write(dir.path().join("iree-lld"), b"").expect("write");
        linker_beside(&lib, None).expect("iree-lld beside");
    }
}
