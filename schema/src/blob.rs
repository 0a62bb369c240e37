//! Blob-chunk requests and responses.

use crate::codec::{
    self, CHUNK_SIZE, DecodeError, MAX_BLOB_REQUEST, MAX_BLOB_RESPONSE, MAX_BLOB_SIZE, Message, fixed, malformed,
};
use crate::wire::pcp_capnp::{blob_request, blob_response};

/// What a blob request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlobWant {
    /// The blob's size and the blake3 chaining value of every chunk.
    Outboard,
    /// One chunk, by index.
    Chunk(u32),
}

/// A request for part of a blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobRequest {
    /// The blob's content id.
    pub blob: [u8; 32],
    /// What is wanted.
    pub want: BlobWant,
}

/// The answer to a [`BlobRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlobResponse {
    /// Size and per-chunk chaining values; the fetcher checks that they merge to the blob's
    /// content id before trusting them.
    Outboard {
        /// Blob size in bytes.
        size: u64,
        /// One blake3 chaining value per [`CHUNK_SIZE`] chunk.
        chunk_cvs: Vec<[u8; 32]>,
    },
    /// The bytes of the requested chunk.
    Chunk(Vec<u8>),
    /// The responder does not have the blob.
    NotFound,
    /// The responder will not serve the request (busy, banned, out of range).
    Refused(String),
}

impl Message for BlobRequest {
    const NAME: &'static str = "BlobRequest";
    const MAX_SIZE: usize = MAX_BLOB_REQUEST;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<blob_request::Builder<'_>>();
        root.set_blob(&self.blob[..]);
        match self.want {
            BlobWant::Outboard => root.set_outboard(()),
            BlobWant::Chunk(i) => root.set_chunk(i),
        }
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = BlobRequest::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<blob_request::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let want = match r.which().map_err(|e| malformed(W, e))? {
                blob_request::Outboard(()) => BlobWant::Outboard,
                blob_request::Chunk(i) => BlobWant::Chunk(i),
            };
            Ok(Self { blob: fixed(W, "blob", r.get_blob().map_err(|e| malformed(W, e))?)?, want })
        })
    }
}

/// The number of chunks in a blob of `size` bytes (an empty blob has one empty chunk).
pub fn chunk_count(size: u64) -> u64 {
    size.div_ceil(CHUNK_SIZE as u64).max(1)
}

impl Message for BlobResponse {
    const NAME: &'static str = "BlobResponse";
    const MAX_SIZE: usize = MAX_BLOB_RESPONSE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<blob_response::Builder<'_>>();
        match self {
            Self::Outboard { size, chunk_cvs } => {
                let mut g = root.init_outboard();
                g.set_size(*size);
                g.set_chunk_cvs(chunk_cvs.as_flattened());
            }
            Self::Chunk(bytes) => root.set_chunk(bytes),
            Self::NotFound => root.set_not_found(()),
            Self::Refused(reason) => root.set_refused(reason.as_str()),
        }
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = BlobResponse::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<blob_response::Reader<'_>>().map_err(|e| malformed(W, e))?;
            Ok(match r.which().map_err(|e| malformed(W, e))? {
                blob_response::Outboard(g) => {
                    let size = g.get_size();
                    if size > MAX_BLOB_SIZE {
                        return Err(DecodeError::Invalid {
                            what: W,
                            field: "size",
                            reason: format!("{size} bytes exceed the blob limit of {MAX_BLOB_SIZE}"),
                        });
                    }
                    let cvs = g.get_chunk_cvs().map_err(|e| malformed(W, e))?;
                    let expected = chunk_count(size) as usize * 32;
                    if cvs.len() != expected {
                        return Err(DecodeError::FieldLength { what: W, field: "chunkCvs", expected, got: cvs.len() });
                    }
                    let chunk_cvs = cvs.chunks_exact(32).map(|c| fixed(W, "chunkCvs", c)).collect::<Result<_, _>>()?;
                    Self::Outboard { size, chunk_cvs }
                }
                blob_response::Chunk(data) => {
                    let data = data.map_err(|e| malformed(W, e))?;
                    if data.len() > CHUNK_SIZE {
                        return Err(DecodeError::Invalid {
                            what: W,
                            field: "chunk",
                            reason: format!("{} bytes exceed the chunk size", data.len()),
                        });
                    }
                    Self::Chunk(data.to_vec())
                }
                blob_response::NotFound(()) => Self::NotFound,
                blob_response::Refused(t) => Self::Refused(codec::text(W, "refused", t)?),
            })
        })
    }
}

/// Words of a chunk response before the chunk's bytes: the root pointer, the struct's two
/// data words and its pointer to the bytes.
const CHUNK_PREFIX_WORDS: usize = 4;
/// Bytes of a one-segment chunk response before the chunk: segment table and prefix words.
const CHUNK_PREFIX: usize = 8 + 8 * CHUNK_PREFIX_WORDS;
/// `BlobResponse`'s union discriminant for `chunk` (data word 1, bits 0..16).
const CHUNK_DISCRIMINANT: u16 = 1;

impl BlobResponse {
    /// Bytes of a chunk response encoded by [`BlobResponse::encode_chunk_with`] before the
    /// chunk: the segment table, root pointer, struct and list pointer.
    pub const CHUNK_PREFIX: usize = CHUNK_PREFIX;

    /// Encodes a chunk response of `len` bytes into `message` (cleared first; pass a
    /// reused buffer to save an allocation) without copying the chunk: `fill` appends
    /// exactly `len` bytes (read from a file, say). Returns the message, which decodes like
    /// [`Message::encode`] of [`BlobResponse::Chunk`], and where the chunk lies in it
    /// (from [`BlobResponse::CHUNK_PREFIX`] on).
    pub fn encode_chunk_with(
        mut message: Vec<u8>,
        len: usize,
        fill: impl FnOnce(&mut Vec<u8>) -> std::io::Result<()>,
    ) -> std::io::Result<(Vec<u8>, std::ops::Range<usize>)> {
        let prefix = Self::chunk_prefix(len)?;
        message.clear();
        message.reserve_exact(CHUNK_PREFIX + len + Self::chunk_padding(len));
        message.extend_from_slice(&prefix);
        fill(&mut message)?;
        if message.len() != CHUNK_PREFIX + len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{}: chunk of {} bytes where {len} were announced", Self::NAME, message.len() - CHUNK_PREFIX),
            ));
        }
        message.resize(CHUNK_PREFIX + len + Self::chunk_padding(len), 0);
        Ok((message, CHUNK_PREFIX..CHUNK_PREFIX + len))
    }

    /// The bytes of a chunk response of `len` bytes that come before the chunk. The whole
    /// message is this prefix, the chunk, and [`BlobResponse::chunk_padding`] zero bytes.
    pub fn chunk_prefix(len: usize) -> std::io::Result<[u8; CHUNK_PREFIX]> {
        let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
        if len > CHUNK_SIZE {
            return Err(invalid(format!("{}: a chunk of {len} bytes exceeds the chunk size", Self::NAME)));
        }
        let data_words = len.div_ceil(8);
        let segment_words = u32::try_from(CHUNK_PREFIX_WORDS + data_words).map_err(|e| invalid(e.to_string()))?;
        let mut prefix = [0u8; CHUNK_PREFIX];
        // segment table: one segment of `segment_words` words
        prefix[4..8].copy_from_slice(&segment_words.to_le_bytes());
        // root: a struct pointer to the next word, 2 data words and 1 pointer
        prefix[8..16].copy_from_slice(&[0, 0, 0, 0, 2, 0, 1, 0]);
        // data word 0: the outboard group's size (unused), word 1: the union discriminant
        prefix[24..32].copy_from_slice(&u64::from(CHUNK_DISCRIMINANT).to_le_bytes());
        // pointer 0: a byte list of `len` elements starting right after it
        prefix[32..36].copy_from_slice(&1u32.to_le_bytes());
        prefix[36..40].copy_from_slice(&((codec::list_len(len) << 3) | 2).to_le_bytes());
        Ok(prefix)
    }

    /// Zero bytes after a chunk of `len` bytes that end its response on a word boundary.
    pub fn chunk_padding(len: usize) -> usize {
        len.next_multiple_of(8) - len
    }

    /// Decodes `bytes` as far as needed to find a chunk: where the chunk's bytes lie in
    /// `bytes`, with the checks of [`Message::decode`]; `None` for any other valid response
    /// (decode it with [`Message::decode`]).
    pub fn chunk_range(bytes: &[u8]) -> Result<Option<std::ops::Range<usize>>, DecodeError> {
        const W: &str = BlobResponse::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<blob_response::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let data = match r.which().map_err(|e| malformed(W, e))? {
                blob_response::Chunk(data) => data.map_err(|e| malformed(W, e))?,
                _ => return Ok(None),
            };
            if data.len() > CHUNK_SIZE {
                return Err(DecodeError::Invalid {
                    what: W,
                    field: "chunk",
                    reason: format!("{} bytes exceed the chunk size", data.len()),
                });
            }
            // the reader borrows the input: the chunk is a sub-slice of `bytes`
            let start = (data.as_ptr() as usize).wrapping_sub(bytes.as_ptr() as usize);
            match start.checked_add(data.len()).and_then(|end| bytes.get(start..end)) {
                Some(found) if found.as_ptr() == data.as_ptr() => Ok(Some(start..start + data.len())),
                _ => Err(malformed(W, "chunk outside the message")),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn chunk_encoded_in_place_decodes_like_a_chunk() -> Result<(), Box<dyn std::error::Error>> {
        for len in [0, 1, 7, 8, 9, 4095, 4096, 100_000, CHUNK_SIZE - 1, CHUNK_SIZE] {
            let chunk = data(len);
            let (message, range) = BlobResponse::encode_chunk_with(Vec::new(), len, |m| {
                m.extend_from_slice(&chunk);
                Ok(())
            })?;
            assert_eq!(&message[range.clone()], &chunk[..], "len {len}");
            assert_eq!(message.len() % 8, 0);
            assert!(message.len() <= MAX_BLOB_RESPONSE);
            assert_eq!(BlobResponse::decode(&message)?, BlobResponse::Chunk(chunk.clone()), "len {len}");
            assert_eq!(BlobResponse::chunk_range(&message)?, Some(range));
            if len < 4096 {
                // capnp's own encoding of a small chunk is one segment too: the same bytes
                assert_eq!(BlobResponse::Chunk(chunk.clone()).encode(), message, "len {len}");
            }
            // capnp's encoding of any chunk is located as well
            let encoded = BlobResponse::Chunk(chunk.clone()).encode();
            let r = BlobResponse::chunk_range(&encoded)?.ok_or("not a chunk")?;
            assert_eq!(&encoded[r], &chunk[..]);
        }
        Ok(())
    }

    #[test]
    fn chunk_range_of_other_responses_and_bad_input() -> Result<(), Box<dyn std::error::Error>> {
        assert_eq!(BlobResponse::chunk_range(&BlobResponse::NotFound.encode())?, None);
        assert_eq!(BlobResponse::chunk_range(&BlobResponse::Refused("busy".into()).encode())?, None);
        let outboard = BlobResponse::Outboard { size: 5, chunk_cvs: vec![[7; 32]] }.encode();
        assert_eq!(BlobResponse::chunk_range(&outboard)?, None);
        let (message, _) = BlobResponse::encode_chunk_with(Vec::new(), 100, |m| {
            m.extend_from_slice(&data(100));
            Ok(())
        })?;
        assert!(BlobResponse::chunk_range(&message[..message.len() - 8]).is_err(), "truncated");
        assert!(BlobResponse::chunk_range(&[0xff; 64]).is_err());
        // a fill that supplies the wrong number of bytes is refused
        assert!(
            BlobResponse::encode_chunk_with(Vec::new(), 100, |m| {
                m.extend_from_slice(&data(99));
                Ok(())
            })
            .is_err()
        );
        assert!(BlobResponse::encode_chunk_with(Vec::new(), CHUNK_SIZE + 1, |_| Ok(())).is_err());
        Ok(())
    }
}
