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
