//! A round's participants past the shepherd's inline threshold
//! (`--participants-inline`): a content-addressed blob of their sorted 32-byte
//! keys, named by the announcement, so that a round of any size keeps its
//! announcement within the control cap. Workers fetch it from the leader and
//! look themselves up.

use std::sync::Arc;

use pcp_bootstrap::{BlobStore, Node, PeerId};
use pcp_protocol::{BlobHash, PublicKey};
use pcp_schema::{ParameterRef, RoundAnnouncement};

/// Participants a round lists inline by default: past this, a blob (about 140 KiB
/// of keys, well within the 256 KiB control cap).
pub(crate) const DEFAULT_INLINE: usize = 4096;

/// The most participants a blob may hold (32 MiB of keys).
const MAX_KEYS: usize = 1 << 20;

/// How long a worker waits for the blob.
const FETCH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The blob of `keys`: sorted, 32 bytes each.
pub(crate) fn encode(keys: &[PublicKey]) -> Vec<u8> {
    let mut sorted: Vec<[u8; 32]> = keys.iter().map(|k| k.0).collect();
    sorted.sort_unstable();
    sorted.dedup();
    sorted.concat()
}

/// The keys of a participants blob: whole, sorted, unique keys, at most [`MAX_KEYS`].
pub(crate) fn decode(bytes: &[u8]) -> Result<Vec<[u8; 32]>, String> {
    if !bytes.len().is_multiple_of(32) || bytes.len() / 32 > MAX_KEYS {
        return Err(format!("a participants blob of {} bytes is not at most {MAX_KEYS} 32-byte keys", bytes.len()));
    }
    let keys: Vec<[u8; 32]> = bytes.chunks_exact(32).map(|c| <[u8; 32]>::try_from(c).unwrap_or([0; 32])).collect();
    if keys.windows(2).any(|w| w[0] >= w[1]) {
        return Err("a participants blob's keys are not sorted and unique".into());
    }
    Ok(keys)
}

/// The participants of a round with `participants` as the announcement lists them:
/// inline up to `inline`, else put in `store` as a blob (its ref returned, and the
/// inline list empty).
pub(crate) fn publish(
    store: &BlobStore,
    participants: &[PublicKey],
    inline: usize,
) -> anyhow::Result<(Vec<[u8; 32]>, Option<ParameterRef>)> {
    if participants.len() <= inline {
        return Ok((participants.iter().map(|p| p.0).collect(), None));
    }
    let bytes = encode(participants);
    let hash = store.put_bytes(&bytes)?;
    let blob = ParameterRef { name: "participants".into(), shard: 0, blob: hash.0, size: bytes.len() as u64 };
    Ok((Vec::new(), Some(blob)))
}

/// The last participants blob a worker fetched: its hash and keys.
pub(crate) type Cached = Option<([u8; 32], Arc<Vec<[u8; 32]>>)>;

/// Fills in `a`'s participants from its blob (fetched from `from`, or the one
/// `cache` holds). An announcement without a blob is left as it is.
pub(crate) async fn resolve(
    node: &Node,
    a: &mut RoundAnnouncement,
    from: PeerId,
    cache: &mut Cached,
) -> anyhow::Result<()> {
    let Some(blob) = a.participants_blob.as_ref() else { return Ok(()) };
    if let Some((_, keys)) = cache.as_ref().filter(|(h, _)| *h == blob.blob) {
        a.participants = keys.as_ref().clone();
        return Ok(());
    }
    if blob.size > (MAX_KEYS * 32) as u64 {
        anyhow::bail!("round {}: a participants blob of {} bytes is too large", a.round, blob.size);
    }
    let path = node
        .fetch_from(BlobHash(blob.blob), vec![from], FETCH_TIMEOUT)
        .await
        .map_err(|e| anyhow::anyhow!("round {}: fetching the participants: {e}", a.round))?
        .path;
    let bytes = std::fs::read(&path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    let keys = Arc::new(decode(&bytes).map_err(|e| anyhow::anyhow!("round {}: {e}", a.round))?);
    a.participants = keys.as_ref().clone();
    *cache = Some((blob.blob, keys));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcp_protocol::Identity;
    use pcp_schema::{MAX_CONTROL_MESSAGE, Message as _};

    fn keys(n: u64) -> Vec<PublicKey> {
        (0..n)
            .map(|i| {
                let mut secret = [0u8; 32];
                secret[..8].copy_from_slice(&i.to_le_bytes());
                Identity::from_secret(secret).public()
            })
            .collect()
    }

    fn announcement(participants: Vec<[u8; 32]>, participants_blob: Option<ParameterRef>) -> RoundAnnouncement {
        RoundAnnouncement {
            run: [1; 32],
            round: 7,
            parameters: Vec::new(),
            deadline_unix_ms: 0,
            participants,
            participants_blob,
            finished: false,
            term: 1,
            state: None,
            update: None,
            budget_ms: 0,
            steps_end_unix_ms: 0,
            screen_commit: [0; 32],
            screen_reveal: [0; 32],
            aggregators: Vec::new(),
        }
    }

    #[test]
    fn a_round_of_twenty_thousand_stays_under_the_control_cap_as_a_blob() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let store = BlobStore::open(dir.path())?;
        let all = keys(20_000);
        // inline, its announcement is past the cap and no worker could read it
        let inline = announcement(all.iter().map(|k| k.0).collect(), None).encode();
        assert!(inline.len() > MAX_CONTROL_MESSAGE, "{} bytes", inline.len());
        let (listed, blob) = publish(&store, &all, DEFAULT_INLINE)?;
        assert!(listed.is_empty());
        let blob = blob.expect("a blob past the threshold");
        let encoded = announcement(listed, Some(blob.clone())).encode();
        assert!(encoded.len() < 1024, "{} bytes", encoded.len());
        let bytes = std::fs::read(store.path(&BlobHash(blob.blob)))?;
        let decoded = decode(&bytes).map_err(anyhow::Error::msg)?;
        assert_eq!(decoded.len(), 20_000);
        assert!(all.iter().all(|k| decoded.binary_search(&k.0).is_ok()));
        // up to the threshold, inline as before
        let (listed, blob) = publish(&store, &all[..10], DEFAULT_INLINE)?;
        assert_eq!((listed.len(), blob), (10, None));
        Ok(())
    }

    #[test]
    fn a_malformed_participants_blob_is_refused_with_a_reason() {
        assert!(decode(&[0; 33]).is_err());
        let mut unsorted = [[2u8; 32], [1u8; 32]].concat();
        assert!(decode(&unsorted).expect_err("unsorted").contains("sorted"));
        unsorted.truncate(32);
        assert_eq!(decode(&unsorted).map(|k| k.len()), Ok(1));
    }
}
