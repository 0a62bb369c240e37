//! Signed request-response: the DiLoCo control protocol (join, heartbeat, contribution).
//!
//! Requests and responses are [`SignedEnvelope`]s. The event loop verifies each
//! signature before anything decodes the payload, requires the signer to be the peer on
//! the other end of the stream (so a message cannot be relayed in someone else's name),
//! and refuses replays of requests. Inbound requests wait for [`crate::Node::respond`]
//! in a bounded table; requests beyond it are dropped.

use libp2p::{PeerId, StreamProtocol};
use pcp_protocol::PublicKey;
use pcp_schema::SignedEnvelope;

use crate::codec::CapnpCodec;
use crate::node::Stopped;

/// The DiLoCo request-response protocol.
pub const RPC_PROTOCOL: StreamProtocol = StreamProtocol::new("/pcp/diloco/1.0.0");

/// Its codec: a signed envelope each way.
pub(crate) type RpcCodec = CapnpCodec<SignedEnvelope, SignedEnvelope>;

/// An inbound request waiting for its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InboundId(pub(crate) u64);

impl std::fmt::Display for InboundId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Why a request got no verified answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RequestError {
    /// The event loop has stopped.
    #[error(transparent)]
    Stopped(#[from] Stopped),
    /// Too many requests are in flight.
    #[error("request to {peer}: {max} requests already in flight")]
    Busy {
        /// The peer.
        peer: PeerId,
        /// The limit.
        max: usize,
    },
    /// The request did not get through (dial failure, timeout, stream reset, refusal).
    #[error("request to {peer}: {reason}")]
    Failed {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
    /// The answer did not verify, or was signed by someone other than the peer.
    #[error("answer from {peer} rejected: {reason}")]
    Rejected {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
}

/// The PeerId of an ed25519 key, or `None` when the bytes are not a valid key.
pub fn peer_of(key: &PublicKey) -> Option<PeerId> {
    let key = libp2p::identity::ed25519::PublicKey::try_from_bytes(&key.0).ok()?;
    Some(libp2p::identity::PublicKey::from(key).to_peer_id())
}

/// Verifies an envelope that arrived from `peer` and checks `peer` signed it.
pub(crate) fn verify_from(peer: PeerId, envelope: SignedEnvelope) -> Result<pcp_protocol::Verified, String> {
    let verified = pcp_protocol::verify(envelope).map_err(|e| e.to_string())?;
    if peer_of(&verified.signer()) != Some(peer) {
        return Err(format!("envelope signed by {}, not by the sending peer", verified.signer()));
    }
    Ok(verified)
}

#[cfg(test)]
mod tests {
    use pcp_protocol::{Binding, Identity, RunId, seal};
    use pcp_schema::Heartbeat;

    use super::*;

    fn heartbeat(identity: &Identity) -> SignedEnvelope {
        let binding = Binding { run: RunId([1; 32]), round: 2, nonce: 3, unix_ms: 4 };
        seal(identity, binding, &Heartbeat { run: [1; 32], round: 2, unix_ms: 4, free_memory_bytes: 0 })
    }

    #[test]
    fn the_signer_must_be_the_sending_peer() {
        let alice = Identity::from_secret([7; 32]);
        let bob = Identity::from_secret([8; 32]);
        let alice_peer = peer_of(&alice.public()).expect("valid key");
        assert_eq!(alice_peer, crate::keypair(&alice).public().to_peer_id());
        assert!(verify_from(alice_peer, heartbeat(&alice)).is_ok());
        let err = verify_from(alice_peer, heartbeat(&bob)).err().unwrap_or_default();
        assert!(err.contains("not by the sending peer"), "{err}");
        let mut forged = heartbeat(&alice);
        forged.round = 9;
        assert!(verify_from(alice_peer, forged).is_err());
    }
}
