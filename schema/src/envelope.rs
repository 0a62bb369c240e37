//! The signed envelope that carries every gossiped or requested control message.

use crate::codec::{self, DecodeError, MAX_CONTRIBUTION, MAX_CONTROL_MESSAGE, Message, fixed, malformed};
use crate::wire::pcp_capnp::{MessageKind as WireKind, frame_head, signed_envelope};

/// Which message an envelope's payload holds. Part of the signed bytes, so a signature
/// for one kind never verifies as another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    /// [`crate::NodeHello`].
    NodeHello,
    /// [`crate::RunManifest`].
    RunManifest,
    /// [`crate::RoundAnnouncement`].
    RoundAnnouncement,
    /// [`crate::Contribution`].
    Contribution,
    /// [`crate::Heartbeat`].
    Heartbeat,
    /// [`crate::Ack`].
    Ack,
    /// [`crate::Slice`].
    Slice,
    /// [`crate::SliceReports`].
    SliceReports,
    /// [`crate::Accepts`].
    Accepts,
    /// [`crate::ShardVote`].
    ShardVote,
    /// [`crate::ScreenRequest`].
    ScreenRequest,
    /// [`crate::ScreenReport`].
    ScreenReport,
}

impl MessageKind {
    /// Every kind.
    pub const ALL: [Self; 12] = [
        Self::NodeHello,
        Self::RunManifest,
        Self::RoundAnnouncement,
        Self::Contribution,
        Self::Heartbeat,
        Self::Ack,
        Self::Slice,
        Self::SliceReports,
        Self::Accepts,
        Self::ShardVote,
        Self::ScreenRequest,
        Self::ScreenReport,
    ];

    /// A stable tag for signing.
    pub fn tag(self) -> &'static str {
        match self {
            Self::NodeHello => "node-hello",
            Self::RunManifest => "run-manifest",
            Self::RoundAnnouncement => "round-announcement",
            Self::Contribution => "contribution",
            Self::Heartbeat => "heartbeat",
            Self::Ack => "ack",
            Self::Slice => "slice",
            Self::SliceReports => "slice-reports",
            Self::Accepts => "accepts",
            Self::ShardVote => "shard-vote",
            Self::ScreenRequest => "screen-request",
            Self::ScreenReport => "screen-report",
        }
    }

    /// The largest payload an envelope of this kind may carry.
    pub fn max_payload(self) -> usize {
        match self {
            Self::Contribution | Self::Slice | Self::ScreenRequest => MAX_CONTRIBUTION,
            _ => MAX_CONTROL_MESSAGE,
        }
    }

    fn to_wire(self) -> WireKind {
        use WireKind as K;
        match self {
            Self::NodeHello => K::NodeHello,
            Self::RunManifest => K::RunManifest,
            Self::RoundAnnouncement => K::RoundAnnouncement,
            Self::Contribution => K::Contribution,
            Self::Heartbeat => K::Heartbeat,
            Self::Ack => K::Ack,
            Self::Slice => K::Slice,
            Self::SliceReports => K::SliceReports,
            Self::Accepts => K::Accepts,
            Self::ShardVote => K::ShardVote,
            Self::ScreenRequest => K::ScreenRequest,
            Self::ScreenReport => K::ScreenReport,
        }
    }

    fn from_wire(k: WireKind) -> Self {
        use WireKind as K;
        match k {
            K::NodeHello => Self::NodeHello,
            K::RunManifest => Self::RunManifest,
            K::RoundAnnouncement => Self::RoundAnnouncement,
            K::Contribution => Self::Contribution,
            K::Heartbeat => Self::Heartbeat,
            K::Ack => Self::Ack,
            K::Slice => Self::Slice,
            K::SliceReports => Self::SliceReports,
            K::Accepts => Self::Accepts,
            K::ShardVote => Self::ShardVote,
            K::ScreenRequest => Self::ScreenRequest,
            K::ScreenReport => Self::ScreenReport,
        }
    }
}

/// Who signed an envelope, which kind of message it holds, and what that message is
/// bound to: the fields the signature commits to besides the payload. A
/// [`SignedEnvelope`] and its [`FrameHead`] carry the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvelopeHeader {
    /// The payload's message kind.
    pub kind: MessageKind,
    /// The signer's ed25519 public key.
    pub signer: [u8; 32],
    /// The run this message belongs to.
    pub run: [u8; 32],
    /// The round this message belongs to.
    pub round: u64,
    /// A per-signer unique number.
    pub nonce: u64,
    /// When it was signed (signer's clock).
    pub unix_ms: u64,
}

/// Writes an [`EnvelopeHeader`] into the builder of a capnp struct that holds its
/// fields flat (`SignedEnvelope`, `FrameHead`).
macro_rules! set_header {
    ($root:expr, $header:expr) => {{
        let header: &EnvelopeHeader = $header;
        $root.set_kind(header.kind.to_wire());
        $root.set_signer(&header.signer[..]);
        $root.set_run(&header.run[..]);
        $root.set_round(header.round);
        $root.set_nonce(header.nonce);
        $root.set_unix_ms(header.unix_ms);
    }};
}

/// Reads an [`EnvelopeHeader`] from the reader of a capnp struct that holds its fields
/// flat, as message `$what`.
macro_rules! read_header {
    ($what:expr, $r:expr) => {{
        let (what, r) = ($what, &$r);
        let kind = r.get_kind().map_err(|e| DecodeError::Invalid { what, field: "kind", reason: e.to_string() })?;
        EnvelopeHeader {
            kind: MessageKind::from_wire(kind),
            signer: fixed(what, "signer", r.get_signer().map_err(|e| malformed(what, e))?)?,
            run: fixed(what, "run", r.get_run().map_err(|e| malformed(what, e))?)?,
            round: r.get_round(),
            nonce: r.get_nonce(),
            unix_ms: r.get_unix_ms(),
        }
    }};
}

/// A payload with its signer, its binding to a run, round and nonce, and a signature.
/// `pcp-protocol` signs and verifies it; this type only carries the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedEnvelope {
    /// The signer, the payload's kind and its binding.
    pub header: EnvelopeHeader,
    /// The encoded message.
    pub payload: Vec<u8>,
    /// ed25519 signature.
    pub signature: [u8; 64],
}

impl Message for SignedEnvelope {
    const NAME: &'static str = "SignedEnvelope";
    const MAX_SIZE: usize = MAX_CONTRIBUTION + 512;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<signed_envelope::Builder<'_>>();
        set_header!(root, &self.header);
        root.set_payload(&self.payload);
        root.set_signature(&self.signature[..]);
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = SignedEnvelope::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<signed_envelope::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let header = read_header!(W, r);
            let max = header.kind.max_payload();
            let payload = r.get_payload().map_err(|e| malformed(W, e))?;
            if payload.len() > max {
                return Err(DecodeError::TooLarge { what: "SignedEnvelope payload", len: payload.len(), max });
            }
            Ok(Self {
                header,
                payload: payload.to_vec(),
                signature: fixed(W, "signature", r.get_signature().map_err(|e| malformed(W, e))?)?,
            })
        })
    }
}

/// The largest encoded [`FrameHead`].
pub const MAX_FRAME_HEAD: usize = 512;

/// The head of a request-response frame: a [`SignedEnvelope`] without its payload,
/// which follows on the stream as [`FrameHead::payload_len`] raw bytes whose blake3
/// hash is [`FrameHead::payload_hash`]. The envelope's signature covers that hash, so
/// the head verifies on its own before any payload byte is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameHead {
    /// The envelope's signer, kind and binding.
    pub header: EnvelopeHeader,
    /// The payload's length in bytes.
    pub payload_len: u64,
    /// The payload's blake3 hash.
    pub payload_hash: [u8; 32],
    /// ed25519 signature.
    pub signature: [u8; 64],
}

impl FrameHead {
    /// The envelope this head announces, once its payload has arrived. Whether the
    /// payload matches [`FrameHead::payload_hash`] is the caller's to check.
    pub fn with_payload(self, payload: Vec<u8>) -> SignedEnvelope {
        SignedEnvelope { header: self.header, payload, signature: self.signature }
    }
}

impl Message for FrameHead {
    const NAME: &'static str = "FrameHead";
    const MAX_SIZE: usize = MAX_FRAME_HEAD;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<frame_head::Builder<'_>>();
        set_header!(root, &self.header);
        root.set_payload_len(self.payload_len);
        root.set_payload_hash(&self.payload_hash[..]);
        root.set_signature(&self.signature[..]);
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = FrameHead::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<frame_head::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let header = read_header!(W, r);
            let (kind, payload_len) = (header.kind, r.get_payload_len());
            if payload_len > kind.max_payload() as u64 {
                return Err(DecodeError::Invalid {
                    what: W,
                    field: "payloadLen",
                    reason: format!("{payload_len} bytes exceed {}'s limit of {}", kind.tag(), kind.max_payload()),
                });
            }
            Ok(Self {
                header,
                payload_len,
                payload_hash: fixed(W, "payloadHash", r.get_payload_hash().map_err(|e| malformed(W, e))?)?,
                signature: fixed(W, "signature", r.get_signature().map_err(|e| malformed(W, e))?)?,
            })
        })
    }
}
