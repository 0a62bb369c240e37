//! Drives rustls' unbuffered connection through the TLS 1.3 handshake over an async
//! socket, then hands the traffic secrets to [`Stream`]'s record layer.

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use rustls::client::{ClientConnectionData, UnbufferedClientConnection};
use rustls::kernel::KernelConnection;
use rustls::server::{ServerConnectionData, UnbufferedServerConnection};
use rustls::unbuffered::{ConnectionState, EncodeError, InsufficientSizeError, UnbufferedStatus};
use rustls::{CommonState, ExtractedSecrets};

use super::stream::{KeySchedule, READ_BUFFER, Stream};
use super::{HandshakeError, handshake_error as tls, peer_certificate};

/// One side of an unbuffered handshake; the two differ only in their types.
pub(super) trait Side: Send {
    type Data: Send + Sync + 'static;

    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn common(&self) -> &CommonState;
    fn into_kernel(self) -> Result<(ExtractedSecrets, KernelConnection<Self::Data>), rustls::Error>;
}

/// The two unbuffered connections have the same methods on different types.
macro_rules! side {
    ($conn:ty, $data:ty) => {
        impl Side for $conn {
            type Data = $data;

            fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data> {
                self.process_tls_records(incoming)
            }
            fn common(&self) -> &CommonState {
                self
            }
            fn into_kernel(self) -> Result<(ExtractedSecrets, KernelConnection<Self::Data>), rustls::Error> {
                self.dangerous_into_kernel_connection()
            }
        }
    };
}

side!(UnbufferedClientConnection, ClientConnectionData);
side!(UnbufferedServerConnection, ServerConnectionData);

impl<D: Send + Sync> KeySchedule for KernelConnection<D> {
    fn next_tx(&mut self) -> Result<rustls::ConnectionTrafficSecrets, rustls::Error> {
        self.update_tx_secret().map(|(_, secrets)| secrets)
    }
    fn next_rx(&mut self) -> Result<rustls::ConnectionTrafficSecrets, rustls::Error> {
        self.update_rx_secret().map(|(_, secrets)| secrets)
    }
}

/// What the handshake loop does after a state is handled.
enum Next {
    /// Ask rustls again: it has more to say.
    Process,
    /// Read more bytes from the peer.
    Read,
    /// rustls may send application data: done, if the handshake is complete.
    Writable,
}

/// Runs the handshake of `conn` over `io`, then returns the peer's PeerId and the
/// established stream. Application data the peer sent along with its last handshake
/// flight is kept for the first reads.
pub(super) async fn run<C, S>(mut io: C, mut conn: S) -> Result<(libp2p::PeerId, Stream<C>), HandshakeError>
where
    C: AsyncRead + AsyncWrite + Unpin,
    S: Side,
    KernelConnection<S::Data>: KeySchedule,
{
    let mut incoming = vec![0u8; READ_BUFFER].into_boxed_slice();
    let mut used = 0;
    let mut outgoing = Vec::new();
    let mut early = Vec::new();
    loop {
        let UnbufferedStatus { mut discard, state } = conn.process(&mut incoming[..used]);
        let next = match state.map_err(tls)? {
            ConnectionState::ReadTraffic(mut records) => {
                while let Some(record) = records.next_record() {
                    let record = record.map_err(tls)?;
                    discard += record.discard;
                    early.extend_from_slice(record.payload);
                }
                Next::Process
            }
            ConnectionState::EncodeTlsData(mut encode) => {
                let start = outgoing.len();
                let needed = match encode.encode(&mut []) {
                    Ok(_) => 0,
                    Err(EncodeError::InsufficientSize(InsufficientSizeError { required_size })) => required_size,
                    Err(e) => return Err(tls(rustls::Error::General(e.to_string()))),
                };
                if needed > 0 {
                    outgoing.resize(start + needed, 0);
                    let n = encode
                        .encode(&mut outgoing[start..])
                        .map_err(|e| tls(rustls::Error::General(e.to_string())))?;
                    outgoing.truncate(start + n);
                }
                Next::Process
            }
            ConnectionState::TransmitTlsData(transmit) => {
                io.write_all(&outgoing).await.map_err(HandshakeError::Handshake)?;
                io.flush().await.map_err(HandshakeError::Handshake)?;
                outgoing.clear();
                transmit.done();
                Next::Process
            }
            ConnectionState::BlockedHandshake => Next::Read,
            ConnectionState::WriteTraffic(_) => Next::Writable,
            ConnectionState::PeerClosed | ConnectionState::Closed => {
                return Err(HandshakeError::Handshake(std::io::ErrorKind::UnexpectedEof.into()));
            }
            other => return Err(tls(rustls::Error::General(format!("unexpected handshake state {other:?}")))),
        };
        incoming.copy_within(discard..used, 0);
        used -= discard;
        match next {
            Next::Process => continue,
            Next::Writable if !conn.common().is_handshaking() => break,
            Next::Read | Next::Writable => {
                if used == incoming.len() {
                    return Err(tls(rustls::Error::General("handshake flight exceeds the read buffer".into())));
                }
                let n = io.read(&mut incoming[used..]).await.map_err(HandshakeError::Handshake)?;
                if n == 0 {
                    return Err(HandshakeError::Handshake(std::io::ErrorKind::UnexpectedEof.into()));
                }
                used += n;
            }
        }
    }
    let peer = peer_certificate(conn.common())?;
    let (secrets, kernel) = conn.into_kernel().map_err(tls)?;
    let suite = kernel.negotiated_cipher_suite();
    let stream = Stream::new(io, suite, secrets, Box::new(kernel), incoming, used, early).map_err(tls)?;
    Ok((peer, stream))
}
