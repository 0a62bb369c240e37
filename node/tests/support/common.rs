//! What every multi-process test needs.

use std::path::{Path, PathBuf};

/// The demo corpus: `../shared/data/tiny_shakespeare.txt` beside the checkout,
/// else the one `scripts/setup.sh` builds in `.data/`.
pub(crate) fn corpus() -> String {
    let shared = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tiny_shakespeare.txt");
    let local = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.data/tiny_shakespeare.txt");
    let path = if shared.exists() { shared } else { local };
    assert!(path.exists(), "no demo corpus at {}; run scripts/setup.sh", path.display());
    path.display().to_string()
}

/// Bytes of every file under `dir` (none when it is gone).
#[allow(dead_code, reason = "used by the tests that measure a node's disk")]
pub(crate) fn bytes_under(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}
