#!/usr/bin/env bash
# Materialises eerie-sys 0.5.0 in .data/patched/eerie-sys with one fix, for the
# workspace's [patch.crates-io]: a no-op `cargo build` stays a no-op.
#
# eerie-sys's build script tells cargo to rerun it when its own CMake build
# directory inside OUT_DIR changes (`rerun-if-changed` on the bindgen include
# paths, and on every header bindgen reads, the ones CMake generates in OUT_DIR
# included). Its own run writes those after the time cargo records for the run,
# so the next build reran CMake and rebuilt eerie, pcp-runtime, pcp-graph and
# pcp-node (2 min 6 s for the first `cargo build --release -p pcp-node` after
# scripts/setup.sh on 2 cores). The fix keeps bindgen's rerun lines for the
# headers it reads from the sources and drops those under OUT_DIR and the
# include paths; the vendored IREE sources and CMake files, which are what the
# runtime is built from, stay tracked (`iree/runtime/src`, `CMakeLists.txt`).
# Nothing of eerie-sys is committed: it is fetched from crates.io by cargo,
# unpacked and edited here. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.5.0
DEST=.data/patched/eerie-sys
STAMP="$DEST/.pcp-patch-v2"
[ -f "$STAMP" ] && exit 0
CARGO_HOME=${CARGO_HOME:-$HOME/.cargo}
crate=$(ls "$CARGO_HOME"/registry/cache/*/eerie-sys-$VERSION.crate 2>/dev/null | head -1 || true)
if [ -z "$crate" ]; then
  # fetch it with cargo from a throwaway project (the workspace itself cannot
  # resolve before the patched copy exists)
  tmp=$(mktemp -d)
  mkdir -p "$tmp/src" && : > "$tmp/src/lib.rs"
  printf '[package]\nname = "fetch-eerie-sys"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\neerie-sys = "=%s"\n' \
    "$VERSION" > "$tmp/Cargo.toml"
  (cd "$tmp" && cargo fetch -q)
  rm -rf "$tmp"
  crate=$(ls "$CARGO_HOME"/registry/cache/*/eerie-sys-$VERSION.crate | head -1)
fi
rm -rf "$DEST" && mkdir -p "$DEST"
tar -xzf "$crate" -C "$DEST" --strip-components=1
python3 - "$DEST/build.rs" <<'PY'
import sys
path = sys.argv[1]
src = open(path).read()
edits = [
    # bindgen: rerun-if-changed for the headers it reads, but not those CMake
    # generated in OUT_DIR (see SOURCE_HEADERS below)
    ("bindgen::CargoCallbacks::new()", "SourceHeaders"),
    # the include paths inside OUT_DIR: not rerun-if-changed
    ('''        println!(
            "cargo:rerun-if-changed={}",
            additional_include_path.display()
        );
''', ""),
]
for old, new in edits:
    assert src.count(old) == 1, f"eerie-sys build.rs changed upstream: {old[:60]!r}"
    src = src.replace(old, new)
SOURCE_HEADERS = """
/// bindgen's `CargoCallbacks`, less the headers under OUT_DIR (pcp's patch).
#[cfg(any(feature = "compiler", feature = "runtime"))]
#[derive(Debug)]
struct SourceHeaders;

#[cfg(any(feature = "compiler", feature = "runtime"))]
impl bindgen::callbacks::ParseCallbacks for SourceHeaders {
    fn include_file(&self, filename: &str) {
        let out = env::var("OUT_DIR").unwrap_or_default();
        if out.is_empty() || !Path::new(filename).starts_with(&out) {
            println!("cargo:rerun-if-changed={filename}");
        }
    }

    fn read_env_var(&self, key: &str) {
        println!("cargo:rerun-if-env-changed={key}");
    }
}
"""
src += SOURCE_HEADERS
open(path, "w").write(src)
PY
touch "$STAMP"
