//! A request-response codec for capnp messages: a 4-byte big-endian length, then the
//! message. Each direction has the maximum size of its message type; a longer claimed
//! length is refused before any buffer is allocated.

use std::io;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use futures::prelude::*;
use libp2p::StreamProtocol;
use memmap2::Mmap;
use pcp_schema::{BlobRequest, BlobResponse, CHUNK_SIZE, Message};

/// Codec for requests `Req` and responses `Resp`.
#[derive(Debug)]
pub struct CapnpCodec<Req, Resp> {
    _types: PhantomData<fn() -> (Req, Resp)>,
}

impl<Req, Resp> Default for CapnpCodec<Req, Resp> {
    fn default() -> Self {
        Self { _types: PhantomData }
    }
}

impl<Req, Resp> Clone for CapnpCodec<Req, Resp> {
    fn clone(&self) -> Self {
        Self::default()
    }
}

/// The buffer reserved before a frame's bytes arrive (a blob chunk response fits); a
/// larger frame's buffer doubles as its bytes arrive.
const INITIAL_FRAME_CAPACITY: usize = 2 << 20;

async fn read_frame<T: AsyncRead + Unpin + Send, M: Message>(io: &mut T) -> io::Result<M> {
    let buf = read_frame_bytes::<T, M>(io).await?;
    M::decode(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// The bytes of one frame of message type `M`, not yet decoded.
async fn read_frame_bytes<T: AsyncRead + Unpin + Send, M: Message>(io: &mut T) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > M::MAX_SIZE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: frame of {len} bytes exceeds {} bytes", M::NAME, M::MAX_SIZE),
        ));
    }
    read_growing(io, len, M::NAME).await
}

/// Exactly `len` bytes of `what`. The buffer grows with what actually arrives: a peer
/// that announces many bytes and stops early costs at most twice what it sent. Each
/// step is zeroed once and read in place (no `read_to_end`, which re-zeroes and
/// reallocates past a chunk-sized frame).
pub(crate) async fn read_growing<T: AsyncRead + Unpin + Send>(
    io: &mut T,
    len: usize,
    what: &str,
) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    while buf.len() < len {
        let start = buf.len();
        let step = (len - start).min(INITIAL_FRAME_CAPACITY.max(start));
        buf.reserve_exact(step);
        buf.resize(start + step, 0);
        io.read_exact(&mut buf[start..]).await.map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                io::Error::new(e.kind(), format!("{what}: frame truncated before {} of {len} bytes", start + step))
            } else {
                e
            }
        })?;
    }
    Ok(buf)
}

async fn write_frame<T: AsyncWrite + Unpin + Send, M: Message>(io: &mut T, m: M) -> io::Result<()> {
    write_frame_bytes::<T, M>(io, &m.encode()).await
}

/// Writes an encoded message of type `M` as one frame and closes the stream.
async fn write_frame_bytes<T: AsyncWrite + Unpin + Send, M: Message>(io: &mut T, bytes: &[u8]) -> io::Result<()> {
    let len = u32::try_from(bytes.len()).ok().filter(|l| *l as usize <= M::MAX_SIZE).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: {} bytes exceed the frame limit", M::NAME, bytes.len()),
        )
    })?;
    io.write_all(&len.to_be_bytes()).await?;
    io.write_all(bytes).await?;
    io.close().await
}

impl<Req, Resp> libp2p::request_response::Codec for CapnpCodec<Req, Resp>
where
    Req: Message + Send + 'static,
    Resp: Message + Send + 'static,
{
    type Protocol = StreamProtocol;
    type Request = Req;
    type Response = Resp;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Req>
    where
        T: AsyncRead + Unpin + Send,
    {
        read_frame(io).await
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Resp>
    where
        T: AsyncRead + Unpin + Send,
    {
        read_frame(io).await
    }

    async fn write_request<T>(&mut self, _: &StreamProtocol, io: &mut T, req: Req) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_frame(io, req).await
    }

    async fn write_response<T>(&mut self, _: &StreamProtocol, io: &mut T, res: Resp) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_frame(io, res).await
    }
}

/// Alignment of a received chunk's bytes in memory, so that they can be written to disk
/// without the page cache (see [`crate::store`]) straight from the receive buffer.
pub(crate) const CHUNK_ALIGN: usize = 4096;
/// Chunk buffers kept for reuse. A fresh 1 MiB buffer costs page faults and zeroing on
/// every chunk (and glibc returns freed ones to the kernel); a reused one costs nothing.
const POOL_SIZE: usize = 32;
static POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// The capacity of every pooled buffer: a whole chunk response, at any of the placements
/// [`read_blob_response`] picks. One size for every use, so that a buffer that served a
/// read from disk serves a read from the network without growing (a `realloc` that copies
/// the old bytes and faults in fresh pages).
const POOLED_CAPACITY: usize = CHUNK_SIZE + CHUNK_ALIGN + 256;
const _: () = assert!(BlobResponse::CHUNK_PREFIX + 8 <= 256, "the chunk response prefix fits the spare room");

/// A chunk buffer from the pool, or a new one of [`POOLED_CAPACITY`]. Its length and
/// contents are whatever its last user left.
fn pooled_buffer() -> Vec<u8> {
    POOL.lock().ok().and_then(|mut pool| pool.pop()).unwrap_or_else(|| Vec::with_capacity(POOLED_CAPACITY))
}

fn recycle(buffer: Vec<u8>) {
    if (POOLED_CAPACITY..=2 * POOLED_CAPACITY).contains(&buffer.capacity())
        && let Ok(mut pool) = POOL.lock()
        && pool.len() < POOL_SIZE
    {
        pool.push(buffer);
    }
}

/// A blob chunk as a whole encoded response message: it is read from disk straight into
/// the message and verified and written straight out of it, never copied into or out of
/// a capnp builder or reader. Its buffer returns to a pool when dropped.
pub(crate) struct ChunkFrame {
    /// The message is `buffer[message..]`.
    buffer: Vec<u8>,
    message: usize,
    /// The chunk's bytes in `buffer`.
    data: Range<usize>,
}

impl Drop for ChunkFrame {
    fn drop(&mut self) {
        recycle(std::mem::take(&mut self.buffer));
    }
}

impl std::fmt::Debug for ChunkFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChunkFrame({} bytes)", self.data.len())
    }
}

impl ChunkFrame {
    /// A chunk response of `len` bytes that `fill` appends to the message.
    pub(crate) fn build(len: usize, fill: impl FnOnce(&mut Vec<u8>) -> io::Result<()>) -> io::Result<Self> {
        let (buffer, data) = BlobResponse::encode_chunk_with(pooled_buffer(), len, fill)?;
        Ok(Self { buffer, message: 0, data })
    }

    /// The chunk's bytes.
    pub(crate) fn data(&self) -> &[u8] {
        &self.buffer[self.data.clone()]
    }

    /// The encoded response message.
    fn message(&self) -> &[u8] {
        &self.buffer[self.message..]
    }
}

/// Reads a blob response frame into a pooled buffer, placed so that a chunk's bytes start
/// on a [`CHUNK_ALIGN`] boundary.
async fn read_blob_response<T: AsyncRead + Unpin + Send>(io: &mut T) -> io::Result<BlobReply> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > BlobResponse::MAX_SIZE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: frame of {len} bytes exceeds {} bytes", BlobResponse::NAME, BlobResponse::MAX_SIZE),
        ));
    }
    let mut buffer = pooled_buffer();
    buffer.reserve_exact((len + CHUNK_ALIGN).saturating_sub(buffer.len()));
    // capnp needs the message 8-byte aligned: the pad keeps it so (CHUNK_PREFIX is whole words)
    let pad = (buffer.as_ptr() as usize + BlobResponse::CHUNK_PREFIX).wrapping_neg() % CHUNK_ALIGN;
    // reuse the bytes the buffer already holds rather than zeroing them again
    buffer.resize(pad + len, 0);
    let read = io.read_exact(&mut buffer[pad..]).await;
    let invalid = |e| io::Error::new(io::ErrorKind::InvalidData, e);
    let located = read.and_then(|()| BlobResponse::chunk_range(&buffer[pad..]).map_err(invalid));
    match located {
        Ok(Some(data)) => {
            Ok(BlobReply::Chunk(ChunkFrame { buffer, message: pad, data: pad + data.start..pad + data.end }))
        }
        Ok(None) => {
            let decoded = BlobResponse::decode(&buffer[pad..]).map(BlobReply::Other).map_err(invalid);
            recycle(buffer);
            decoded
        }
        Err(e) => {
            recycle(buffer);
            Err(e)
        }
    }
}

/// A chunk of a complete blob, sent straight from the store's memory map of the blob:
/// the page cache is the only copy of the bytes until yamux frames them.
pub(crate) struct MappedChunk {
    map: Arc<Mmap>,
    data: Range<usize>,
}

impl std::fmt::Debug for MappedChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedChunk({} bytes at {})", self.data.len(), self.data.start)
    }
}

impl MappedChunk {
    /// Bytes `data` of `map`, or `None` when the range is not in the map.
    pub(crate) fn new(map: Arc<Mmap>, data: Range<usize>) -> Option<Self> {
        (data.start <= data.end && data.end <= map.len()).then_some(Self { map, data })
    }

    /// The chunk's bytes.
    pub(crate) fn data(&self) -> &[u8] {
        &self.map[self.data.clone()]
    }
}

/// Writes a mapped chunk as one response frame, the same bytes as [`ChunkFrame`]'s: the
/// length and capnp prefix, the chunk from the map, and the word padding.
async fn write_mapped<T: AsyncWrite + Unpin + Send>(io: &mut T, chunk: &MappedChunk) -> io::Result<()> {
    let data = chunk.data();
    let padding = BlobResponse::chunk_padding(data.len());
    let len = BlobResponse::CHUNK_PREFIX + data.len() + padding;
    let len = u32::try_from(len).ok().filter(|l| *l as usize <= BlobResponse::MAX_SIZE).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: {len} bytes exceed the frame limit", BlobResponse::NAME),
        )
    })?;
    let mut head = [0u8; 4 + BlobResponse::CHUNK_PREFIX];
    head[..4].copy_from_slice(&len.to_be_bytes());
    head[4..].copy_from_slice(&BlobResponse::chunk_prefix(data.len())?);
    io.write_all(&head).await?;
    io.write_all(data).await?;
    io.write_all(&[0; 8][..padding]).await?;
    io.close().await
}

/// A blob response as the blob codec carries it: chunks as [`ChunkFrame`]s (or, sent,
/// [`MappedChunk`]s), anything else decoded.
#[derive(Debug)]
pub(crate) enum BlobReply {
    /// A chunk.
    Chunk(ChunkFrame),
    /// A chunk to send from a memory map (never read from the wire).
    Mapped(MappedChunk),
    /// Any other response (never [`BlobResponse::Chunk`] when read from the wire).
    Other(BlobResponse),
}

impl From<BlobResponse> for BlobReply {
    fn from(r: BlobResponse) -> Self {
        Self::Other(r)
    }
}

/// The blob protocol's codec: [`BlobRequest`]s, and [`BlobReply`]s framed like
/// [`CapnpCodec`]'s, so the two are the same on the wire.
#[derive(Debug, Clone, Default)]
pub(crate) struct BlobCodec;

impl libp2p::request_response::Codec for BlobCodec {
    type Protocol = StreamProtocol;
    type Request = BlobRequest;
    type Response = BlobReply;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<BlobRequest>
    where
        T: AsyncRead + Unpin + Send,
    {
        read_frame(io).await
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<BlobReply>
    where
        T: AsyncRead + Unpin + Send,
    {
        read_blob_response(io).await
    }

    async fn write_request<T>(&mut self, _: &StreamProtocol, io: &mut T, req: BlobRequest) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_frame(io, req).await
    }

    async fn write_response<T>(&mut self, _: &StreamProtocol, io: &mut T, res: BlobReply) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        match res {
            BlobReply::Chunk(frame) => write_frame_bytes::<T, BlobResponse>(io, frame.message()).await,
            BlobReply::Mapped(chunk) => write_mapped(io, &chunk).await,
            BlobReply::Other(r) => write_frame(io, r).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::request_response::Codec;
    use pcp_schema::BlobWant;

    #[test]
    fn roundtrip_and_oversized_claim() {
        futures::executor::block_on(async {
            let req = BlobRequest { blob: [3; 32], want: BlobWant::Chunk(9) };
            let mut buf = Vec::new();
            write_frame(&mut futures::io::Cursor::new(&mut buf), req).await.expect("write to memory");
            let back: BlobRequest = read_frame(&mut &buf[..]).await.expect("read back");
            assert_eq!(back, req);

            // claims 4 GiB: refused from the header alone
            let huge = [0xffu8, 0xff, 0xff, 0xff, 0, 0];
            let err = read_frame::<_, BlobRequest>(&mut &huge[..]).await.err();
            assert_eq!(err.map(|e| e.kind()), Some(io::ErrorKind::InvalidData));

            // truncated body
            let err = read_frame::<_, BlobRequest>(&mut &buf[..buf.len() - 3]).await.err();
            assert_eq!(err.map(|e| e.kind()), Some(io::ErrorKind::UnexpectedEof));
        });
    }

    #[test]
    fn blob_codec_carries_chunks_in_place() {
        futures::executor::block_on(async {
            let protocol = crate::BLOB_PROTOCOL;
            let chunk: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
            let frame = ChunkFrame::build(chunk.len(), |m| {
                m.extend_from_slice(&chunk);
                Ok(())
            })
            .expect("chunk frame");
            let mut wire = Vec::new();
            let mut io = futures::io::Cursor::new(&mut wire);
            BlobCodec.write_response(&protocol, &mut io, BlobReply::Chunk(frame)).await.expect("write");
            // the same bytes as the generic codec's, and read back by it
            let generic: BlobResponse = read_frame(&mut &wire[..]).await.expect("generic read");
            assert_eq!(generic, BlobResponse::Chunk(chunk.clone()));
            match BlobCodec.read_response(&protocol, &mut &wire[..]).await.expect("read") {
                BlobReply::Chunk(f) => assert_eq!(f.data(), &chunk[..]),
                other => panic!("expected a chunk, got {other:?}"),
            }
            // a chunk written by the generic codec is read in place too
            let mut wire = Vec::new();
            write_frame(&mut futures::io::Cursor::new(&mut wire), BlobResponse::Chunk(chunk.clone()))
                .await
                .expect("generic write");
            match BlobCodec.read_response(&protocol, &mut &wire[..]).await.expect("read") {
                BlobReply::Chunk(f) => assert_eq!(f.data(), &chunk[..]),
                other => panic!("expected a chunk, got {other:?}"),
            }
            // a chunk sent from a memory map is the same bytes on the wire
            let mut file = tempfile::tempfile().expect("temp file");
            std::io::Write::write_all(&mut file, &chunk).expect("write temp file");
            // SAFETY: the file is private to this test and not changed while mapped.
            let map = Arc::new(unsafe { Mmap::map(&file) }.expect("map"));
            for range in [0..chunk.len(), 3..chunk.len() - 2] {
                let mapped = MappedChunk::new(Arc::clone(&map), range.clone()).expect("in range");
                let mut from_map = Vec::new();
                let mut io = futures::io::Cursor::new(&mut from_map);
                BlobCodec.write_response(&protocol, &mut io, BlobReply::Mapped(mapped)).await.expect("write");
                let part = &chunk[range.clone()];
                let frame = ChunkFrame::build(part.len(), |m| {
                    m.extend_from_slice(part);
                    Ok(())
                })
                .expect("chunk frame");
                let mut from_frame = Vec::new();
                let mut io = futures::io::Cursor::new(&mut from_frame);
                BlobCodec.write_response(&protocol, &mut io, BlobReply::Chunk(frame)).await.expect("write");
                assert_eq!(from_map, from_frame, "bytes {range:?}");
                let generic: BlobResponse = read_frame(&mut &from_map[..]).await.expect("generic read");
                assert_eq!(generic, BlobResponse::Chunk(part.to_vec()));
            }
            assert!(MappedChunk::new(map, 0..chunk.len() + 1).is_none(), "past the end of the map");
            let mut wire = Vec::new();
            let mut io = futures::io::Cursor::new(&mut wire);
            BlobCodec.write_response(&protocol, &mut io, BlobResponse::NotFound.into()).await.expect("write");
            match BlobCodec.read_response(&protocol, &mut &wire[..]).await.expect("read") {
                BlobReply::Other(BlobResponse::NotFound) => {}
                other => panic!("expected not-found, got {other:?}"),
            }
        });
    }
}
