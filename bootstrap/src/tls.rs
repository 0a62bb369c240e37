//! TLS 1.3 security for TCP connections, following the libp2p TLS handshake
//! (`/tls/1.0.0`): each side presents one self-signed certificate whose libp2p
//! extension is signed by its identity key, and the PeerId comes from that key.
//!
//! Certificates are made and checked by `libp2p-tls`; what this module adds:
//!
//! * **The cipher-suite order.** `libp2p-tls` always offers ChaCha20-Poly1305 first,
//!   so two libp2p peers always pick it. On a CPU with AES instructions AES-GCM costs a
//!   fraction of that, and blob transfer between two peers on one machine runs about
//!   20% faster (see the blob benchmark in docs/benchmarks.md). Where the CPU lacks them the order
//!   stays ChaCha20 first. TLS 1.2 is never negotiated.
//! * **Its own record layer.** rustls runs the handshake through its unbuffered API
//!   ([`handshake`]), then hands over the traffic secrets and [`Stream`] seals and opens
//!   records itself, with rustls' AEADs, decrypting in place (see [`stream`]). The
//!   records on the wire are standard TLS 1.3: stock rustls peers interoperate, key
//!   updates included.
//!
//! Noise remains the fallback on TCP: a peer that does not speak `/tls/1.0.0` gets
//! noise, and [`Config::new`] with `enabled = false` offers noise only.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{AsyncRead, AsyncWrite, FutureExt};
use libp2p::PeerId;
use libp2p::core::UpgradeInfo;
use libp2p::core::upgrade::{InboundConnectionUpgrade, OutboundConnectionUpgrade};
use libp2p::identity::Keypair;
use libp2p::tls::certificate;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, aws_lc_rs};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use rustls::{
    CertificateError, CommonState, DigitallySignedStruct, DistinguishedName, OtherError, PeerIncompatible,
    SignatureScheme, SupportedCipherSuite,
};

mod handshake;
mod stream;

pub(crate) use stream::Stream;

/// The multistream-select name of the libp2p TLS handshake.
pub(crate) const PROTOCOL: &str = "/tls/1.0.0";

/// ALPN token required by the libp2p TLS spec.
const ALPN: &[u8] = b"libp2p";

/// Why the TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConfigError {
    /// The libp2p certificate could not be generated from the identity key.
    #[error("tls certificate: {0}")]
    Certificate(#[from] certificate::GenError),
    /// rustls refused the configuration.
    #[error("tls configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Why a TLS handshake failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HandshakeError {
    /// The TLS handshake itself failed (bad certificate, bad signature, I/O).
    #[error("tls handshake: {0}")]
    Handshake(std::io::Error),
    /// The handshake ended without exactly one peer certificate.
    #[error("tls handshake: the peer presented no single certificate")]
    NoCertificate,
    /// The peer's certificate is not a valid libp2p certificate.
    #[error("tls certificate: {0}")]
    Certificate(#[from] certificate::ParseError),
}

/// The TLS upgrade for TCP connections.
#[derive(Clone)]
pub(crate) struct Config {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    enabled: bool,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tls::Config")
            .field("enabled", &self.enabled)
            .field("cipher_suites", &cipher_suites(aes_hardware()))
            .finish()
    }
}

impl Config {
    /// A configuration presenting a certificate for `key`. With `enabled = false`
    /// the upgrade offers no protocol, so multistream-select falls through to noise.
    pub(crate) fn new(key: &Keypair, enabled: bool) -> Result<Self, ConfigError> {
        Self::with_suite_order(key, enabled, aes_hardware())
    }

    /// [`Config::new`] with AES-GCM offered first (`aes`) or ChaCha20-Poly1305.
    fn with_suite_order(key: &Keypair, enabled: bool, aes: bool) -> Result<Self, ConfigError> {
        let provider = Arc::new(provider(aes));
        let (cert, private_key) = certificate::generate(key)?;
        // A fixed resolver, not `with_single_cert`: rustls' key check parses the
        // certificate with webpki, which refuses libp2p's critical extension.
        let signer = provider.key_provider.load_private_key(private_key)?;
        let identity = Arc::new(SingleCertAndKey::from(CertifiedKey::new(vec![cert], signer)));
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(Arc::new(Verifier))
            .with_cert_resolver(identity.clone());
        server.alpn_protocols = vec![ALPN.to_vec()];
        // `Stream` runs the record layer itself once the handshake is done
        server.enable_secret_extraction = true;
        // libp2p connections are never resumed
        server.send_tls13_tickets = 0;
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Verifier))
            .with_client_cert_resolver(identity);
        client.alpn_protocols = vec![ALPN.to_vec()];
        client.enable_secret_extraction = true;
        client.resumption = rustls::client::Resumption::disabled();
        Ok(Self { server: Arc::new(server), client: Arc::new(client), enabled })
    }
}

/// Whether this CPU has AES and carry-less multiply instructions (AES-GCM in hardware).
fn aes_hardware() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes") && std::arch::is_aarch64_feature_detected!("pmull")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// The TLS 1.3 suites in order of preference: AES-GCM first with AES hardware,
/// ChaCha20-Poly1305 first without.
fn cipher_suites(aes: bool) -> Vec<SupportedCipherSuite> {
    use aws_lc_rs::cipher_suite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256};
    if aes {
        vec![TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256]
    } else {
        vec![TLS13_CHACHA20_POLY1305_SHA256, TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384]
    }
}

fn provider(aes: bool) -> CryptoProvider {
    CryptoProvider { cipher_suites: cipher_suites(aes), ..aws_lc_rs::default_provider() }
}

impl UpgradeInfo for Config {
    type Info = &'static str;
    type InfoIter = std::option::IntoIter<&'static str>;

    fn protocol_info(&self) -> Self::InfoIter {
        self.enabled.then_some(PROTOCOL).into_iter()
    }
}

impl<C> InboundConnectionUpgrade<C> for Config
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = (PeerId, Stream<C>);
    type Error = HandshakeError;
    type Future = BoxFuture<'static, Result<Self::Output, Self::Error>>;

    fn upgrade_inbound(self, socket: C, _: Self::Info) -> Self::Future {
        async move {
            let conn = rustls::server::UnbufferedServerConnection::new(self.server).map_err(handshake_error)?;
            handshake::run(socket, conn).await
        }
        .boxed()
    }
}

impl<C> OutboundConnectionUpgrade<C> for Config
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = (PeerId, Stream<C>);
    type Error = HandshakeError;
    type Future = BoxFuture<'static, Result<Self::Output, Self::Error>>;

    fn upgrade_outbound(self, socket: C, _: Self::Info) -> Self::Future {
        async move {
            // The spec forbids a server name; an IP address name sends no SNI.
            let name = ServerName::IpAddress(IpAddr::V4(Ipv4Addr::UNSPECIFIED).into());
            let conn = rustls::client::UnbufferedClientConnection::new(self.client, name).map_err(handshake_error)?;
            handshake::run(socket, conn).await
        }
        .boxed()
    }
}

fn handshake_error(e: rustls::Error) -> HandshakeError {
    HandshakeError::Handshake(std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// The PeerId in the one certificate the peer presented (already verified by [`Verifier`]).
fn peer_certificate(state: &CommonState) -> Result<PeerId, HandshakeError> {
    match state.peer_certificates() {
        Some([cert]) => Ok(certificate::parse(cert)?.peer_id()),
        _ => Err(HandshakeError::NoCertificate),
    }
}

/// Checks libp2p certificates on both sides of the handshake: exactly one
/// self-signed certificate whose libp2p extension is signed by the peer's identity
/// key, and a TLS 1.3 handshake signature by the certificate's key. Which PeerId
/// was expected is checked by the swarm against the dialed address.
#[derive(Debug)]
struct Verifier;

/// Signature schemes a libp2p certificate key may use.
const SCHEMES: [SignatureScheme; 9] = [
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ED25519,
    SignatureScheme::RSA_PSS_SHA512,
    SignatureScheme::RSA_PSS_SHA384,
    SignatureScheme::RSA_PSS_SHA256,
    SignatureScheme::RSA_PKCS1_SHA512,
    SignatureScheme::RSA_PKCS1_SHA384,
    SignatureScheme::RSA_PKCS1_SHA256,
];

fn invalid(e: impl std::error::Error + Send + Sync + 'static) -> rustls::Error {
    rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(e))))
}

fn verify_presented(
    end_entity: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
) -> Result<(), rustls::Error> {
    if !intermediates.is_empty() {
        return Err(rustls::Error::General("libp2p TLS takes exactly one certificate".into()));
    }
    certificate::parse(end_entity).map(|_| ()).map_err(invalid)
}

fn verify_tls13(
    message: &[u8],
    cert: &CertificateDer<'_>,
    dss: &DigitallySignedStruct,
) -> Result<HandshakeSignatureValid, rustls::Error> {
    certificate::parse(cert)
        .map_err(invalid)?
        .verify_signature(dss.scheme, message, dss.signature())
        .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadSignature))?;
    Ok(HandshakeSignatureValid::assertion())
}

fn no_tls12() -> rustls::Error {
    rustls::Error::PeerIncompatible(PeerIncompatible::Tls12NotOffered)
}

/// The handshake-signature methods, which `ServerCertVerifier` and
/// `ClientCertVerifier` share: TLS 1.3 only, signed by the certificate's key.
macro_rules! handshake_signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            _message: &[u8],
            _cert: &CertificateDer<'_>,
            _dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Err(no_tls12())
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            SCHEMES.to_vec()
        }
    };
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        verify_presented(end_entity, intermediates)?;
        Ok(ServerCertVerified::assertion())
    }

    handshake_signatures!();
}

impl ClientCertVerifier for Verifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        verify_presented(end_entity, intermediates)?;
        Ok(ClientCertVerified::assertion())
    }

    handshake_signatures!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aes_first_only_with_aes_hardware() {
        let name = |s: &SupportedCipherSuite| s.suite();
        assert_eq!(name(&cipher_suites(true)[0]), rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        assert_eq!(name(&cipher_suites(false)[0]), rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256);
        assert_eq!(cipher_suites(true).len(), 3);
    }

    #[test]
    fn disabled_offers_no_protocol() {
        let key = Keypair::generate_ed25519();
        assert_eq!(Config::new(&key, true).unwrap().protocol_info().collect::<Vec<_>>(), [PROTOCOL]);
        assert_eq!(Config::new(&key, false).unwrap().protocol_info().count(), 0);
    }

    type Side = (PeerId, Stream<tokio_util::compat::Compat<tokio::net::UnixStream>>);

    /// `a` dials `b` over a socket pair: the client's and the server's ends, each with the
    /// PeerId it learnt.
    async fn handshake(a: &Keypair, b: &Keypair) -> (Side, Side) {
        let (sa, sb) = tokio::net::UnixStream::pair().unwrap();
        let client = Config::new(a, true).unwrap().upgrade_outbound(sa.compat(), PROTOCOL);
        let server = Config::new(b, true).unwrap().upgrade_inbound(sb.compat(), PROTOCOL);
        let (client, server) = tokio::join!(client, server);
        (client.unwrap(), server.unwrap())
    }

    /// A full handshake over a socket pair: both sides learn the other's PeerId, and
    /// the suite is AES-128-GCM exactly when this CPU has AES instructions.
    #[tokio::test]
    async fn handshake_names_both_peers_and_picks_the_suite() {
        let (a, b) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
        let ((server_peer, stream), (client_peer, _)) = handshake(&a, &b).await;
        assert_eq!(server_peer, b.public().to_peer_id());
        assert_eq!(client_peer, a.public().to_peer_id());
        let suite = stream.suite().suite();
        let want = if aes_hardware() {
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        } else {
            rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256
        };
        assert_eq!(suite, want);
    }

    /// Small writes are held back and sent with the next one or on flush: whatever the mix
    /// of sizes, the peer reads exactly the bytes written, in order, and a small write
    /// followed by a flush arrives without another write after it.
    #[tokio::test]
    async fn small_and_large_writes_arrive_in_order() {
        let (a, b) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
        let ((_, mut client), (_, mut server)) = handshake(&a, &b).await;
        let pieces: Vec<Vec<u8>> = (0..200usize)
            .map(|i| {
                let len = [12, 70_000, 4, 1_000, 64, 65][i % 6];
                (0..len).map(|j| (i * 31 + j) as u8).collect()
            })
            .chain([b"last!".to_vec()])
            .collect();
        let sent = pieces.concat();
        let writer = async {
            for p in &pieces {
                client.write_all(p).await.unwrap();
            }
            client.flush().await.unwrap();
            client
        };
        let reader = async {
            let mut got = vec![0u8; sent.len()];
            server.read_exact(&mut got).await.unwrap();
            got
        };
        let (mut client, got) = tokio::join!(writer, reader);
        assert_eq!(got, sent);

        // a lone small write is held until the flush, then arrives
        client.write_all(b"ping").await.unwrap();
        client.flush().await.unwrap();
        let mut ping = [0u8; 4];
        server.read_exact(&mut ping).await.unwrap();
        assert_eq!(&ping, b"ping");
    }

    use futures::{AsyncReadExt, AsyncWriteExt};
    use tokio_util::compat::{Compat, TokioAsyncReadCompatExt};

    fn pattern(len: usize, seed: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + seed) as u8).collect()
    }

    /// Writes `data` on `from` while `to` reads it, and checks that it arrived whole.
    async fn send_and_check(
        from: &mut (impl AsyncWrite + Unpin),
        to: &mut (impl futures::AsyncRead + Unpin),
        data: &[u8],
    ) {
        let (sent, got) = tokio::join!(async { from.write_all(data).await.and(from.flush().await) }, async {
            let mut got = vec![0; data.len()];
            to.read_exact(&mut got).await.map(|()| got)
        });
        sent.unwrap();
        assert_eq!(got.unwrap(), data);
    }

    /// At the confidentiality limit of the suite, less a margin, the sender replaces
    /// its key with a `key_update` before sealing the next record. With
    /// ChaCha20-Poly1305 the limit is the 64-bit sequence number itself: both ends
    /// jump to just short of it, and every byte still arrives under the new key.
    /// With AES-GCM (rustls allows 2^24 records per key) aws-lc's sealing key counts its own
    /// nonces, so there the jump cannot be staged: the limit is checked, and
    /// `record_layer_speaks_tls_with_stock_rustls_through_key_updates` replaces the
    /// key every two records.
    #[tokio::test]
    async fn the_key_is_replaced_at_the_sequence_limit() {
        for aes in [true, false] {
            let (a, b) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
            let (sa, sb) = tokio::net::UnixStream::pair().unwrap();
            let client = Config::with_suite_order(&a, true, aes).unwrap().upgrade_outbound(sa.compat(), PROTOCOL);
            let server = Config::with_suite_order(&b, true, aes).unwrap().upgrade_inbound(sb.compat(), PROTOCOL);
            let (client, server) = tokio::join!(client, server);
            let ((_, mut client), (_, mut server)) = (client.unwrap(), server.unwrap());
            let (_, limit) = client.tx_seq();
            if aes {
                assert_eq!(client.suite().suite(), rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
                assert_eq!(limit, (1 << 24) - 1024, "rustls' AES-GCM limit, 2^24 records, less the margin");
                continue;
            }
            assert_eq!(client.suite().suite(), rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256);
            assert_eq!(limit, u64::MAX - 1024);
            client.set_seq(Some(limit - 3), None);
            server.set_seq(None, Some(limit - 3));
            let mut sent = Vec::new();
            for i in 0..8 {
                let record = pattern(1000, i);
                client.write_all(&record).await.unwrap();
                client.flush().await.unwrap();
                sent.extend_from_slice(&record);
            }
            let (seq, _) = client.tx_seq();
            assert!(seq < 8, "the key was replaced and the count restarted ({seq})");
            let mut got = vec![0; sent.len()];
            server.read_exact(&mut got).await.unwrap();
            assert_eq!(got, sent);
        }
    }

    /// pcp's record layer against stock rustls (`futures-rustls`) on the other end: data
    /// both ways, a `key_update` the stock side requests (ours must switch its receive key
    /// and answer before its next record), our own key replaced every two records, and a
    /// clean close_notify.
    #[tokio::test]
    async fn record_layer_speaks_tls_with_stock_rustls_through_key_updates() {
        let (a, b) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
        let (sa, sb) = tokio::net::UnixStream::pair().unwrap();
        let ours = Config::new(&a, true).unwrap().upgrade_outbound(sa.compat(), PROTOCOL);
        let stock = futures_rustls::TlsAcceptor::from(Config::new(&b, true).unwrap().server).accept(sb.compat());
        let (ours, stock) = tokio::join!(ours, stock);
        let ((peer, mut ours), mut stock) = (ours.unwrap(), stock.unwrap());
        assert_eq!(peer, b.public().to_peer_id());

        send_and_check(&mut ours, &mut stock, &pattern(100_000, 1)).await;

        stock.get_mut().1.refresh_traffic_keys().unwrap();
        let down = pattern(50_000, 2);
        stock.write_all(&down).await.unwrap();
        stock.flush().await.unwrap();
        let mut got = vec![0; down.len()];
        ours.read_exact(&mut got).await.unwrap();
        assert_eq!(got, down);

        ours.set_rekey_at(2);
        send_and_check(&mut ours, &mut stock, &pattern(200_000, 3)).await;

        ours.close().await.unwrap();
        let mut rest = Vec::new();
        assert_eq!(stock.read_to_end(&mut rest).await.unwrap(), 0);
    }

    /// Stock rustls dialing pcp's side: both directions arrive, and the stock side's
    /// close_notify ends our stream with a clean end of file.
    #[tokio::test]
    async fn stock_rustls_client_talks_to_our_server() {
        let (a, b) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
        let (sa, sb) = tokio::net::UnixStream::pair().unwrap();
        let name = ServerName::IpAddress(IpAddr::V4(Ipv4Addr::UNSPECIFIED).into());
        let stock =
            futures_rustls::TlsConnector::from(Config::new(&a, true).unwrap().client).connect(name, sa.compat());
        let ours = Config::new(&b, true).unwrap().upgrade_inbound(sb.compat(), PROTOCOL);
        let (stock, ours) = tokio::join!(stock, ours);
        let (mut stock, (peer, mut ours)) = (stock.unwrap(), ours.unwrap());
        assert_eq!(peer, a.public().to_peer_id());

        let up = pattern(70_000, 4);
        stock.write_all(&up).await.unwrap();
        stock.flush().await.unwrap();
        let mut got = vec![0; up.len()];
        ours.read_exact(&mut got).await.unwrap();
        assert_eq!(got, up);

        ours.write_all(b"hello").await.unwrap();
        ours.flush().await.unwrap();
        let mut hello = [0; 5];
        stock.read_exact(&mut hello).await.unwrap();
        assert_eq!(&hello, b"hello");

        stock.close().await.unwrap();
        let mut rest = Vec::new();
        assert_eq!(ours.read_to_end(&mut rest).await.unwrap(), 0);
    }

    /// Whatever the peer puts on the wire after the handshake, a bad record ends the
    /// stream with an error naming it, and an oversized length is refused from its header
    /// alone (the reader does not wait for 64 KiB that will never be a valid record).
    #[tokio::test]
    async fn bad_records_are_refused() {
        type Raw = Compat<tokio::net::UnixStream>;
        let cases: [(&[u8], &str); 3] = [
            (&[23, 3, 3, 0xff, 0xff], "exceeds"),
            (&[22, 3, 3, 0, 4, 1, 2, 3, 4], "outer record type"),
            (&[23, 3, 3, 0, 20, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], "tls:"),
        ];
        for (bytes, want) in cases {
            let (a, b) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
            let ((_, mut client), (_, mut server)) = handshake(&a, &b).await;
            let raw: &mut Raw = client.io_mut();
            raw.write_all(bytes).await.unwrap();
            let mut buf = [0; 16];
            let err = server.read(&mut buf).await.unwrap_err();
            assert!(err.to_string().contains(want), "{err} lacks {want}");
        }
    }

    /// Fuzzing the record reader: arbitrary bytes after the handshake (bare, or behind
    /// a well-formed application-data header so they reach the AEAD), then the end of
    /// the stream. The reader answers an error or the end, never plaintext, and never
    /// waits for more. 256 cases, each a fresh handshake.
    #[test]
    fn arbitrary_records_never_yield_plaintext() {
        use proptest::prelude::*;
        type Raw = Compat<tokio::net::UnixStream>;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let config = proptest::test_runner::Config { cases: 256, ..Default::default() };
        proptest!(config, |(body in proptest::collection::vec(any::<u8>(), 0..600), framed in any::<bool>())| {
            let mut bytes = Vec::new();
            if framed {
                bytes.extend_from_slice(&[23, 3, 3]);
                bytes.extend_from_slice(&(body.len() as u16).to_be_bytes());
            }
            bytes.extend_from_slice(&body);
            let read = rt.block_on(async {
                let (a, b) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
                let ((_, mut client), (_, mut server)) = handshake(&a, &b).await;
                let raw: &mut Raw = client.io_mut();
                raw.write_all(&bytes).await.unwrap();
                raw.close().await.unwrap();
                let mut buf = [0; 1024];
                tokio::time::timeout(std::time::Duration::from_secs(10), server.read(&mut buf)).await
            });
            let read = read.map_err(|_| TestCaseError::fail("the reader waited for bytes after the end"))?;
            prop_assert!(!matches!(read, Ok(n) if n > 0), "{} bytes of plaintext from garbage", read.unwrap_or(0));
        });
    }

    #[test]
    fn a_foreign_certificate_is_refused() {
        let (cert, _) = certificate::generate(&Keypair::generate_ed25519()).unwrap();
        assert!(verify_presented(&cert, &[]).is_ok());
        assert!(verify_presented(&cert, std::slice::from_ref(&cert)).is_err());
        let mut tampered = cert.to_vec();
        let last = tampered.len() - 1;
        tampered[last] ^= 1;
        assert!(verify_presented(&CertificateDer::from(tampered), &[]).is_err());
    }
}
