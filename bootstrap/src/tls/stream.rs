//! The byte stream of an established TLS connection, shaped for what runs on top of it
//! (yamux frames): reads ahead below TLS, and writes small pieces together with what
//! follows them.
//!
//! * **Reads.** rustls asks the socket for at most 4 KiB at a time, so a 16 KiB record
//!   costs four or five `recv` calls. [`ReadAhead`] sits below TLS and takes whatever the
//!   kernel has, up to [`READ_AHEAD`], in one call; rustls' small reads are then copies
//!   from memory that is still in cache.
//! * **Writes.** yamux writes each frame as two calls, its 12-byte header and then the
//!   body, and TLS turns each call into records and a `send`. [`Stream`] holds back writes
//!   of at most [`SMALL_WRITE`] bytes and hands them to rustls together with the next
//!   write (one vectored call, one `send`), or on flush.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::{AsyncRead, AsyncWrite};
use futures_rustls::TlsStream;
use rustls::CommonState;

/// How much [`ReadAhead`] takes from the socket in one call.
pub(crate) const READ_AHEAD: usize = 256 << 10;
/// Writes up to this size wait for the next write or a flush.
pub(crate) const SMALL_WRITE: usize = 64;

/// A reader that fills a buffer of [`READ_AHEAD`] bytes from `io` and serves reads from
/// it; writes pass through.
#[derive(Debug)]
pub(crate) struct ReadAhead<C> {
    io: C,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl<C> ReadAhead<C> {
    pub(crate) fn new(io: C) -> Self {
        Self { io, buf: Box::default(), start: 0, end: 0 }
    }
}

impl<C: AsyncRead + Unpin> AsyncRead for ReadAhead<C> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut [u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.start == this.end {
            if out.len() >= READ_AHEAD {
                return Pin::new(&mut this.io).poll_read(cx, out);
            }
            if this.buf.is_empty() {
                // allocated on the first read: the handshake's reads are small anyway
                this.buf = vec![0; READ_AHEAD].into_boxed_slice();
            }
            let n = ready!(Pin::new(&mut this.io).poll_read(cx, &mut this.buf))?;
            this.start = 0;
            this.end = n;
        }
        let n = out.len().min(this.end - this.start);
        out[..n].copy_from_slice(&this.buf[this.start..this.start + n]);
        this.start += n;
        Poll::Ready(Ok(n))
    }
}

impl<C: AsyncWrite + Unpin> AsyncWrite for ReadAhead<C> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_close(cx)
    }
}

/// An established TLS connection over `C`.
pub(crate) struct Stream<C> {
    tls: TlsStream<ReadAhead<C>>,
    /// Small writes not yet handed to rustls (at most [`SMALL_WRITE`] bytes).
    held: Vec<u8>,
}

impl<C> std::fmt::Debug for Stream<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tls::Stream").field("held", &self.held.len()).finish_non_exhaustive()
    }
}

impl<C> Stream<C> {
    pub(crate) fn new(tls: TlsStream<ReadAhead<C>>) -> Self {
        Self { tls, held: Vec::with_capacity(SMALL_WRITE) }
    }

    /// The TLS session (negotiated suite, peer certificates).
    pub(crate) fn session(&self) -> &CommonState {
        self.tls.get_ref().1
    }
}

impl<C: AsyncRead + AsyncWrite + Unpin> Stream<C> {
    /// Hands every held byte to rustls.
    fn poll_release(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.held.is_empty() {
            let n = ready!(Pin::new(&mut self.tls).poll_write(cx, &self.held))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.held.drain(..n);
        }
        Poll::Ready(Ok(()))
    }
}

impl<C: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<C> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tls).poll_read(cx, buf)
    }
}

impl<C: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<C> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if this.held.len() + buf.len() <= SMALL_WRITE {
            this.held.extend_from_slice(buf);
            return Poll::Ready(Ok(buf.len()));
        }
        loop {
            if this.held.is_empty() {
                return Pin::new(&mut this.tls).poll_write(cx, buf);
            }
            let bufs = [IoSlice::new(&this.held), IoSlice::new(buf)];
            let n = ready!(Pin::new(&mut this.tls).poll_write_vectored(cx, &bufs))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            let held = this.held.len();
            if n > held {
                this.held.clear();
                return Poll::Ready(Ok(n - held));
            }
            // only (part of) the held bytes went: go on with the rest
            this.held.drain(..n);
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_release(cx))?;
        Pin::new(&mut self.tls).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_release(cx))?;
        Pin::new(&mut self.tls).poll_close(cx)
    }
}
