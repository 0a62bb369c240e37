//! Signed request-response: the DiLoCo control protocol (join, heartbeat, contribution).
//!
//! Requests and responses are [`SignedEnvelope`]s, framed as a 4-byte big-endian
//! length, a [`FrameHead`] (the envelope without its payload, at most
//! [`MAX_FRAME_HEAD`] bytes) and then the payload's bytes. The head carries the
//! envelope's signature, which covers the payload's blake3 hash, so the codec verifies
//! it and asks [`Admission`] whether it may read the announced payload before it reads
//! any (see [`crate::admission`]). The event loop verifies each
//! signature before anything decodes the payload, requires the signer to be the peer on
//! the other end of the stream (so a message cannot be relayed in someone else's name),
//! and refuses replays of requests. Inbound requests wait for [`crate::Node::respond`]
//! in a bounded table; requests beyond it are dropped.

use std::io;
use std::sync::Arc;

use futures::prelude::*;
use libp2p::{PeerId, StreamProtocol};
use pcp_protocol::PublicKey;
use pcp_schema::{FrameHead, MAX_CONTROL_MESSAGE, MAX_FRAME_HEAD, Message, MessageKind, SignedEnvelope};

use crate::admission::{Admission, Permit};
use crate::codec::read_growing;
use crate::node::Stopped;

/// The DiLoCo request-response protocol (2.0.0: the signed head before the payload).
pub const RPC_PROTOCOL: StreamProtocol = StreamProtocol::new("/pcp/diloco/2.0.0");

/// Its codec: a signed envelope each way, head first.
#[derive(Debug, Clone)]
pub(crate) struct RpcCodec {
    admission: Arc<Admission>,
}

impl RpcCodec {
    pub(crate) fn new(admission: Arc<Admission>) -> Self {
        Self { admission }
    }
}

fn invalid(reason: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, reason.to_string())
}

/// A frame's head, its signature verified.
async fn read_head<T: AsyncRead + Unpin + Send>(io: &mut T) -> io::Result<(FrameHead, PublicKey)> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME_HEAD {
        return Err(invalid(format!("FrameHead of {len} bytes exceeds {MAX_FRAME_HEAD} bytes")));
    }
    let mut bytes = vec![0u8; len];
    io.read_exact(&mut bytes).await?;
    let head = FrameHead::decode(&bytes).map_err(invalid)?;
    let signer = pcp_protocol::verify_head(&head).map_err(invalid)?;
    Ok((head, signer))
}

/// The payload `head` announces, checked against its hash; `_permit` holds its share
/// of the node's budgets while it is read.
async fn read_payload<T: AsyncRead + Unpin + Send>(
    io: &mut T,
    head: FrameHead,
    _permit: Option<Permit>,
) -> io::Result<SignedEnvelope> {
    let len = usize::try_from(head.payload_len).map_err(invalid)?;
    let payload = read_growing(io, len, head.kind.tag()).await?;
    if *blake3::hash(&payload).as_bytes() != head.payload_hash {
        return Err(invalid(format!("{} payload does not match its signed hash", head.kind.tag())));
    }
    Ok(head.with_payload(payload))
}

async fn write_envelope<T: AsyncWrite + Unpin + Send>(io: &mut T, envelope: &SignedEnvelope) -> io::Result<()> {
    let head = pcp_protocol::head_of(envelope).encode();
    let len = u32::try_from(head.len()).map_err(invalid)?;
    io.write_all(&len.to_be_bytes()).await?;
    io.write_all(&head).await?;
    io.write_all(&envelope.payload).await?;
    io.close().await
}

impl libp2p::request_response::Codec for RpcCodec {
    type Protocol = StreamProtocol;
    type Request = SignedEnvelope;
    type Response = SignedEnvelope;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<SignedEnvelope>
    where
        T: AsyncRead + Unpin + Send,
    {
        // request-response drops a request that fails here without telling the event
        // loop: the refusal is noted for it to report
        let (head, signer) = read_head(io).await.inspect_err(|e| self.admission.refused(None, e.to_string()))?;
        let permit = self.admission.permit(&head, signer).map_err(|refusal| {
            self.admission.refused(Some(signer), refusal.to_string());
            invalid(refusal)
        })?;
        read_payload(io, head, Some(permit)).await.inspect_err(|e| self.admission.refused(Some(signer), e.to_string()))
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<SignedEnvelope>
    where
        T: AsyncRead + Unpin + Send,
    {
        // an answer comes from a peer this node asked, and is never a contribution
        let (head, _) = read_head(io).await?;
        if head.kind == MessageKind::Contribution || head.payload_len > MAX_CONTROL_MESSAGE as u64 {
            return Err(invalid(format!("an answer of {} bytes of {}", head.payload_len, head.kind.tag())));
        }
        read_payload(io, head, None).await
    }

    async fn write_request<T>(&mut self, _: &StreamProtocol, io: &mut T, req: SignedEnvelope) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_envelope(io, &req).await
    }

    async fn write_response<T>(&mut self, _: &StreamProtocol, io: &mut T, res: SignedEnvelope) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_envelope(io, &res).await
    }
}

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

/// The ed25519 key a peer id embeds (every pcp peer id does), or `None`.
pub fn key_of(peer: &PeerId) -> Option<PublicKey> {
    let multihash = peer.as_ref();
    if multihash.code() != 0 {
        return None; // not an identity multihash: the key is not inside
    }
    let key = libp2p::identity::PublicKey::try_decode_protobuf(multihash.digest()).ok()?;
    Some(PublicKey(key.try_into_ed25519().ok()?.to_bytes()))
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
        seal(identity, binding, &Heartbeat { run: [1; 32], round: 2, unix_ms: 4, free_memory_bytes: 0, term: 0 })
    }

    #[test]
    fn the_signer_must_be_the_sending_peer() {
        let alice = Identity::from_secret([7; 32]);
        let bob = Identity::from_secret([8; 32]);
        let alice_peer = peer_of(&alice.public()).expect("valid key");
        assert_eq!(alice_peer, crate::keypair(&alice).public().to_peer_id());
        assert_eq!(key_of(&alice_peer), Some(alice.public()), "the key a peer id embeds");
        assert!(verify_from(alice_peer, heartbeat(&alice)).is_ok());
        let err = verify_from(alice_peer, heartbeat(&bob)).err().unwrap_or_default();
        assert!(err.contains("not by the sending peer"), "{err}");
        let mut forged = heartbeat(&alice);
        forged.round = 9;
        assert!(verify_from(alice_peer, forged).is_err());
    }
}
