//! Names shared by every layer: the id of an inbound DiLoCo request, and the mapping
//! between a PeerId and the ed25519 key it embeds. Imports nothing of the crate.

use libp2p::PeerId;
use pcp_protocol::PublicKey;

/// An inbound request waiting for its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InboundId(pub(crate) u64);

impl InboundId {
    /// An id that names no request of any node: for tests of code that routes
    /// requests without a swarm.
    #[doc(hidden)]
    pub fn unanswerable(n: u64) -> Self {
        Self(u64::MAX - n)
    }
}

impl std::fmt::Display for InboundId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// The PeerId of an ed25519 key, or `None` when the bytes are not a valid key.
pub fn peer_of(key: &PublicKey) -> Option<PeerId> {
    let key = libp2p::identity::ed25519::PublicKey::try_from_bytes(&key.0).ok()?;
    Some(libp2p::identity::PublicKey::from(key).to_peer_id())
}

/// The ed25519 key a peer id embeds (every pcp peer id does), or `None`.
pub fn key_of(peer: &PeerId) -> Option<PublicKey> {
    let multihash = peer.as_ref();
    if multihash.code() != 0 {
        return None; // not an identity multihash: the key is not inside
    }
    let key = libp2p::identity::PublicKey::try_decode_protobuf(multihash.digest()).ok()?;
    Some(PublicKey(key.try_into_ed25519().ok()?.to_bytes()))
}
