//! Size-bounded framing shared by every message: limits, the [`Message`] trait and
//! [`DecodeError`].

use capnp::message::{Reader, ReaderOptions};
use capnp::serialize::NoAllocSliceSegments;

/// Bytes in one blob chunk (a power-of-two multiple of the blake3 chunk length, so each
/// chunk is a complete blake3 subtree).
pub const CHUNK_SIZE: usize = 1 << 20;
/// The largest blob the network transfers (8 GiB).
pub const MAX_BLOB_SIZE: u64 = 8 << 30;
/// The largest control message (hello, manifest, round, heartbeat, ack).
pub const MAX_CONTROL_MESSAGE: usize = 256 * 1024;
/// The largest contribution: an inline pseudo-gradient of up to 128 Mi fp32 values.
pub const MAX_CONTRIBUTION: usize = 512 << 20;
/// The largest blob request.
pub const MAX_BLOB_REQUEST: usize = 256;
/// The largest blob response: one chunk, or the outboard of the largest blob, plus framing.
pub const MAX_BLOB_RESPONSE: usize = CHUNK_SIZE + 4096;
/// The deepest nesting of structs and lists any message uses, with headroom.
const NESTING_LIMIT: i32 = 16;

/// Why bytes from the wire could not be decoded into a message.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The input is longer than the message's limit; nothing was parsed.
    #[error("{what}: {len} bytes exceed the limit of {max} bytes")]
    TooLarge {
        /// The message type.
        what: &'static str,
        /// Bytes received.
        len: usize,
        /// Bytes allowed.
        max: usize,
    },
    /// The capnp framing or structure is invalid (truncated, out of bounds, too deep).
    #[error("{what}: malformed message: {reason}")]
    Malformed {
        /// The message type.
        what: &'static str,
        /// capnp's description of the problem.
        reason: String,
    },
    /// Bytes follow the end of the message.
    #[error("{what}: {extra} trailing bytes after the message")]
    Trailing {
        /// The message type.
        what: &'static str,
        /// Extra bytes.
        extra: usize,
    },
    /// A fixed-size field (a key, hash or signature) has the wrong length.
    #[error("{what}: field `{field}` must be {expected} bytes, got {got}")]
    FieldLength {
        /// The message type.
        what: &'static str,
        /// The field.
        field: &'static str,
        /// Required length.
        expected: usize,
        /// Received length.
        got: usize,
    },
    /// A field holds a value the schema or the protocol does not allow.
    #[error("{what}: field `{field}` is invalid: {reason}")]
    Invalid {
        /// The message type.
        what: &'static str,
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// A wire message with a size-bounded encoding.
pub trait Message: Sized {
    /// The message's name in errors.
    const NAME: &'static str;
    /// The largest encoding accepted by [`Message::decode`].
    const MAX_SIZE: usize;

    /// Encodes to capnp's standard (unpacked) framing.
    fn encode(&self) -> Vec<u8>;

    /// Decodes, rejecting input over [`Message::MAX_SIZE`] before parsing it.
    fn decode(bytes: &[u8]) -> Result<Self, DecodeError>;
}

/// Parses `bytes` as one capnp message of at most `max` bytes and hands its reader to
/// `f`. The segment table is validated against the input without allocating for the sizes
/// it claims, and the traversal limit caps the words a decoder may visit at the input size.
pub(crate) fn read<T>(
    what: &'static str,
    bytes: &[u8],
    max: usize,
    f: impl FnOnce(Reader<NoAllocSliceSegments<'_>>) -> Result<T, DecodeError>,
) -> Result<T, DecodeError> {
    if bytes.len() > max {
        return Err(DecodeError::TooLarge { what, len: bytes.len(), max });
    }
    let mut options = ReaderOptions::new();
    options.traversal_limit_in_words(Some(bytes.len() / 8 + 1)).nesting_limit(NESTING_LIMIT);
    let mut rest = bytes;
    let reader =
        capnp::serialize::read_message_from_flat_slice_no_alloc(&mut rest, options).map_err(|e| malformed(what, e))?;
    if !rest.is_empty() {
        return Err(DecodeError::Trailing { what, extra: rest.len() });
    }
    f(reader)
}

/// Wraps a capnp error.
pub(crate) fn malformed(what: &'static str, err: impl std::fmt::Display) -> DecodeError {
    DecodeError::Malformed { what, reason: err.to_string() }
}

/// Copies a fixed-size byte field.
pub(crate) fn fixed<const N: usize>(
    what: &'static str,
    field: &'static str,
    bytes: &[u8],
) -> Result<[u8; N], DecodeError> {
    bytes.try_into().map_err(|_| DecodeError::FieldLength { what, field, expected: N, got: bytes.len() })
}

/// A 32-byte hash that older senders leave empty: zeros when empty.
pub(crate) fn optional_hash(what: &'static str, field: &'static str, bytes: &[u8]) -> Result<[u8; 32], DecodeError> {
    if bytes.is_empty() { Ok([0; 32]) } else { fixed(what, field, bytes) }
}

/// Reads a text field as an owned string.
pub(crate) fn text(
    what: &'static str,
    field: &'static str,
    t: capnp::Result<capnp::text::Reader<'_>>,
) -> Result<String, DecodeError> {
    let t = t.map_err(|e| malformed(what, e))?;
    t.to_str().map(str::to_owned).map_err(|e| DecodeError::Invalid { what, field, reason: e.to_string() })
}

/// Serializes a built message.
pub(crate) fn words<A: capnp::message::Allocator>(message: &capnp::message::Builder<A>) -> Vec<u8> {
    capnp::serialize::write_message_to_words(message)
}

/// Converts a length to a capnp list length. Lists built here come from in-memory
/// values; a list over `u32::MAX` entries could never fit a message limit anyway.
pub(crate) fn list_len(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}
