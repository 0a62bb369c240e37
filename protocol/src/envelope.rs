//! Sealing messages into [`SignedEnvelope`]s and opening them.
//!
//! The signature covers a domain tag, the message kind, the signer, the run, round,
//! nonce and timestamp, and the blake3 hash of the payload. [`open`] verifies it before
//! anything reads the payload; [`Verified::decode`] then decodes the payload as the kind
//! the signer committed to.

use pcp_schema::{
    Ack, Contribution, DecodeError, EnvelopeHeader, FrameHead, Heartbeat, Message, MessageKind, NodeHello,
    RoundAnnouncement, RunManifest, SignedEnvelope,
};

use crate::identity::{Identity, PublicKey, VerifyFailure};
use crate::ids::RunId;

/// The domain tag that starts every signed envelope: a pcp envelope signature never
/// verifies as a signature of anything else.
const DOMAIN: &[u8] = b"pcp/signed-envelope/v1\0";

/// A message that travels in a signed envelope.
pub trait Signable: Message {
    /// The kind it is signed as.
    const KIND: MessageKind;
}

impl Signable for NodeHello {
    const KIND: MessageKind = MessageKind::NodeHello;
}
impl Signable for RunManifest {
    const KIND: MessageKind = MessageKind::RunManifest;
}
impl Signable for RoundAnnouncement {
    const KIND: MessageKind = MessageKind::RoundAnnouncement;
}
impl Signable for Contribution {
    const KIND: MessageKind = MessageKind::Contribution;
}
impl Signable for Heartbeat {
    const KIND: MessageKind = MessageKind::Heartbeat;
}
impl Signable for Ack {
    const KIND: MessageKind = MessageKind::Ack;
}
impl Signable for pcp_schema::Slice {
    const KIND: MessageKind = MessageKind::Slice;
}
impl Signable for pcp_schema::SliceReports {
    const KIND: MessageKind = MessageKind::SliceReports;
}
impl Signable for pcp_schema::Accepts {
    const KIND: MessageKind = MessageKind::Accepts;
}
impl Signable for pcp_schema::ShardVote {
    const KIND: MessageKind = MessageKind::ShardVote;
}
impl Signable for pcp_schema::ScreenRequest {
    const KIND: MessageKind = MessageKind::ScreenRequest;
}
impl Signable for pcp_schema::ScreenReport {
    const KIND: MessageKind = MessageKind::ScreenReport;
}

/// What a message is bound to, so that it cannot be replayed elsewhere or later: the
/// part of an envelope's [`EnvelopeHeader`] that the caller of [`seal`] supplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// The run.
    pub run: RunId,
    /// The round.
    pub round: u64,
    /// Unique per signer (a counter or random; supplied by the caller).
    pub nonce: u64,
    /// Signing time, from the caller's clock.
    pub unix_ms: u64,
}

impl Binding {
    /// The header of an envelope of `kind` signed by `signer` under this binding.
    fn header(self, kind: MessageKind, signer: PublicKey) -> EnvelopeHeader {
        let Self { run, round, nonce, unix_ms } = self;
        EnvelopeHeader { kind, signer: signer.0, run: run.0, round, nonce, unix_ms }
    }
}

/// Why an envelope was refused.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The envelope itself is malformed or oversized.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The claimed signer is not a valid ed25519 key.
    #[error("envelope signer {signer} is not a valid ed25519 key")]
    InvalidKey {
        /// The claimed signer.
        signer: PublicKey,
    },
    /// The signature does not verify for the claimed signer.
    #[error("envelope from {signer}: signature does not verify")]
    BadSignature {
        /// The claimed signer.
        signer: PublicKey,
    },
}

/// Why a verified envelope's payload was refused.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    /// The envelope holds another kind of message.
    #[error("envelope holds a {got} message, expected {expected}")]
    WrongKind {
        /// The kind asked for.
        expected: &'static str,
        /// The kind signed.
        got: &'static str,
    },
    /// The payload does not decode.
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// An envelope whose signature has been verified.
#[derive(Debug, Clone)]
pub struct Verified {
    envelope: SignedEnvelope,
}

fn signed_bytes(e: &SignedEnvelope) -> Vec<u8> {
    signed_fields(&e.header, blake3::hash(&e.payload).as_bytes())
}

/// What a signature covers: the domain, the kind's tag, signer, run, round, nonce,
/// unix_ms and the payload's blake3 hash.
fn signed_fields(header: &EnvelopeHeader, hash: &[u8; 32]) -> Vec<u8> {
    let EnvelopeHeader { kind, signer, run, round, nonce, unix_ms } = header;
    let tag = kind.tag().as_bytes();
    let mut m = Vec::with_capacity(DOMAIN.len() + tag.len() + 1 + 32 * 3 + 24);
    m.extend_from_slice(DOMAIN);
    m.extend_from_slice(tag);
    m.push(0);
    m.extend_from_slice(signer);
    m.extend_from_slice(run);
    for n in [round, nonce, unix_ms] {
        m.extend_from_slice(&n.to_le_bytes());
    }
    m.extend_from_slice(hash);
    m
}

/// The frame head of `envelope`: everything but its payload, whose length and hash it
/// carries instead (see [`FrameHead`]).
pub fn head_of(envelope: &SignedEnvelope) -> FrameHead {
    FrameHead {
        header: envelope.header,
        payload_len: envelope.payload.len() as u64,
        payload_hash: *blake3::hash(&envelope.payload).as_bytes(),
        signature: envelope.signature,
    }
}

/// Verifies a frame head's signature before its payload is read: the signer committed
/// to the kind, run, round, nonce, time and the payload's hash. Returns the signer.
/// The payload, once read, must hash to [`FrameHead::payload_hash`].
pub fn verify_head(head: &FrameHead) -> Result<PublicKey, OpenError> {
    let signer = PublicKey(head.header.signer);
    let bytes = signed_fields(&head.header, &head.payload_hash);
    match signer.verify_raw(&bytes, &head.signature) {
        Ok(()) => Ok(signer),
        Err(VerifyFailure::InvalidKey) => Err(OpenError::InvalidKey { signer }),
        Err(VerifyFailure::BadSignature) => Err(OpenError::BadSignature { signer }),
    }
}

/// Signs `message` as `identity`, bound to `binding`.
pub fn seal<M: Signable>(identity: &Identity, binding: Binding, message: &M) -> SignedEnvelope {
    let mut envelope = SignedEnvelope {
        header: binding.header(M::KIND, identity.public()),
        payload: message.encode(),
        signature: [0; 64],
    };
    envelope.signature = identity.sign_raw(&signed_bytes(&envelope));
    envelope
}

/// Decodes an envelope from the wire and verifies its signature. The payload is not
/// decoded.
pub fn open(bytes: &[u8]) -> Result<Verified, OpenError> {
    verify(SignedEnvelope::decode(bytes)?)
}

/// Verifies an already decoded envelope.
pub fn verify(envelope: SignedEnvelope) -> Result<Verified, OpenError> {
    let signer = PublicKey(envelope.header.signer);
    match signer.verify_raw(&signed_bytes(&envelope), &envelope.signature) {
        Ok(()) => Ok(Verified { envelope }),
        Err(VerifyFailure::InvalidKey) => Err(OpenError::InvalidKey { signer }),
        Err(VerifyFailure::BadSignature) => Err(OpenError::BadSignature { signer }),
    }
}

impl Verified {
    /// Who signed it.
    pub fn signer(&self) -> PublicKey {
        PublicKey(self.envelope.header.signer)
    }

    /// The kind signed.
    pub fn kind(&self) -> MessageKind {
        self.envelope.header.kind
    }

    /// What it is bound to.
    pub fn binding(&self) -> Binding {
        let EnvelopeHeader { run, round, nonce, unix_ms, .. } = self.envelope.header;
        Binding { run: RunId(run), round, nonce, unix_ms }
    }

    /// The blake3 hash of the signed payload: two envelopes with the same message
    /// (a leader's announcement answered again) have the same one.
    pub fn payload_hash(&self) -> [u8; 32] {
        *blake3::hash(&self.envelope.payload).as_bytes()
    }

    /// The signed payload's length in bytes.
    pub fn payload_len(&self) -> usize {
        self.envelope.payload.len()
    }

    /// Decodes the payload as `M`, which must be the kind the signer committed to.
    pub fn decode<M: Signable>(&self) -> Result<M, PayloadError> {
        let kind = self.envelope.header.kind;
        if kind != M::KIND {
            return Err(PayloadError::WrongKind { expected: M::KIND.tag(), got: kind.tag() });
        }
        Ok(M::decode(&self.envelope.payload)?)
    }
}
