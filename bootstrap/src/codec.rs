//! A request-response codec for capnp messages: a 4-byte big-endian length, then the
//! message. Each direction has the maximum size of its message type; a longer claimed
//! length is refused before any buffer is allocated.

use std::io;
use std::marker::PhantomData;

use futures::prelude::*;
use libp2p::StreamProtocol;
use pcp_schema::Message;

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

async fn read_frame<T: AsyncRead + Unpin + Send, M: Message>(io: &mut T) -> io::Result<M> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > M::MAX_SIZE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: frame of {len} bytes exceeds {} bytes", M::NAME, M::MAX_SIZE),
        ));
    }
    let mut buf = vec![0u8; len];
    io.read_exact(&mut buf).await?;
    M::decode(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

async fn write_frame<T: AsyncWrite + Unpin + Send, M: Message>(io: &mut T, m: M) -> io::Result<()> {
    let bytes = m.encode();
    let len = u32::try_from(bytes.len()).ok().filter(|l| *l as usize <= M::MAX_SIZE).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: {} bytes exceed the frame limit", M::NAME, bytes.len()),
        )
    })?;
    io.write_all(&len.to_be_bytes()).await?;
    io.write_all(&bytes).await?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use pcp_schema::{BlobRequest, BlobWant};

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
}
