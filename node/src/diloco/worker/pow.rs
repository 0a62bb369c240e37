//! A worker's proof of work for an open run: solved on a blocking thread when a
//! hello is refused for want of it, and kept on disk per run, so a restart, a
//! rejoin or a successor's hello does not pay for it again.
//!
//! A run's difficulty rises with its join rate
//! ([`pcp_protocol::admit::Difficulty`]), and a hello can be refused again for
//! more bits than were asked while it solved: the search then goes on from the
//! nonce it found, so the work already done still counts toward the higher bits
//! ([`MAX_TRIES`] at most).

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use pcp_protocol::admit::{MAX_POW_BITS, pow_bits, solve_pow};
use pcp_protocol::{PublicKey, RunId};

/// Hellos a join says at most for one run's proof of work.
pub(super) const MAX_TRIES: usize = 3;

/// The nonces [`solve_pow`] tries a second on one core, for the estimate a
/// volunteer is shown (measured: `docs/threat-model.md`).
const HASHES_PER_SECOND: f64 = 4.4e6;

/// Where the nonce for `run` is kept.
fn path(data_dir: &Path, run: RunId) -> PathBuf {
    data_dir.join("worker").join(format!("pow-{}.json", run.to_hex()))
}

/// The nonce kept for `key` in `run`, if it is one (a damaged, foreign or weak
/// file reads as none); with the bits it reaches.
pub(super) fn cached(data_dir: &Path, run: RunId, key: &PublicKey) -> Option<(u64, u32)> {
    let bytes = std::fs::read(path(data_dir, run)).ok().filter(|b| b.len() <= 4096)?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    if v["key"].as_str()? != hex::encode(key.0) {
        return None;
    }
    let nonce = v["nonce"].as_u64()?;
    let bits = pow_bits(&run, key, nonce);
    (bits > 0).then_some((nonce, bits))
}

/// A nonce of at least `bits` for `key` in `run`: the kept one if it reaches
/// them, else solved (from past the kept one) and kept.
pub(super) async fn solve(data_dir: &Path, run: RunId, key: PublicKey, bits: u8) -> anyhow::Result<u64> {
    anyhow::ensure!(bits <= MAX_POW_BITS, "run {run} asks a proof of work of {bits} bits, more than {MAX_POW_BITS}");
    let from = match cached(data_dir, run, &key) {
        Some((nonce, have)) if have >= u32::from(bits) => return Ok(nonce),
        Some((nonce, _)) => nonce.wrapping_add(1),
        None => 0,
    };
    let seconds = 2f64.powi(i32::from(bits)) / HASHES_PER_SECOND;
    tracing::info!(
        "run {run} asks a proof of work of {bits} bits of this identity: solving it (about {seconds:.0} s of one core)"
    );
    let started = std::time::Instant::now();
    let nonce = tokio::task::spawn_blocking(move || solve_pow(&run, &key, bits, from))
        .await
        .context("the proof-of-work thread")?;
    tracing::info!("proof of work of {bits} bits solved in {:.1} s", started.elapsed().as_secs_f64());
    if let Err(e) = keep(data_dir, run, &key, nonce) {
        tracing::warn!("{e:#}");
    }
    Ok(nonce)
}

fn keep(data_dir: &Path, run: RunId, key: &PublicKey, nonce: u64) -> anyhow::Result<()> {
    let file = path(data_dir, run);
    let dir = file.parent().context("proof-of-work path has no parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = file.with_extension("tmp");
    let text = serde_json::json!({ "key": hex::encode(key.0), "nonce": nonce }).to_string();
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &file).with_context(|| format!("renaming {}", tmp.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn solved_once_then_kept() {
        let dir = tempfile::tempdir().unwrap();
        let (run, key, other) = (RunId([7; 32]), PublicKey([1; 32]), PublicKey([2; 32]));
        assert_eq!(cached(dir.path(), run, &key), None);
        let nonce = solve(dir.path(), run, key, 10).await.unwrap();
        assert!(pow_bits(&run, &key, nonce) >= 10);
        assert_eq!(cached(dir.path(), run, &key).map(|c| c.0), Some(nonce));
        // kept: asked again (or for fewer bits), the same nonce without a search
        assert_eq!(solve(dir.path(), run, key, 8).await.unwrap(), nonce);
        // another key's file, or another run's, is not this one's
        assert_eq!(cached(dir.path(), run, &other), None);
        assert_eq!(cached(dir.path(), RunId([8; 32]), &key), None);
        // more bits: the search goes on past the kept nonce
        let more = solve(dir.path(), run, key, 14).await.unwrap();
        assert!(more >= nonce && pow_bits(&run, &key, more) >= 14);
        // a damaged file reads as none
        std::fs::write(path(dir.path(), run), b"{not json").unwrap();
        assert_eq!(cached(dir.path(), run, &key), None);
        assert!(solve(dir.path(), run, key, 40).await.is_err());
    }
}
