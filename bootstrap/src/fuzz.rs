//! Stable-Rust fuzzing of the stream decoders a stranger reaches: the signed RPC
//! frame reader and the blob codec, on arbitrary bytes and on valid frames with
//! bytes overwritten. Neither panics, and the RPC reader never returns a message
//! other than the one that was signed; 2,048 cases each. (The TLS record reader's fuzz test is in
//! `tls::tests`, the capnp messages' in `schema/tests/fuzz.rs`.)

use std::sync::Arc;

use futures::executor::block_on;
use libp2p::request_response::Codec;
use pcp_protocol::{Binding, Identity, RunId, Verified, seal};
use pcp_schema::{BlobRequest, BlobResponse, BlobWant, Heartbeat, SignedEnvelope};
use proptest::collection::vec;
use proptest::prelude::*;

use crate::admission::Remote;
use crate::codec::{BlobCodec, CapnpCodec};
use crate::rpc::{Frame, RpcCodec};
use crate::{BLOB_PROTOCOL, RPC_PROTOCOL};

fn identity() -> Identity {
    Identity::from_secret([7; 32])
}

fn envelope() -> SignedEnvelope {
    let identity = identity();
    let binding = Binding { run: RunId([1; 32]), round: 2, nonce: 3, unix_ms: 4 };
    seal(
        &identity,
        binding,
        &Heartbeat {
            run: [1; 32],
            round: 2,
            unix_ms: 4,
            free_memory_bytes: 5,
            term: 0,
            follows: 0,
            held: None,
            consensus: None,
            known: None,
            deadline_unix_ms: 0,
        },
    )
}

/// A heartbeat request as the RPC codec writes it.
fn rpc_frame() -> Vec<u8> {
    let mut bytes = Vec::new();
    let mut io = futures::io::Cursor::new(&mut bytes);
    block_on(codec().write_request(&RPC_PROTOCOL, &mut io, Frame::Out(envelope()))).expect("writes to memory");
    bytes
}

/// A blob request and a chunk response as the blob codec writes them.
fn blob_frames() -> [Vec<u8>; 2] {
    let mut request = Vec::new();
    let want = BlobRequest { blob: [4; 32], want: BlobWant::Chunk(1) };
    let mut io = futures::io::Cursor::new(&mut request);
    block_on(CapnpCodec::<BlobRequest, BlobResponse>::default().write_request(&BLOB_PROTOCOL, &mut io, want))
        .expect("writes to memory");
    let mut response = Vec::new();
    let mut io = futures::io::Cursor::new(&mut response);
    let chunk = BlobResponse::Chunk((0..5000u32).map(|i| i as u8).collect());
    block_on(CapnpCodec::<BlobRequest, BlobResponse>::default().write_response(&BLOB_PROTOCOL, &mut io, chunk))
        .expect("writes to memory");
    [request, response]
}

fn overwrite(mut bytes: Vec<u8>, edits: &[(prop::sample::Index, u8)]) -> Vec<u8> {
    for (at, value) in edits {
        let i = at.index(bytes.len());
        bytes[i] = *value;
    }
    bytes
}

/// The RPC codec of a connection from the envelope's signer.
fn codec() -> RpcCodec {
    let peer = crate::ids::peer_of(&identity().public()).expect("a valid key");
    let addr = "/ip4/192.0.2.1/udp/1/quic-v1".parse().expect("a multiaddr");
    RpcCodec::on_connection(Arc::default(), Remote::new(peer, &addr))
}

/// Reads `bytes` as an RPC request and, separately, as an RPC response: the envelopes
/// that verify.
fn read_rpc(bytes: &[u8]) -> (Option<Verified>, Option<Verified>) {
    let mut codec = codec();
    let verified = |frame: std::io::Result<Frame>| match frame {
        Ok(Frame::In(verified) | Frame::Request(verified, _)) => Some(verified),
        _ => None,
    };
    let request = verified(block_on(codec.read_request(&RPC_PROTOCOL, &mut &bytes[..])));
    let response = verified(block_on(codec.read_response(&RPC_PROTOCOL, &mut &bytes[..])));
    (request, response)
}

fn read_blob(bytes: &[u8]) {
    let _ = block_on(BlobCodec.read_request(&BLOB_PROTOCOL, &mut &bytes[..]));
    let _ = block_on(BlobCodec.read_response(&BLOB_PROTOCOL, &mut &bytes[..]));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn arbitrary_bytes_never_pass_the_rpc_reader(bytes in vec(any::<u8>(), 0..4096)) {
        let (request, response) = read_rpc(&bytes);
        // an arbitrary frame would need a valid ed25519 signature
        prop_assert!(request.is_none() && response.is_none());
        read_blob(&bytes);
    }

    #[test]
    fn an_overwritten_rpc_frame_is_refused_or_reads_as_the_signed_message(
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let bytes = overwrite(rpc_frame(), &edits);
        let (request, response) = read_rpc(&bytes);
        // what reads at all is the signed message: only bytes no field depends on
        // (capnp padding) were overwritten
        let signed = pcp_protocol::verify(self::envelope()).expect("the signed message verifies");
        for verified in [request, response].into_iter().flatten() {
            prop_assert_eq!(verified.signer(), signed.signer());
            prop_assert_eq!(verified.binding(), signed.binding());
            prop_assert_eq!(verified.decode::<Heartbeat>().ok(), signed.decode::<Heartbeat>().ok());
        }
    }

    #[test]
    fn overwritten_blob_frames_never_panic_the_blob_codec(
        pick in any::<bool>(),
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let [request, response] = blob_frames();
        read_blob(&overwrite(if pick { request } else { response }, &edits));
    }
}
