//! Signed request-response: the DiLoCo control protocol (join, heartbeat, contribution).
//!
//! Requests and responses are [`SignedEnvelope`]s, framed as a 4-byte big-endian
//! length, a [`FrameHead`] (the envelope without its payload, at most
//! [`MAX_FRAME_HEAD`] bytes) and then the payload's bytes. The head carries the
//! envelope's signature, which covers the payload's blake3 hash.
//!
//! The codec does all the checking, on the connection's task, never on the swarm's
//! event loop: it verifies the head's signature, requires its signer to be the peer on
//! the other end of the connection (so that a message cannot be relayed or replayed in
//! someone else's name), asks [`Admission`] whether it may read the announced payload
//! before it reads any (see [`crate::admission`]), and once the payload is read, hashes
//! it (once; on a blocking thread when it is large) and checks the signature over it.
//! What it hands on is a [`Verified`] envelope. The event loop only refuses replays of
//! requests. Inbound requests wait for [`crate::Node::respond`] in a bounded table;
//! requests beyond it are dropped.
//!
//! The codec learns its connection's peer from [`RpcBehaviour`]: libp2p's
//! request-response behaviour builds each connection's handler with a clone of its codec
//! and does not tell the codec the peer, so `RpcBehaviour` wraps it and, on each
//! established connection, leaves the peer and its address where that one clone picks
//! them up (see [`RpcCodec`]'s `Clone`). A codec that has none refuses every frame.
//! `RpcBehaviour` also tells [`Admission`] of every connection established and closed,
//! so that it knows the address each worker is connected from.

use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use futures::prelude::*;
use libp2p::core::transport::PortUse;
use libp2p::core::{Endpoint, Multiaddr};
use libp2p::request_response::{self, OutboundRequestId, ResponseChannel};
use libp2p::swarm::{
    ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent, THandlerOutEvent, ToSwarm,
};
use libp2p::{PeerId, StreamProtocol};
use pcp_protocol::{PublicKey, Verified};
use pcp_schema::{FrameHead, MAX_CONTROL_MESSAGE, MAX_FRAME_HEAD, Message, MessageKind, SignedEnvelope};

use crate::admission::{Admission, Hold, Permit, Remote};
use crate::codec::read_growing;

/// The DiLoCo request-response protocol (2.0.0: the signed head before the payload).
pub const RPC_PROTOCOL: StreamProtocol = StreamProtocol::new("/pcp/diloco/2.0.0");

/// Payloads at least this large are hashed on a blocking thread, not the connection's task.
const BLOCKING_VERIFY: usize = 1 << 20;
/// How long a participant's contribution waits for room in the run's budget of
/// contributions in flight before it is refused: well within the request's timeout
/// ([`RPC_TIMEOUT`]), long enough for a burst of a thousand to be read in turn by a
/// shepherd on two cores (it reads, checks and adds about 15 a second there while it
/// answers two thousand heartbeats a second).
const CONTRIBUTION_WAIT: std::time::Duration = std::time::Duration::from_secs(240);
/// A DiLoCo request's timeout, each way: a contribution's includes its wait for room.
/// Heartbeats and hellos carry shorter timeouts of their own.
pub(crate) const RPC_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// A signed envelope as the DiLoCo codec carries it.
#[derive(Debug)]
pub(crate) enum Frame {
    /// One this node sends.
    Out(SignedEnvelope),
    /// An answer received and verified by the codec: its signature over its payload,
    /// and that its signer is the peer on the other end of the connection.
    In(Verified),
    /// A request received and verified so; a contribution with its [`Hold`] on the
    /// run's budget.
    Request(Verified, Option<Hold>),
    /// An answer that did not verify, and why (a request that does not fails in the codec).
    Refused(String),
}

/// Its codec: a signed envelope each way, head first.
#[derive(Debug)]
pub(crate) struct RpcCodec {
    admission: Arc<Admission>,
    /// The other end of this codec's connection; `None` in the behaviour's own codec.
    remote: Option<Remote>,
    /// Where [`RpcBehaviour`] leaves a new connection's remote for the clone that goes
    /// to its handler.
    next: Arc<Mutex<Option<Remote>>>,
}

impl RpcCodec {
    fn new(admission: Arc<Admission>) -> Self {
        Self { admission, remote: None, next: Arc::default() }
    }

    /// The codec of a connection from `remote`.
    #[cfg(test)]
    pub(crate) fn on_connection(admission: Arc<Admission>, remote: Remote) -> Self {
        Self { admission, remote: Some(remote), next: Arc::default() }
    }
}

impl Clone for RpcCodec {
    /// A connection's codec (cloned per stream) keeps its remote. The behaviour's own
    /// codec is cloned once per connection, inside the call to which [`RpcBehaviour`]
    /// passes the connection's remote: that clone takes it.
    fn clone(&self) -> Self {
        let remote = self.remote.or_else(|| self.next.lock().unwrap_or_else(PoisonError::into_inner).take());
        Self { admission: self.admission.clone(), remote, next: self.next.clone() }
    }
}

fn invalid(reason: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, reason.to_string())
}

/// A frame's head, decoded, not yet verified.
async fn read_head<T: AsyncRead + Unpin + Send>(io: &mut T) -> io::Result<FrameHead> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME_HEAD {
        return Err(invalid(format!("FrameHead of {len} bytes exceeds {MAX_FRAME_HEAD} bytes")));
    }
    let mut bytes = vec![0u8; len];
    io.read_exact(&mut bytes).await?;
    FrameHead::decode(&bytes).map_err(invalid)
}

/// The signer of `head`, once its signature verifies and it is `remote`'s own key.
fn signed_by(head: &FrameHead, remote: &Remote) -> Result<PublicKey, String> {
    let signer = PublicKey(head.header.signer);
    if remote.key != Some(signer) {
        return Err(format!("{} signed by {signer}, not by the sending peer {}", head.header.kind.tag(), remote.peer));
    }
    pcp_protocol::verify_head(head).map_err(|e| e.to_string())
}

/// The payload `head` (whose signature verified) announces, hashed once and checked
/// against the signature.
async fn read_verified<T: AsyncRead + Unpin + Send>(io: &mut T, head: FrameHead) -> io::Result<Verified> {
    let len = usize::try_from(head.payload_len).map_err(invalid)?;
    let kind = head.header.kind.tag();
    let payload = read_growing(io, len, kind).await?;
    let envelope = head.with_payload(payload);
    let verify = move || {
        pcp_protocol::verify(envelope).map_err(|_| invalid(format!("{kind} payload does not match its signed hash")))
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) if len >= BLOCKING_VERIFY => {
            runtime.spawn_blocking(verify).await.map_err(|e| io::Error::other(format!("verifying a {kind}: {e}")))?
        }
        _ => verify(),
    }
}

async fn write_envelope<T: AsyncWrite + Unpin + Send>(io: &mut T, frame: Frame) -> io::Result<()> {
    let Frame::Out(envelope) = frame else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "only an outgoing envelope is written"));
    };
    let head = pcp_protocol::head_of(&envelope).encode();
    let len = u32::try_from(head.len()).map_err(invalid)?;
    io.write_all(&len.to_be_bytes()).await?;
    io.write_all(&head).await?;
    io.write_all(&envelope.payload).await?;
    io.close().await
}

impl RpcCodec {
    /// A request from `remote`, or why it was refused.
    async fn request<T: AsyncRead + Unpin + Send>(
        &self,
        io: &mut T,
        remote: &Remote,
    ) -> Result<(Verified, Option<Hold>), String> {
        let head = read_head(io).await.map_err(|e| e.to_string())?;
        let signer = signed_by(&head, remote)?;
        // a contribution (or an aggregator's slice) that finds its budget full waits for room
        // (within a runtime)
        let permit: Permit = match tokio::runtime::Handle::try_current() {
            Ok(_) if matches!(head.header.kind, MessageKind::Contribution | MessageKind::Slice) => {
                self.admission.wait_for_room(&head, signer, remote, CONTRIBUTION_WAIT).await
            }
            _ => self.admission.permit(&head, signer, remote),
        }
        .map_err(|r| r.to_string())?;
        let verified = read_verified(io, head).await.map_err(|e| e.to_string())?;
        Ok((verified, permit.hold()))
    }
}

impl request_response::Codec for RpcCodec {
    type Protocol = StreamProtocol;
    type Request = Frame;
    type Response = Frame;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Frame>
    where
        T: AsyncRead + Unpin + Send,
    {
        // request-response drops a request that fails here without telling the event
        // loop: the refusal is noted for it to report
        let refused = |peer, reason: String| {
            self.admission.refused(peer, reason.clone());
            invalid(reason)
        };
        let Some(remote) = self.remote else {
            return Err(refused(None, "a request on a connection whose peer is unknown".into()));
        };
        match self.request(io, &remote).await {
            Ok((verified, hold)) => Ok(Frame::Request(verified, hold)),
            Err(reason) => Err(refused(Some(remote.peer), reason)),
        }
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Frame>
    where
        T: AsyncRead + Unpin + Send,
    {
        // an answer comes from a peer this node asked, and is never a contribution
        let head = read_head(io).await?;
        if head.header.kind == MessageKind::Contribution || head.payload_len > MAX_CONTROL_MESSAGE as u64 {
            return Err(invalid(format!("an answer of {} bytes of {}", head.payload_len, head.header.kind.tag())));
        }
        let checked = match &self.remote {
            Some(remote) => signed_by(&head, remote),
            None => Err("an answer on a connection whose peer is unknown".into()),
        };
        match checked {
            // refused unread: the request gets this answer's reason, not a broken stream
            Ok(_) => read_verified(io, head).await.map(Frame::In),
            Err(reason) => Ok(Frame::Refused(reason)),
        }
    }

    async fn write_request<T>(&mut self, _: &StreamProtocol, io: &mut T, req: Frame) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_envelope(io, req).await
    }

    async fn write_response<T>(&mut self, _: &StreamProtocol, io: &mut T, res: Frame) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_envelope(io, res).await
    }
}

/// The DiLoCo request-response behaviour, which tells each connection's codec who is on
/// the other end (see the module docs).
pub(crate) struct RpcBehaviour {
    inner: request_response::Behaviour<RpcCodec>,
    next: Arc<Mutex<Option<Remote>>>,
    /// Told of every connection established and closed (see [`Admission::admit_worker`]).
    admission: Arc<Admission>,
}

impl std::fmt::Debug for RpcBehaviour {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RpcBehaviour")
    }
}

impl RpcBehaviour {
    /// The protocol over [`RPC_PROTOCOL`], admitting requests through `admission`.
    pub(crate) fn new(admission: Arc<Admission>, config: request_response::Config) -> Self {
        let codec = RpcCodec::new(admission.clone());
        let next = codec.next.clone();
        let protocols = [(RPC_PROTOCOL, request_response::ProtocolSupport::Full)];
        Self { inner: request_response::Behaviour::with_codec(codec, protocols, config), next, admission }
    }

    /// Sends `envelope` to `peer`.
    pub(crate) fn send_request(&mut self, peer: &PeerId, envelope: SignedEnvelope) -> OutboundRequestId {
        self.inner.send_request(peer, Frame::Out(envelope))
    }

    /// Answers a request; `Err` when its requester is gone.
    pub(crate) fn send_response(
        &mut self,
        channel: ResponseChannel<Frame>,
        envelope: SignedEnvelope,
    ) -> Result<(), ()> {
        self.inner.send_response(channel, Frame::Out(envelope)).map_err(|_| ())
    }

    /// Runs `f`, which builds a connection's handler (and clones the codec for it once),
    /// with `remote` left for that clone.
    fn for_connection<R>(
        &mut self,
        remote: Remote,
        f: impl FnOnce(&mut request_response::Behaviour<RpcCodec>) -> R,
    ) -> R {
        *self.next.lock().unwrap_or_else(PoisonError::into_inner) = Some(remote);
        let handler = f(&mut self.inner);
        // not taken (the connection was denied): no other connection's codec gets it
        self.next.lock().unwrap_or_else(PoisonError::into_inner).take();
        handler
    }
}

impl NetworkBehaviour for RpcBehaviour {
    type ConnectionHandler = THandler<request_response::Behaviour<RpcCodec>>;
    type ToSwarm = request_response::Event<Frame, Frame>;

    fn handle_pending_inbound_connection(
        &mut self,
        id: ConnectionId,
        local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        self.inner.handle_pending_inbound_connection(id, local, remote)
    }

    fn handle_established_inbound_connection(
        &mut self,
        id: ConnectionId,
        peer: PeerId,
        local: &Multiaddr,
        remote: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.for_connection(Remote::new(peer, remote), |inner| {
            inner.handle_established_inbound_connection(id, peer, local, remote)
        })
    }

    fn handle_pending_outbound_connection(
        &mut self,
        id: ConnectionId,
        peer: Option<PeerId>,
        addresses: &[Multiaddr],
        role: Endpoint,
    ) -> Result<Vec<Multiaddr>, ConnectionDenied> {
        self.inner.handle_pending_outbound_connection(id, peer, addresses, role)
    }

    fn handle_established_outbound_connection(
        &mut self,
        id: ConnectionId,
        peer: PeerId,
        addr: &Multiaddr,
        role: Endpoint,
        port_use: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.for_connection(Remote::new(peer, addr), |inner| {
            inner.handle_established_outbound_connection(id, peer, addr, role, port_use)
        })
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionEstablished(e) => {
                self.admission.connected(e.connection_id, e.peer_id, e.endpoint.get_remote_address());
            }
            FromSwarm::ConnectionClosed(e) => self.admission.disconnected(e.connection_id),
            _ => {}
        }
        self.inner.on_swarm_event(event);
    }

    fn on_connection_handler_event(&mut self, peer: PeerId, id: ConnectionId, event: THandlerOutEvent<Self>) {
        self.inner.on_connection_handler_event(peer, id, event);
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        self.inner.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use libp2p::request_response::Codec as _;
    use pcp_protocol::{Binding, Identity, RunId, seal};
    use pcp_schema::Heartbeat;

    use super::*;
    use crate::ids::{key_of, peer_of};

    fn heartbeat(identity: &Identity) -> SignedEnvelope {
        let binding = Binding { run: RunId([1; 32]), round: 2, nonce: 3, unix_ms: 4 };
        seal(identity, binding, &Heartbeat::new([1; 32], 2, 4))
    }

    fn wire(envelope: SignedEnvelope) -> Vec<u8> {
        let mut bytes = Vec::new();
        futures::executor::block_on(write_envelope(&mut futures::io::Cursor::new(&mut bytes), Frame::Out(envelope)))
            .expect("write to memory");
        bytes
    }

    /// What a codec on a connection from `remote` makes of `bytes` as a request.
    fn read(codec: &RpcCodec, bytes: &[u8]) -> Result<Verified, String> {
        let mut codec = codec.clone();
        match futures::executor::block_on(codec.read_request(&RPC_PROTOCOL, &mut &bytes[..])) {
            Ok(Frame::Request(verified, _)) => Ok(verified),
            Ok(other) => Err(format!("not a received frame: {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn the_signer_must_be_the_sending_peer() {
        let alice = Identity::from_secret([7; 32]);
        let bob = Identity::from_secret([8; 32]);
        let alice_peer = peer_of(&alice.public()).expect("valid key");
        assert_eq!(alice_peer, crate::keypair(&alice).public().to_peer_id());
        assert_eq!(key_of(&alice_peer), Some(alice.public()), "the key a peer id embeds");

        let admission = Arc::new(Admission::default());
        let behaviour = RpcCodec::new(admission.clone());
        // the behaviour's own codec was given no connection: it refuses
        assert!(read(&behaviour, &wire(heartbeat(&alice))).is_err_and(|e| e.contains("peer is unknown")));
        // the clone made for alice's connection takes her remote, and its clones keep it
        let addr: Multiaddr = "/ip4/192.0.2.7/udp/1/quic-v1".parse().expect("multiaddr");
        *behaviour.next.lock().expect("not poisoned") = Some(Remote::new(alice_peer, &addr));
        let connection = behaviour.clone();
        assert!(behaviour.next.lock().expect("not poisoned").is_none(), "taken by one clone only");
        assert!(read(&connection, &wire(heartbeat(&alice))).is_ok_and(|v| v.signer() == alice.public()));
        let err = read(&connection, &wire(heartbeat(&bob))).err().unwrap_or_default();
        assert!(err.contains("not by the sending peer"), "{err}");
        let mut forged = wire(heartbeat(&alice));
        *forged.last_mut().expect("a payload") ^= 1;
        let err = read(&connection, &forged).err().unwrap_or_default();
        assert!(err.contains("does not match its signed hash"), "{err}");
        let noted: u64 = admission.take_refusals().iter().map(|(_, n, _)| n).sum();
        assert_eq!(noted, 3, "each refusal is noted for the event loop to report");
    }
}
