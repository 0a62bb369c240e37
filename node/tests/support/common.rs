//! What every multi-process test needs.

use std::path::PathBuf;

/// The demo corpus: `../shared/data/tiny_shakespeare.txt` beside the checkout,
/// else the one `scripts/setup.sh` builds in `.data/`.
pub(crate) fn corpus() -> String {
    let shared = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tiny_shakespeare.txt");
    let local = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.data/tiny_shakespeare.txt");
    let path = if shared.exists() { shared } else { local };
    assert!(path.exists(), "no demo corpus at {}; run scripts/setup.sh", path.display());
    path.display().to_string()
}
