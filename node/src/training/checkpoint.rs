//! Checkpoints: a directory per step with `meta.json` (step, run metadata,
//! tensor index, blake3 of the tensor bytes) and `tensors.bin` (little-endian
//! f32), plus a `latest` file naming the newest. Writes go to a temporary
//! directory that is renamed into place, so a crash never leaves a torn
//! checkpoint behind.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

/// One named tensor.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Tensor {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) data: Vec<f32>,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    name: String,
    shape: Vec<usize>,
    offset: u64,
    len: u64,
}

#[derive(Serialize, Deserialize)]
struct Meta {
    version: u32,
    step: u64,
    blake3: String,
    tensors: Vec<Entry>,
    meta: serde_json::Value,
}

/// A saved training state.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Checkpoint {
    /// Steps completed.
    pub(crate) step: u64,
    /// Run metadata: model, config, tokenizer, sampler state…
    pub(crate) meta: serde_json::Value,
    /// Parameters and optimizer state.
    pub(crate) tensors: Vec<Tensor>,
}

/// A tensor to save, borrowed: a shepherd checkpoints its parameters and momentum
/// without copying them.
pub(crate) struct TensorRef<'a> {
    pub(crate) name: &'a str,
    pub(crate) shape: &'a [usize],
    pub(crate) data: &'a [f32],
}

/// [`Checkpoint::save`] of borrowed tensors: written through a buffer and hashed as
/// they go, never held whole in memory; then only the newest `keep` checkpoints (at
/// least this one) stay.
pub(crate) fn save_refs(
    dir: &Path,
    step: u64,
    meta: &serde_json::Value,
    tensors: &[TensorRef<'_>],
    keep: usize,
) -> anyhow::Result<PathBuf> {
    use std::io::Write as _;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create checkpoint directory {}", dir.display()))?;
    let name = format!("step-{step:08}");
    let final_dir = dir.join(&name);
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let bin = tmp.join("tensors.bin");
    let file = std::fs::File::create(&bin).with_context(|| format!("cannot write {}", bin.display()))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut hasher = blake3::Hasher::new();
    let mut entries = Vec::new();
    let mut offset = 0u64;
    let mut piece = Vec::with_capacity(64 << 10);
    for t in tensors {
        entries.push(Entry { name: t.name.to_owned(), shape: t.shape.to_vec(), offset, len: t.data.len() as u64 });
        for values in t.data.chunks(16 << 10) {
            piece.clear();
            piece.extend(values.iter().flat_map(|v| v.to_le_bytes()));
            hasher.update(&piece);
            out.write_all(&piece).with_context(|| format!("cannot write {}", bin.display()))?;
        }
        offset += 4 * t.data.len() as u64;
    }
    out.flush().with_context(|| format!("cannot write {}", bin.display()))?;
    drop(out);
    let meta =
        Meta { version: 1, step, blake3: hasher.finalize().to_hex().to_string(), tensors: entries, meta: meta.clone() };
    std::fs::write(tmp.join("meta.json"), serde_json::to_vec_pretty(&meta)?)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    let _ = std::fs::remove_dir_all(&final_dir);
    std::fs::rename(&tmp, &final_dir)
        .with_context(|| format!("cannot move checkpoint into {}", final_dir.display()))?;
    let latest_tmp = dir.join(format!(".latest.tmp{}", std::process::id()));
    std::fs::write(&latest_tmp, &name)?;
    std::fs::rename(&latest_tmp, dir.join("latest"))
        .with_context(|| format!("cannot update {}/latest", dir.display()))?;
    prune(dir, keep.max(1));
    Ok(final_dir)
}

/// How many checkpoints `train` keeps.
const KEEP: usize = 3;

impl Checkpoint {
    /// The tensor named `name`.
    pub(crate) fn tensor(&self, name: &str) -> anyhow::Result<&Tensor> {
        self.tensors.iter().find(|t| t.name == name).with_context(|| format!("checkpoint has no tensor {name:?}"))
    }

    /// Saves under `dir/step-NNNNNNNN` and points `dir/latest` at it.
    pub(crate) fn save(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        let tensors: Vec<TensorRef<'_>> =
            self.tensors.iter().map(|t| TensorRef { name: &t.name, shape: &t.shape, data: &t.data }).collect();
        save_refs(dir, self.step, &self.meta, &tensors, KEEP)
    }

    /// Loads the newest checkpoint under `dir` (or `dir` itself if it is one).
    pub(crate) fn load(dir: &Path) -> anyhow::Result<Self> {
        let step_dir = if dir.join("meta.json").is_file() {
            dir.to_owned()
        } else {
            let latest = dir.join("latest");
            let name = std::fs::read_to_string(&latest)
                .with_context(|| format!("no checkpoint in {} (cannot read {})", dir.display(), latest.display()))?;
            dir.join(name.trim())
        };
        let meta_path = step_dir.join("meta.json");
        let meta: Meta = serde_json::from_slice(
            &std::fs::read(&meta_path).with_context(|| format!("cannot read {}", meta_path.display()))?,
        )
        .with_context(|| format!("{} is not a pcp checkpoint", meta_path.display()))?;
        if meta.version != 1 {
            bail!("{}: unsupported checkpoint version {}", meta_path.display(), meta.version);
        }
        let bin = step_dir.join("tensors.bin");
        let bytes = std::fs::read(&bin).with_context(|| format!("cannot read {}", bin.display()))?;
        if blake3::hash(&bytes).to_hex().as_str() != meta.blake3 {
            bail!("{} is corrupt: its blake3 does not match meta.json", bin.display());
        }
        let mut tensors = Vec::new();
        for e in meta.tensors {
            let (start, end) = (e.offset as usize, e.offset as usize + 4 * e.len as usize);
            let elements: usize = e.shape.iter().product();
            if end > bytes.len() || elements != e.len as usize {
                bail!("{}: tensor {:?} lies outside the file or has the wrong size", bin.display(), e.name);
            }
            let data =
                bytes[start..end].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            tensors.push(Tensor { name: e.name, shape: e.shape, data });
        }
        Ok(Self { step: meta.step, meta: meta.meta, tensors })
    }
}

fn prune(dir: &Path, keep: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut steps: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("step-")))
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    for old in steps.into_iter().take(excess) {
        let _ = std::fs::remove_dir_all(old);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> Checkpoint {
        Checkpoint {
            step,
            meta: serde_json::json!({"model": "nanogpt-small"}),
            tensors: vec![
                Tensor { name: "w".into(), shape: vec![2, 3], data: (0..6).map(|i| i as f32 * 0.5).collect() },
                Tensor { name: "b".into(), shape: vec![3], data: vec![-1.0, f32::MIN_POSITIVE, 7.25] },
            ],
        }
    }

    #[test]
    fn round_trips_and_keeps_the_newest() {
        let dir = tempfile::tempdir().expect("tempdir");
        for step in [10, 20, 30, 40] {
            sample(step).save(dir.path()).expect("save");
        }
        let loaded = Checkpoint::load(dir.path()).expect("load");
        assert_eq!(loaded, sample(40));
        let kept = std::fs::read_dir(dir.path())
            .expect("dir")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("step-"))
            .count();
        assert_eq!(kept, KEEP);
    }

    #[test]
    fn corruption_is_detected() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = sample(5).save(dir.path()).expect("save");
        let bin = path.join("tensors.bin");
        let mut bytes = std::fs::read(&bin).expect("read");
        bytes[3] ^= 0xff;
        std::fs::write(&bin, bytes).expect("write");
        let err = Checkpoint::load(dir.path()).expect_err("corrupt").to_string();
        assert!(err.contains("corrupt"), "{err}");
        let missing = Checkpoint::load(&dir.path().join("nowhere")).expect_err("missing").to_string();
        assert!(missing.contains("no checkpoint"), "{missing}");
    }
}
