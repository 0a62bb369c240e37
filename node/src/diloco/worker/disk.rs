//! What a worker keeps on disk for a run, each written atomically (a temporary
//! file renamed over the old): the highest term it followed, its chain (term,
//! round and parameters last trained), and a sparse run's error feedback.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use pcp_protocol::RunId;
use pcp_protocol::diloco::sparse::{ErrorFeedback, Settings};
use pcp_protocol::failover::Chain;
use serde_json::json;

use crate::diloco::wire;

/// Where a sparse run's error feedback survives a restart.
pub(super) fn feedback_path(data_dir: &Path, run: RunId) -> PathBuf {
    data_dir.join("worker").join(format!("feedback-{}.bin", run.to_hex()))
}

pub(super) fn chain_path(data_dir: &Path, run: RunId) -> PathBuf {
    data_dir.join("worker").join(format!("chain-{}.json", run.to_hex()))
}

/// Where a worker keeps the highest term it has seen for `run` (a lease it
/// followed, whether or not it trained a round of it): across a restart it never
/// follows a lower one.
pub(super) fn term_path(data_dir: &Path, run: RunId) -> PathBuf {
    data_dir.join("worker").join(format!("term-{}.json", run.to_hex()))
}

/// The highest term saved at `path`; 0 when absent, damaged or longer than a
/// record (4 KiB).
pub(super) fn load_term(path: &Path) -> u64 {
    std::fs::read(path)
        .ok()
        .filter(|b| b.len() <= 4096)
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["term"].as_u64())
        .unwrap_or(0)
}

pub(super) fn save_term(path: &Path, term: u64) -> anyhow::Result<()> {
    let dir = path.parent().context("term path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, json!({ "term": term }).to_string()).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))?;
    Ok(())
}

/// The highest term this worker followed and the round it last trained, saved for
/// `run` (fencing across restarts); nothing when absent or damaged.
pub(super) fn load_chain(path: &Path) -> Chain {
    let read = || -> anyhow::Result<Chain> {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)?;
        let params = hex::decode(v["params"].as_str().context("params")?)?;
        Ok(Chain {
            term: v["term"].as_u64().context("term")?,
            round: v["round"].as_u64().context("round")?,
            params: params.try_into().map_err(|_| anyhow::anyhow!("params is not 32 bytes"))?,
        })
    };
    match read() {
        Ok(chain) => chain,
        Err(e) => {
            if path.exists() {
                tracing::warn!("ignoring {}: {e:#}", path.display());
            }
            Chain::default()
        }
    }
}

pub(super) fn save_chain(path: &Path, chain: &Chain) -> anyhow::Result<()> {
    let dir = path.parent().context("chain path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = path.with_extension("tmp");
    let v = json!({"term": chain.term, "round": chain.round, "params": hex::encode(chain.params)});
    std::fs::write(&tmp, v.to_string()).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))?;
    Ok(())
}

/// The error-feedback buffer saved for `run`, if any fits these sizes, else zeros.
pub(super) fn load_feedback(path: &Path, sizes: &[usize], settings: Settings) -> ErrorFeedback {
    let mut feedback = ErrorFeedback::new(sizes, settings.decay(), settings.up);
    match std::fs::read(path) {
        Ok(bytes) => match wire::read_params(&bytes, sizes) {
            Ok(buffer) => feedback.buffer = buffer,
            Err(e) => tracing::warn!("ignoring {}: {e:#}", path.display()),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("reading {}: {e}", path.display()),
    }
    feedback
}

/// Saves the error feedback atomically (a temporary file renamed over the old).
pub(super) fn save_feedback(path: &Path, feedback: &ErrorFeedback) -> anyhow::Result<()> {
    let dir = path.parent().context("feedback path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, wire::params_blob(&feedback.buffer)).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests;
