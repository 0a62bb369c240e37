//! The record layer of an established TLS 1.3 connection.
//!
//! rustls runs the handshake (see [`super::handshake`]) and then hands over the traffic
//! secrets; this module seals and opens the records itself with rustls' own AEAD
//! implementations. That is what kTLS does in the kernel, and for the same reason: a
//! buffered rustls connection copies every received byte three times (the socket read
//! into its deframer, the decrypted record into a plaintext queue, the queue into the
//! caller's buffer). Here the socket reads straight into one buffer, records are
//! decrypted where they lie, and the plaintext is copied once, into the caller's buffer.
//!
//! * **Reads.** Up to [`READ_BUFFER`] bytes per `recv`; each record is checked
//!   (outer type, length at most 2^14 + 256) before it is decrypted in place.
//! * **Writes.** Each write becomes records of at most 2^14 bytes, sealed and queued,
//!   and the queue goes to the socket in one vectored call. Writes of at most
//!   [`SMALL_WRITE`] bytes (yamux's frame headers) wait and are sealed together with the
//!   next write, or at flush.
//! * **Post-handshake messages.** A peer's `key_update` switches the receive key (and,
//!   if asked, ours too, before our next record); `new_session_ticket` is ignored (pcp
//!   does not resume sessions); `close_notify` ends the stream. Our own key is replaced
//!   well before the suite's confidentiality limit.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::{AsyncRead, AsyncWrite};
use rustls::crypto::cipher::{
    InboundOpaqueMessage, MessageDecrypter, MessageEncrypter, OutboundChunks, OutboundPlainMessage, Tls13AeadAlgorithm,
};
use rustls::{ConnectionTrafficSecrets, ContentType, ExtractedSecrets, ProtocolVersion, SupportedCipherSuite};

/// How much one socket read may take (and the largest handshake flight).
pub(crate) const READ_BUFFER: usize = 256 << 10;
/// Writes up to this size wait for the next write or a flush.
pub(crate) const SMALL_WRITE: usize = 64;
/// The largest plaintext in one record (RFC 8446 §5.1).
const MAX_PLAINTEXT: usize = 1 << 14;
/// The largest ciphertext in one record (RFC 8446 §5.2).
const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;
/// A record header: type, legacy version, length.
const HEADER: usize = 5;
/// The partial record moves to the front when less than this is left behind it.
const MIN_READ: usize = 64 << 10;
/// Sealed bytes queued before writes wait for the socket.
const WRITE_QUEUE: usize = 256 << 10;
/// `key_update` messages accepted in a row without application data between them.
const KEY_UPDATES_IN_A_ROW: u8 = 32;
/// Records sealed under one key before it is replaced, this far short of the limit.
const REKEY_MARGIN: u64 = 1 << 10;

const KEY_UPDATE: u8 = 24;
const NEW_SESSION_TICKET: u8 = 4;
const CLOSE_NOTIFY: u8 = 0;
const USER_CANCELED: u8 = 90;

/// Where the next traffic secrets come from after a `key_update` (rustls'
/// `KernelConnection`).
pub(super) trait KeySchedule: Send {
    fn next_tx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error>;
    fn next_rx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error>;
}

fn broken(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("tls: {what}"))
}

/// An established TLS 1.3 connection over `C`.
pub(crate) struct Stream<C> {
    io: C,
    suite: SupportedCipherSuite,
    aead: &'static dyn Tls13AeadAlgorithm,
    keys: Box<dyn KeySchedule>,
    rx: Rx,
    tx: Tx,
}

/// The receiving half: ciphertext in `buf[next..end]`, plaintext being read in `plain`.
struct Rx {
    open: Box<dyn MessageDecrypter>,
    seq: u64,
    buf: Box<[u8]>,
    next: usize,
    end: usize,
    plain: Range<usize>,
    /// Application data that arrived with the handshake, read before anything else.
    early: Vec<u8>,
    early_read: usize,
    key_updates: u8,
    closed: bool,
}

/// The sending half: sealed records waiting for the socket.
struct Tx {
    seal: Box<dyn MessageEncrypter>,
    seq: u64,
    /// Replace the key once this many records were sealed with it.
    rekey_at: u64,
    /// The peer asked for our key to be replaced too.
    update_requested: bool,
    queue: VecDeque<Vec<u8>>,
    /// Bytes of `queue[0]` already written.
    written: usize,
    queued: usize,
    held: Vec<u8>,
    close_sent: bool,
}

impl<C> std::fmt::Debug for Stream<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tls::Stream")
            .field("suite", &self.suite.suite())
            .field("rx_seq", &self.rx.seq)
            .field("tx_seq", &self.tx.seq)
            .field("queued", &self.tx.queued)
            .finish_non_exhaustive()
    }
}

fn parts(
    secrets: ConnectionTrafficSecrets,
) -> Result<(rustls::crypto::cipher::AeadKey, rustls::crypto::cipher::Iv), rustls::Error> {
    match secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv }
        | ConnectionTrafficSecrets::Aes256Gcm { key, iv }
        | ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => Ok((key, iv)),
        _ => Err(rustls::Error::General("unsupported traffic secret".into())),
    }
}

impl<C> Stream<C> {
    /// The record layer after a handshake: `incoming[..used]` holds bytes already read
    /// past the handshake, `early` the application data that came with it.
    pub(super) fn new(
        io: C,
        suite: SupportedCipherSuite,
        secrets: ExtractedSecrets,
        keys: Box<dyn KeySchedule>,
        incoming: Box<[u8]>,
        used: usize,
        early: Vec<u8>,
    ) -> Result<Self, rustls::Error> {
        let tls13 = suite.tls13().ok_or(rustls::Error::General("TLS 1.2 is not supported".into()))?;
        let aead = tls13.aead_alg;
        let (tx_seq, tx) = secrets.tx;
        let (rx_seq, rx) = secrets.rx;
        let (key, iv) = parts(tx)?;
        let seal = aead.encrypter(key, iv);
        let (key, iv) = parts(rx)?;
        let open = aead.decrypter(key, iv);
        Ok(Self {
            io,
            suite,
            aead,
            keys,
            rx: Rx {
                open,
                seq: rx_seq,
                buf: incoming,
                next: 0,
                end: used,
                plain: 0..0,
                early,
                early_read: 0,
                key_updates: 0,
                closed: false,
            },
            tx: Tx {
                seal,
                seq: tx_seq,
                rekey_at: tls13.common.confidentiality_limit.saturating_sub(REKEY_MARGIN),
                update_requested: false,
                queue: VecDeque::new(),
                written: 0,
                queued: 0,
                held: Vec::with_capacity(SMALL_WRITE),
                close_sent: false,
            },
        })
    }

    /// The negotiated cipher suite.
    #[cfg(test)]
    pub(super) fn suite(&self) -> SupportedCipherSuite {
        self.suite
    }

    #[cfg(test)]
    pub(super) fn set_rekey_at(&mut self, records: u64) {
        self.tx.rekey_at = records;
    }

    #[cfg(test)]
    pub(super) fn io_mut(&mut self) -> &mut C {
        &mut self.io
    }

    /// Records sealed under the current send key, and when it will be replaced.
    #[cfg(test)]
    pub(super) fn tx_seq(&self) -> (u64, u64) {
        (self.tx.seq, self.tx.rekey_at)
    }

    /// Moves the sequence numbers (both ends of a connection must agree).
    #[cfg(test)]
    pub(super) fn set_seq(&mut self, tx: Option<u64>, rx: Option<u64>) {
        self.tx.seq = tx.unwrap_or(self.tx.seq);
        self.rx.seq = rx.unwrap_or(self.rx.seq);
    }

    /// Seals `typ` records carrying `chunks`, replacing our key first when it is due.
    fn seal(&mut self, typ: ContentType, chunks: &[&[u8]]) -> io::Result<()> {
        let mut rest = OutboundChunks::new(chunks);
        loop {
            if self.tx.update_requested || self.tx.seq >= self.tx.rekey_at {
                self.rekey_tx()?;
            }
            let (record, tail) = rest.split_at(MAX_PLAINTEXT);
            self.seal_one(typ, record)?;
            if tail.is_empty() {
                return Ok(());
            }
            rest = tail;
        }
    }

    fn seal_one(&mut self, typ: ContentType, payload: OutboundChunks<'_>) -> io::Result<()> {
        let message = OutboundPlainMessage { typ, version: ProtocolVersion::TLSv1_2, payload };
        let sealed = self.tx.seal.encrypt(message, self.tx.seq).map_err(broken)?.encode();
        self.tx.seq += 1;
        self.tx.queued += sealed.len();
        self.tx.queue.push_back(sealed);
        Ok(())
    }

    /// Sends `key_update(update_not_requested)` under the old key and switches to the next.
    fn rekey_tx(&mut self) -> io::Result<()> {
        self.seal_one(ContentType::Handshake, OutboundChunks::Single(&[KEY_UPDATE, 0, 0, 1, 0]))?;
        let (key, iv) = self.keys.next_tx().and_then(parts).map_err(broken)?;
        self.tx.seal = self.aead.encrypter(key, iv);
        self.tx.seq = 0;
        self.tx.update_requested = false;
        Ok(())
    }

    /// Seals the held small writes followed by `data` as application data (nothing if
    /// both are empty), and empties the held buffer (keeping its allocation).
    fn seal_after_held(&mut self, data: &[u8]) -> io::Result<()> {
        if self.tx.held.is_empty() && data.is_empty() {
            return Ok(());
        }
        let held = std::mem::take(&mut self.tx.held);
        let sealed = self.seal(ContentType::ApplicationData, &[&held, data]);
        self.tx.held = held;
        self.tx.held.clear();
        sealed
    }

    /// Takes in one opened record: application data becomes the plaintext to read,
    /// anything else is handled as a control message.
    fn accept(&mut self, (typ, range): (ContentType, Range<usize>)) -> io::Result<()> {
        if typ == ContentType::ApplicationData {
            self.rx.key_updates = 0;
            self.rx.plain = range;
            Ok(())
        } else {
            self.control(typ, range)
        }
    }

    /// Copies plaintext into `out`: the record being read, then as many whole records
    /// as are already buffered (without asking the socket), so that a large read (a
    /// yamux frame body) takes one call rather than one per record.
    fn read_buffered(&mut self, out: &mut [u8]) -> io::Result<usize> {
        let mut filled = 0;
        loop {
            let rx = &mut self.rx;
            let n = (out.len() - filled).min(rx.plain.len());
            out[filled..filled + n].copy_from_slice(&rx.buf[rx.plain.start..rx.plain.start + n]);
            rx.plain.start += n;
            filled += n;
            if filled == out.len() || rx.closed {
                return Ok(filled);
            }
            match self.open_buffered()? {
                Some(record) => self.accept(record)?,
                None => return Ok(filled),
            }
        }
    }

    /// Decrypts the next record if all of it is in the buffer: its inner type and the
    /// range of its plaintext in `rx.buf`; `None` if more bytes are needed.
    fn open_buffered(&mut self) -> io::Result<Option<(ContentType, Range<usize>)>> {
        match self.record_len()? {
            Ok(len) => self.open(len).map(Some),
            Err(_) => Ok(None),
        }
    }

    /// The length of the next record with its header if all of it is buffered, else
    /// `Err` with how many bytes from `rx.next` are needed to go on.
    fn record_len(&self) -> io::Result<Result<usize, usize>> {
        let rx = &self.rx;
        let have = rx.end - rx.next;
        if have < HEADER {
            return Ok(Err(HEADER));
        }
        let header = &rx.buf[rx.next..rx.next + HEADER];
        if header[0] != u8::from(ContentType::ApplicationData) {
            return Err(broken(format!("unexpected outer record type {}", header[0])));
        }
        let len = u16::from_be_bytes([header[3], header[4]]) as usize;
        if len > MAX_CIPHERTEXT {
            return Err(broken(format!("record of {len} bytes exceeds {MAX_CIPHERTEXT}")));
        }
        Ok(if have >= HEADER + len { Ok(HEADER + len) } else { Err(HEADER + len) })
    }

    /// Decrypts the buffered record of `len` bytes (header included) at `rx.next` in place.
    fn open(&mut self, len: usize) -> io::Result<(ContentType, Range<usize>)> {
        let rx = &mut self.rx;
        let base = rx.buf.as_ptr() as usize;
        let body = &mut rx.buf[rx.next + HEADER..rx.next + len];
        let message = InboundOpaqueMessage::new(ContentType::ApplicationData, ProtocolVersion::TLSv1_2, body);
        let plain = rx.open.decrypt(message, rx.seq).map_err(broken)?;
        rx.seq += 1;
        rx.next += len;
        let offset = plain.payload.as_ptr() as usize - base;
        Ok((plain.typ, offset..offset + plain.payload.len()))
    }

    /// Handles one decrypted record that is not application data.
    fn control(&mut self, typ: ContentType, range: Range<usize>) -> io::Result<()> {
        let mut msg = &self.rx.buf[range];
        match typ {
            ContentType::Alert => match msg {
                [_, CLOSE_NOTIFY] => {
                    self.rx.closed = true;
                    Ok(())
                }
                [_, USER_CANCELED] => Ok(()),
                [_, description] => Err(broken(format!("peer sent alert {description}"))),
                _ => Err(broken("malformed alert")),
            },
            ContentType::Handshake => {
                while !msg.is_empty() {
                    let [kind, a, b, c, rest @ ..] = msg else {
                        return Err(broken("truncated post-handshake message"));
                    };
                    let len = u32::from_be_bytes([0, *a, *b, *c]) as usize;
                    if rest.len() < len {
                        return Err(broken("post-handshake message split across records"));
                    }
                    let (body, rest) = rest.split_at(len);
                    match (*kind, body) {
                        (KEY_UPDATE, [request @ (0 | 1)]) if rest.is_empty() => {
                            self.rx.key_updates += 1;
                            if self.rx.key_updates > KEY_UPDATES_IN_A_ROW {
                                return Err(broken("too many key updates"));
                            }
                            let (key, iv) = self.keys.next_rx().and_then(parts).map_err(broken)?;
                            self.rx.open = self.aead.decrypter(key, iv);
                            self.rx.seq = 0;
                            self.tx.update_requested |= *request == 1;
                        }
                        (KEY_UPDATE, _) => return Err(broken("malformed key_update")),
                        (NEW_SESSION_TICKET, _) => {}
                        (kind, _) => return Err(broken(format!("unexpected post-handshake message {kind}"))),
                    }
                    msg = rest;
                }
                Ok(())
            }
            other => Err(broken(format!("unexpected record type {other:?}"))),
        }
    }
}

impl<C: AsyncRead + Unpin> Stream<C> {
    /// Opens the next whole record in the buffer, reading from the socket as needed.
    /// Returns its inner type and the range of its plaintext in `rx.buf`.
    fn poll_record(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<(ContentType, Range<usize>)>> {
        loop {
            let need = match self.record_len()? {
                Ok(len) => return Poll::Ready(self.open(len)),
                Err(need) => need,
            };
            let rx = &mut self.rx;
            let have = rx.end - rx.next;
            if have == 0 {
                (rx.next, rx.end) = (0, 0);
            } else if rx.next + need > rx.buf.len() || rx.buf.len() - rx.end < MIN_READ {
                // move the partial record to the front: at most one record's bytes
                rx.buf.copy_within(rx.next..rx.end, 0);
                rx.end = have;
                rx.next = 0;
            }
            let n = ready!(Pin::new(&mut self.io).poll_read(cx, &mut rx.buf[rx.end..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "tls: connection closed without close_notify",
                )));
            }
            rx.end += n;
        }
    }
}

impl<C: AsyncWrite + Unpin> Stream<C> {
    /// Writes queued records until the queue is empty.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let tx = &mut self.tx;
        while !tx.queue.is_empty() {
            let mut slices = [IoSlice::new(&[]); 64];
            let mut count = 0;
            for (i, record) in tx.queue.iter().take(slices.len()).enumerate() {
                let from = if i == 0 { tx.written } else { 0 };
                slices[i] = IoSlice::new(&record[from..]);
                count += 1;
            }
            let mut n = ready!(Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..count]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            tx.queued -= n;
            while n > 0 {
                let Some(front) = tx.queue.front() else { break };
                let left = front.len() - tx.written;
                if n >= left {
                    n -= left;
                    tx.written = 0;
                    tx.queue.pop_front();
                } else {
                    tx.written += n;
                    n = 0;
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<C: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<C> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut [u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        loop {
            let rx = &mut this.rx;
            if rx.early_read < rx.early.len() {
                let n = out.len().min(rx.early.len() - rx.early_read);
                out[..n].copy_from_slice(&rx.early[rx.early_read..rx.early_read + n]);
                rx.early_read += n;
                if rx.early_read == rx.early.len() {
                    rx.early = Vec::new();
                    rx.early_read = 0;
                }
                return Poll::Ready(Ok(n));
            }
            if !rx.plain.is_empty() {
                return Poll::Ready(this.read_buffered(out));
            }
            if rx.closed || out.is_empty() {
                return Poll::Ready(Ok(0));
            }
            let record = ready!(this.poll_record(cx))?;
            this.accept(record)?;
        }
    }
}

impl<C: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<C> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if this.tx.close_sent {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "tls: write after close_notify")));
        }
        if this.tx.queued > 0 && this.poll_send(cx)?.is_pending() && this.tx.queued >= WRITE_QUEUE {
            return Poll::Pending;
        }
        if this.tx.held.len() + buf.len() <= SMALL_WRITE {
            this.tx.held.extend_from_slice(buf);
            return Poll::Ready(Ok(buf.len()));
        }
        let take = buf.len().min(WRITE_QUEUE);
        this.seal_after_held(&buf[..take])?;
        // the records are queued: whatever the socket takes now is a head start
        if let Poll::Ready(Err(e)) = this.poll_send(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(take))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.seal_after_held(&[])?;
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.seal_after_held(&[])?;
        if !this.tx.close_sent {
            this.seal_one(ContentType::Alert, OutboundChunks::Single(&[1, CLOSE_NOTIFY]))?;
            this.tx.close_sent = true;
        }
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.io).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use futures::{AsyncReadExt, AsyncWriteExt};
    use rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256;
    use rustls::crypto::tls13::OkmBlock;

    use super::*;

    /// RFC 8448 §3 (simple 1-RTT handshake, TLS_AES_128_GCM_SHA256): the application
    /// traffic secrets, the keys and IVs derived from them, and the records sent.
    const CLIENT_SECRET: &str = "9e40646ce79a7f9dc05af8889bce6552875afa0b06df0087f792ebb7c17504a5";
    const CLIENT_KEY_IV: (&str, &str) = ("17422dda596ed5d9acd890e3c63f5051", "5b78923dee08579033e523d9");
    const SERVER_SECRET: &str = "a11af9f05531f856ad47116b45a950328204b4f44bfb6b3a4b4f1f3fcb631643";
    const SERVER_KEY_IV: (&str, &str) = ("9f02283b6c9c07efc26bb9f2ac92e356", "cf782b88dd83549aadf1e984");
    /// `{client} send application_data record`: bytes 0x00..=0x31 at sequence 0.
    const CLIENT_DATA_RECORD: &str = "1703030043a23f7054b62c94d0affafe8228ba55cbefacea42f914aa66bcab3f\
        2b9819a8a5b46b395bd54a9a20441e2b62974e1f5a6292a2977014bd1e3deae63aeebb21694915e4";
    /// `{client} send alert record`: close_notify at sequence 1.
    const CLIENT_ALERT_RECORD: &str = "1703030013c9872760655666b74d7ff1153efd6db6d0b0e3";
    /// `{server} send application_data record`: the same bytes at sequence 1 (the
    /// server's NewSessionTicket took sequence 0).
    const SERVER_DATA_RECORD: &str = "17030300432e937e11ef4ac740e538ad36005fc4a46932fc3225d05f82aa1b36\
        e30efaf97d90e6dffc602dcb501a59a8fcc49c4bf2e5f0a21c0047c2abf332540dd032e167c2955d";

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
    }

    struct NoUpdates;

    impl KeySchedule for NoUpdates {
        fn next_tx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
            Err(rustls::Error::General("no key updates here".into()))
        }
        fn next_rx(&mut self) -> Result<ConnectionTrafficSecrets, rustls::Error> {
            Err(rustls::Error::General("no key updates here".into()))
        }
    }

    /// The key and IV of a traffic secret, checked against the RFC's.
    fn traffic(secret: &str, (key, iv): (&str, &str)) -> ConnectionTrafficSecrets {
        let suite = TLS13_AES_128_GCM_SHA256.tls13().expect("a TLS 1.3 suite");
        let expander = suite.hkdf_provider.expander_for_okm(&OkmBlock::new(&hex(secret)));
        let derived_key = rustls::internal::derive_traffic_key(expander.as_ref(), suite.aead_alg);
        let derived_iv = rustls::internal::derive_traffic_iv(expander.as_ref());
        assert_eq!(derived_key.as_ref(), hex(key));
        assert_eq!(derived_iv.as_ref(), hex(iv));
        ConnectionTrafficSecrets::Aes128Gcm { key: derived_key, iv: derived_iv }
    }

    /// A stream over `wire` sending with `tx` and receiving with `rx` from the given
    /// sequence numbers.
    fn stream(
        wire: Vec<u8>,
        tx: (u64, ConnectionTrafficSecrets),
        rx: (u64, ConnectionTrafficSecrets),
    ) -> Stream<futures::io::Cursor<Vec<u8>>> {
        let incoming = vec![0u8; READ_BUFFER].into_boxed_slice();
        let secrets = ExtractedSecrets { tx, rx };
        let io = futures::io::Cursor::new(wire);
        Stream::new(io, TLS13_AES_128_GCM_SHA256, secrets, Box::new(NoUpdates), incoming, 0, Vec::new())
            .expect("a TLS 1.3 suite")
    }

    /// The record layer reproduces RFC 8448's records byte for byte: framing, inner
    /// content type, nonce (IV ⊕ sequence number) and AEAD additional data.
    #[test]
    fn records_match_rfc_8448() {
        futures::executor::block_on(async {
            let payload: Vec<u8> = (0..0x32).collect();
            let client = || traffic(CLIENT_SECRET, CLIENT_KEY_IV);
            let server = || traffic(SERVER_SECRET, SERVER_KEY_IV);

            // the client seals the application data and then close_notify
            let mut ours = stream(Vec::new(), (0, client()), (0, server()));
            ours.write_all(&payload).await.expect("write");
            ours.flush().await.expect("flush");
            assert_eq!(ours.io_mut().get_ref(), &hex(CLIENT_DATA_RECORD));
            ours.close().await.expect("close");
            let wire = ours.io_mut().get_ref().clone();
            assert_eq!(&wire[hex(CLIENT_DATA_RECORD).len()..], &hex(CLIENT_ALERT_RECORD)[..]);

            // the server opens them: the data, then a clean end
            let mut server_side = stream(wire, (1, server()), (0, client()));
            let mut got = Vec::new();
            server_side.read_to_end(&mut got).await.expect("a clean close_notify");
            assert_eq!(got, payload);

            // the client opens the server's record at sequence 1
            let mut ours = stream(hex(SERVER_DATA_RECORD), (1, client()), (1, server()));
            let mut got = vec![0; payload.len()];
            ours.read_exact(&mut got).await.expect("read");
            assert_eq!(got, payload);

            // one flipped bit anywhere in the record is refused
            for at in [0, 4, 5, 40, 71] {
                let mut bad = hex(SERVER_DATA_RECORD);
                bad[at] ^= 1;
                let mut ours = stream(bad, (1, client()), (1, server()));
                assert!(ours.read(&mut got).await.is_err(), "a record with byte {at} flipped was accepted");
            }
        });
    }
}
