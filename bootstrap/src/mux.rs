//! The stream muxer of TCP connections: yamux (`/yamux/1.0.0`, the same protocol as
//! `libp2p::yamux`), configured for bulk transfer.
//!
//! `libp2p::yamux::Config` fixes yamux's frame size at 16 KiB, so a 1 MiB blob chunk
//! costs 64 frames, each with its own allocation, wake-ups through the connection task,
//! window accounting and `send`. Here a data frame with its 12-byte header fills exactly
//! [`RECORDS_PER_FRAME`] TLS records: 256 KiB, which is also a fresh stream's whole
//! initial window, so a chunk is four frames. [`crate::tls::Stream`] seals the header and
//! body as one run of full records and hands a frame's body to yamux in one read. Peers
//! that use `libp2p::yamux` read these frames as any other: yamux accepts bodies up to
//! 1 MiB and within the stream's window. Frames stay well under that so that a chunk
//! does not hold up the connection's other streams (gossip, heartbeats) for long on a
//! slow link.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, Waker, ready};

use futures::future;
use futures::{AsyncRead, AsyncWrite};
use libp2p::core::UpgradeInfo;
use libp2p::core::muxing::{StreamMuxer, StreamMuxerEvent};
use libp2p::core::upgrade::{InboundConnectionUpgrade, OutboundConnectionUpgrade};

/// The largest TLS 1.3 record payload.
const TLS_RECORD: usize = 16 << 10;
/// A yamux frame header.
const FRAME_HEADER: usize = 12;
/// TLS records per full data frame.
pub(crate) const RECORDS_PER_FRAME: usize = 16;
/// The body of a full data frame: with its header, [`RECORDS_PER_FRAME`] whole records.
pub(crate) const FRAME_BODY: usize = RECORDS_PER_FRAME * TLS_RECORD - FRAME_HEADER;
const _: () = assert!(FRAME_BODY < 1 << 20, "yamux refuses frame bodies over 1 MiB");
/// Inbound streams held while the swarm is busy; beyond this they are dropped (the
/// same bound as yamux's own backlog of unacknowledged streams).
const MAX_BUFFERED_INBOUND: usize = 256;
/// At most one warning about dropped streams per connection per interval.
const DROP_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// The yamux upgrade.
#[derive(Debug, Clone)]
pub(crate) struct Config(yamux::Config);

impl Default for Config {
    fn default() -> Self {
        let mut config = yamux::Config::default();
        config.set_split_send_size(FRAME_BODY);
        Self(config)
    }
}

impl UpgradeInfo for Config {
    type Info = &'static str;
    type InfoIter = std::iter::Once<&'static str>;

    fn protocol_info(&self) -> Self::InfoIter {
        std::iter::once("/yamux/1.0.0")
    }
}

impl<C> InboundConnectionUpgrade<C> for Config
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = Muxer<C>;
    type Error = io::Error;
    type Future = future::Ready<Result<Muxer<C>, io::Error>>;

    fn upgrade_inbound(self, io: C, _: Self::Info) -> Self::Future {
        future::ready(Ok(Muxer::new(yamux::Connection::new(io, self.0, yamux::Mode::Server))))
    }
}

impl<C> OutboundConnectionUpgrade<C> for Config
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = Muxer<C>;
    type Error = io::Error;
    type Future = future::Ready<Result<Muxer<C>, io::Error>>;

    fn upgrade_outbound(self, io: C, _: Self::Info) -> Self::Future {
        future::ready(Ok(Muxer::new(yamux::Connection::new(io, self.0, yamux::Mode::Client))))
    }
}

/// A yamux connection as a libp2p [`StreamMuxer`].
#[derive(Debug)]
pub(crate) struct Muxer<C> {
    connection: yamux::Connection<C>,
    /// Inbound streams that arrived while [`StreamMuxer::poll`] drove the connection.
    inbound: VecDeque<yamux::Stream>,
    inbound_waker: Option<Waker>,
    /// Inbound streams dropped since the last warning, logged at most once per
    /// [`DROP_LOG_INTERVAL`] so that a flood of streams is not a flood of lines.
    dropped: u64,
    last_drop_log: Option<std::time::Instant>,
}

impl<C> Muxer<C> {
    fn new(connection: yamux::Connection<C>) -> Self {
        Self { connection, inbound: VecDeque::new(), inbound_waker: None, dropped: 0, last_drop_log: None }
    }
}

/// A failed yamux connection.
#[derive(Debug, thiserror::Error)]
#[error("yamux: {0}")]
pub(crate) struct Error(#[from] yamux::ConnectionError);

impl From<Error> for io::Error {
    fn from(e: Error) -> Self {
        match e.0 {
            yamux::ConnectionError::Io(e) => e,
            other => io::Error::other(other),
        }
    }
}

impl<C> Muxer<C>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    /// Drives the connection until the next inbound stream.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Result<yamux::Stream, Error>> {
        match ready!(self.connection.poll_next_inbound(cx)) {
            Some(stream) => Poll::Ready(stream.map_err(Error)),
            None => Poll::Ready(Err(Error(yamux::ConnectionError::Closed))),
        }
    }
}

impl<C> StreamMuxer for Muxer<C>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    type Substream = yamux::Stream;
    type Error = Error;

    fn poll_inbound(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<yamux::Stream, Error>> {
        let this = self.get_mut();
        if let Some(stream) = this.inbound.pop_front() {
            return Poll::Ready(Ok(stream));
        }
        if let Poll::Ready(next) = this.poll_next(cx) {
            return Poll::Ready(next);
        }
        this.inbound_waker = Some(cx.waker().clone());
        Poll::Pending
    }

    fn poll_outbound(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<yamux::Stream, Error>> {
        self.get_mut().connection.poll_new_outbound(cx).map_err(Error)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.get_mut().connection.poll_close(cx).map_err(Error)
    }

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<StreamMuxerEvent, Error>> {
        let this = self.get_mut();
        let stream = ready!(this.poll_next(cx))?;
        if this.inbound.len() < MAX_BUFFERED_INBOUND {
            this.inbound.push_back(stream);
            if let Some(waker) = this.inbound_waker.take() {
                waker.wake();
            }
        } else {
            this.dropped += 1;
            let now = std::time::Instant::now();
            if this.last_drop_log.is_none_or(|t| now.duration_since(t) >= DROP_LOG_INTERVAL) {
                let dropped = std::mem::take(&mut this.dropped);
                tracing::warn!("yamux: {dropped} inbound streams dropped ({MAX_BUFFERED_INBOUND} already waited)");
                this.last_drop_log = Some(now);
            }
        }
        // let the swarm take the stream before driving the connection further
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
