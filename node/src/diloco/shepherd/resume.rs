//! What a resumed shepherd starts from: its newest checkpoint, or the state blob it
//! wrote after a later round, whichever is newer.
//!
//! A shepherd writes a state blob after every round (its candidates fetch it, and a
//! round is released once a majority holds it) and names it in `<state dir>/state`.
//! The checkpoint (parameters, optimizer state and the run's metadata) is written
//! every `--checkpoint-rounds` rounds. `--resume` takes the checkpoint's metadata
//! and, when the state blob names a later round and is still in the blob store, that
//! round's parameters, optimizer state, durations, norms, ratings, workers and term:
//! the workers' chains admit the next round, and no round is lost.

use std::path::Path;

use anyhow::Context as _;
use pcp_protocol::BlobHash;

use crate::diloco::wire::{self, LeaderState};

/// The file in the state directory naming the newest state blob.
const POINTER: &str = "state";
/// The most bytes a pointer file may hold (it holds about 120).
const MAX_POINTER: u64 = 4096;

/// `<state dir>/state`: the newest state blob, the round it follows and its term.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Pointer {
    round: u64,
    blob: String,
    term: u64,
}

/// Names the state blob `blob` of `round` in `state_dir` (written whole, then moved
/// into place).
pub(super) fn record(state_dir: &Path, round: u64, blob: BlobHash, term: u64) -> anyhow::Result<()> {
    std::fs::create_dir_all(state_dir).with_context(|| format!("cannot create {}", state_dir.display()))?;
    let pointer = Pointer { round, blob: blob.to_hex(), term };
    let tmp = state_dir.join(format!(".{POINTER}.tmp{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec(&pointer)?).with_context(|| format!("cannot write {}", tmp.display()))?;
    let path = state_dir.join(POINTER);
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))
}

/// The state blob `state_dir` names, if it follows a round after `after` and the
/// store under `data_dir` still holds it; an error names a pointer or blob that is
/// there and damaged.
pub(super) fn newer(
    state_dir: &Path,
    data_dir: &Path,
    after: u64,
    sizes: &[usize],
) -> anyhow::Result<Option<LeaderState>> {
    let path = state_dir.join(POINTER);
    let Ok(meta) = std::fs::metadata(&path) else { return Ok(None) };
    anyhow::ensure!(
        meta.len() <= MAX_POINTER,
        "{}: {} bytes, more than a pointer's {MAX_POINTER}",
        path.display(),
        meta.len()
    );
    let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let pointer: Pointer = serde_json::from_slice(&bytes).with_context(|| format!("{}", path.display()))?;
    if pointer.round <= after {
        return Ok(None);
    }
    let hash: BlobHash = pointer.blob.parse().map_err(|e| anyhow::anyhow!("{}: blob {e}", path.display()))?;
    let store = pcp_bootstrap::BlobStore::open(data_dir)?;
    if !store.contains(&hash) {
        tracing::warn!(
            "the state blob of round {} is gone from the store; resuming from the checkpoint",
            pointer.round
        );
        return Ok(None);
    }
    let blob = store.path(&hash);
    let bytes = std::fs::read(&blob).with_context(|| format!("cannot read {}", blob.display()))?;
    let state = wire::read_state(&bytes, sizes).with_context(|| format!("the state blob {}", blob.display()))?;
    anyhow::ensure!(
        state.snapshot.completed == pointer.round,
        "the state blob {} holds round {}, not the round {} its pointer names",
        blob.display(),
        state.snapshot.completed,
        pointer.round
    );
    Ok(Some(state))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcp_protocol::PublicKey;
    use pcp_protocol::diloco::shepherd::{Learned, Snapshot};

    fn state(completed: u64) -> LeaderState {
        LeaderState {
            term: 3,
            snapshot: Snapshot {
                completed,
                params: vec![vec![1.0, 2.0], vec![3.0]],
                velocity: vec![vec![0.5, 0.25], vec![-1.0]],
                durations: vec![1000],
                norms: vec![0.5],
                learned: Learned {
                    ratings: Vec::new(),
                    earned: Vec::new(),
                    tensors: Vec::new(),
                    step_ms: None,
                    rated_norms: false,
                },
            },
            contributors: vec![PublicKey([1; 32])],
            excluded: Vec::new(),
        }
    }

    #[test]
    fn a_newer_state_in_the_store_is_taken_an_older_or_missing_one_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (data, states) = (dir.path(), dir.path().join("shepherd"));
        let store = pcp_bootstrap::BlobStore::open(data).expect("a store");
        let sizes = [2, 1];
        assert!(newer(&states, data, 0, &sizes).expect("no pointer").is_none(), "nothing recorded");
        let hash = store.put_bytes(&wire::state_blob(&state(5))).expect("stored");
        record(&states, 5, hash, 3).expect("recorded");
        let taken = newer(&states, data, 4, &sizes).expect("read").expect("round 5 is after 4");
        assert_eq!(taken, state(5));
        assert!(newer(&states, data, 5, &sizes).expect("read").is_none(), "not after the checkpoint's own round");
        // a pointer to a blob the store no longer holds: the checkpoint, with a warning
        record(&states, 6, BlobHash([9; 32]), 3).expect("recorded");
        assert!(newer(&states, data, 4, &sizes).expect("read").is_none());
        // a pointer naming another round than its blob holds, or damaged: an error naming it
        record(&states, 7, hash, 3).expect("recorded");
        let err = newer(&states, data, 4, &sizes).expect_err("round 7 is not the blob's");
        assert!(format!("{err:#}").contains("holds round 5"), "{err:#}");
        std::fs::write(states.join(POINTER), b"{").expect("written");
        let err = newer(&states, data, 4, &sizes).expect_err("damaged");
        assert!(format!("{err:#}").contains("shepherd/state"), "{err:#}");
        std::fs::write(states.join(POINTER), vec![b' '; 5000]).expect("written");
        let err = newer(&states, data, 4, &sizes).expect_err("too long");
        assert!(format!("{err:#}").contains("more than a pointer's"), "{err:#}");
    }
}
