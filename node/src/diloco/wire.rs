//! What shepherds and workers share: DHT keys, signing with fresh nonces, and the
//! parameter blob format.

use std::time::{SystemTime, UNIX_EPOCH};

use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_protocol::{Binding, BlobHash, Identity, RunId, Signable};
use pcp_schema::{RunManifest, SignedEnvelope};

/// The wire protocol version in `NodeHello`.
pub(crate) const PROTOCOL_VERSION: u32 = 1;

/// Every shepherd provides this DHT key, so that workers without `--run` find runs.
pub(crate) fn runs_key() -> BlobHash {
    BlobHash(*blake3::hash(b"pcp/runs/v1").as_bytes())
}

/// The DHT key a shepherd provides for its run.
pub(crate) fn run_key(run: RunId) -> BlobHash {
    BlobHash(*blake3::keyed_hash(blake3::hash(b"pcp/run-key/v1").as_bytes(), &run.0).as_bytes())
}

/// Wall-clock milliseconds since the Unix epoch.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Signs messages with a nonce that never repeats for this key: a random start,
/// then a counter.
#[derive(Debug)]
pub(crate) struct Signer {
    identity: Identity,
    nonce: u64,
}

impl Signer {
    pub(crate) fn new(identity: Identity) -> Self {
        Self { identity, nonce: rand::random::<u64>() >> 1 }
    }

    pub(crate) fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Seals `message` bound to `run` and `round`.
    pub(crate) fn seal<M: Signable>(&mut self, run: RunId, round: u64, message: &M) -> SignedEnvelope {
        self.nonce = self.nonce.wrapping_add(1);
        pcp_protocol::seal(&self.identity, Binding { run, round, nonce: self.nonce, unix_ms: unix_ms() }, message)
    }
}

/// Element counts of the manifest's tensors, in argument order.
pub(crate) fn sizes(manifest: &RunManifest) -> Vec<usize> {
    manifest.tensors.iter().map(|t| t.shape.iter().product::<u64>() as usize).collect()
}

/// Shapes of the manifest's tensors.
pub(crate) fn shapes(manifest: &RunManifest) -> Vec<Vec<usize>> {
    manifest.tensors.iter().map(|t| t.shape.iter().map(|d| *d as usize).collect()).collect()
}

/// Parameters as a blob: the exact fp32 pseudo-gradient format.
pub(crate) fn params_blob(params: &Tensors) -> Vec<u8> {
    compress::encode(params, Encoding::F32)
}

/// Reads a parameters blob, checking every tensor's size.
pub(crate) fn read_params(bytes: &[u8], sizes: &[usize]) -> anyhow::Result<Tensors> {
    let (params, encoding) = compress::decode(bytes, sizes).map_err(|e| anyhow::anyhow!("parameters blob: {e}"))?;
    anyhow::ensure!(encoding == Encoding::F32, "parameters blob is {}, expected fp32", encoding.name());
    Ok(params)
}

/// The blake3 of a parameters blob: the `params_hash` in events.
pub(crate) fn params_hash(params: &Tensors) -> BlobHash {
    BlobHash(*blake3::hash(&params_blob(params)).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_blob_round_trips_and_checks_sizes() {
        let params = vec![vec![1.0, -2.5], vec![3.0]];
        let blob = params_blob(&params);
        assert_eq!(read_params(&blob, &[2, 1]).ok(), Some(params.clone()));
        assert!(read_params(&blob, &[2, 2]).is_err());
        assert!(read_params(&blob[..blob.len() - 1], &[2, 1]).is_err());
        assert_eq!(params_hash(&params), BlobHash(*blake3::hash(&blob).as_bytes()));
    }

    #[test]
    fn nonces_never_repeat() {
        let mut signer = Signer::new(Identity::from_secret([3; 32]));
        let run = RunId([1; 32]);
        let hb = pcp_schema::Heartbeat { run: run.0, round: 0, unix_ms: 0, free_memory_bytes: 0 };
        let a = signer.seal(run, 0, &hb);
        let b = signer.seal(run, 0, &hb);
        assert_ne!(a.nonce, b.nonce);
        assert_ne!(run_key(run), runs_key());
    }
}
