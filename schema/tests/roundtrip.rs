//! Every wire message round-trips; hostile input fails cleanly and within its bounds.

use pcp_schema::{
    ArtifactRef, Backend, BlobRequest, BlobResponse, BlobWant, CHUNK_SIZE, Capabilities, Contribution, DecodeError,
    Heartbeat, Message, MessageKind, NodeHello, ParameterRef, RoundAnnouncement, RunManifest, SignedEnvelope,
};
use proptest::collection::vec;
use proptest::prelude::*;

fn text() -> impl Strategy<Value = String> {
    "\\PC{0,24}"
}

fn backend() -> impl Strategy<Value = Backend> {
    (text(), vec(text(), 0..4)).prop_map(|(name, targets)| Backend { name, targets })
}

fn capabilities() -> impl Strategy<Value = Capabilities> {
    (vec(backend(), 0..4), any::<u64>())
        .prop_map(|(backends, free_memory_bytes)| Capabilities { backends, free_memory_bytes })
}

fn parameter() -> impl Strategy<Value = ParameterRef> {
    (text(), any::<u32>(), any::<[u8; 32]>(), any::<u64>()).prop_map(|(name, shard, blob, size)| ParameterRef {
        name,
        shard,
        blob,
        size,
    })
}

fn artifact() -> impl Strategy<Value = ArtifactRef> {
    (text(), text(), any::<[u8; 32]>(), any::<u64>()).prop_map(|(backend, target, blob, size)| ArtifactRef {
        backend,
        target,
        blob,
        size,
    })
}

fn roundtrip<M: Message + PartialEq + std::fmt::Debug>(m: &M) -> Result<(), TestCaseError> {
    let bytes = m.encode();
    prop_assert!(bytes.len() <= M::MAX_SIZE);
    let back = M::decode(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(&back, m);
    // every strict prefix is refused (truncation) without panicking
    for cut in [0, 1, 7, 8, bytes.len() / 2, bytes.len() - 1] {
        prop_assert!(M::decode(&bytes[..cut.min(bytes.len() - 1)]).is_err());
    }
    Ok(())
}

proptest! {
    #[test]
    fn node_hello(peer in any::<[u8; 32]>(), v in any::<u32>(), agent in text(), c in capabilities()) {
        roundtrip(&NodeHello { peer, protocol_version: v, agent, capabilities: c })?;
    }

    #[test]
    fn run_manifest(
        run in any::<[u8; 32]>(), name in text(), shepherd in any::<[u8; 32]>(),
        inner_steps in any::<u32>(), artifacts in vec(artifact(), 0..4), parameters in vec(parameter(), 0..4),
    ) {
        roundtrip(&RunManifest { run, name, shepherd, inner_steps, artifacts, parameters })?;
    }

    #[test]
    fn round_announcement(
        run in any::<[u8; 32]>(), round in any::<u64>(), parameters in vec(parameter(), 0..4), d in any::<u64>(),
    ) {
        roundtrip(&RoundAnnouncement { run, round, parameters, deadline_unix_ms: d })?;
    }

    #[test]
    fn contribution(
        run in any::<[u8; 32]>(), round in any::<u64>(), inner_steps in any::<u32>(), samples in any::<u64>(),
        pseudo_gradient in parameter(),
    ) {
        roundtrip(&Contribution { run, round, inner_steps, samples, pseudo_gradient })?;
    }

    #[test]
    fn heartbeat(run in any::<[u8; 32]>(), round in any::<u64>(), unix_ms in any::<u64>(), free in any::<u64>()) {
        roundtrip(&Heartbeat { run, round, unix_ms, free_memory_bytes: free })?;
    }

    #[test]
    fn blob_request(blob in any::<[u8; 32]>(), chunk in proptest::option::of(any::<u32>())) {
        let want = chunk.map_or(BlobWant::Outboard, BlobWant::Chunk);
        roundtrip(&BlobRequest { blob, want })?;
    }

    #[test]
    fn blob_response_outboard(chunks in 1u64..64, tail in 0u64..(CHUNK_SIZE as u64)) {
        let size = (chunks - 1) * CHUNK_SIZE as u64 + tail;
        let n = pcp_schema::chunk_count(size) as usize;
        let chunk_cvs = (0..n).map(|i| [i as u8; 32]).collect();
        roundtrip(&BlobResponse::Outboard { size, chunk_cvs })?;
    }

    #[test]
    fn blob_response_other(data in vec(any::<u8>(), 0..4096), reason in text(), pick in 0u8..3) {
        let m = match pick {
            0 => BlobResponse::Chunk(data),
            1 => BlobResponse::NotFound,
            _ => BlobResponse::Refused(reason),
        };
        roundtrip(&m)?;
    }

    #[test]
    fn signed_envelope(
        kind in prop::sample::select(MessageKind::ALL.to_vec()), signer in any::<[u8; 32]>(),
        run in any::<[u8; 32]>(), round in any::<u64>(), nonce in any::<u64>(), unix_ms in any::<u64>(),
        payload in vec(any::<u8>(), 0..1024), sig in vec(any::<u8>(), 64),
    ) {
        let signature: [u8; 64] = sig.try_into().map_err(|_| TestCaseError::fail("len"))?;
        roundtrip(&SignedEnvelope { kind, signer, run, round, nonce, unix_ms, payload, signature })?;
    }

    #[test]
    fn random_bytes_fail_cleanly(bytes in vec(any::<u8>(), 0..4096)) {
        // only checks that nothing panics or hangs; any result is allowed
        let _ = SignedEnvelope::decode(&bytes);
        let _ = NodeHello::decode(&bytes);
        let _ = RunManifest::decode(&bytes);
        let _ = BlobRequest::decode(&bytes);
        let _ = BlobResponse::decode(&bytes);
    }
}

#[test]
fn oversized_input_is_refused_before_parsing() {
    let bytes = vec![0u8; BlobRequest::MAX_SIZE + 1];
    assert!(matches!(
        BlobRequest::decode(&bytes),
        Err(DecodeError::TooLarge { len, max, .. }) if len == max + 1
    ));
}

#[test]
fn claimed_huge_segment_is_refused_without_allocating_it() {
    // segment table: 1 segment of 0x1fff_ffff words (4 GiB), followed by 8 bytes
    let mut bytes = vec![0, 0, 0, 0, 0xff, 0xff, 0xff, 0x1f];
    bytes.extend_from_slice(&[0; 8]);
    let err = SignedEnvelope::decode(&bytes).err();
    assert!(matches!(err, Some(DecodeError::Malformed { .. })), "{err:?}");

    // 512 claimed segments: more than capnp accepts
    let bytes = [0xff, 0x01, 0, 0, 0, 0, 0, 0];
    assert!(SignedEnvelope::decode(&bytes).is_err());
}

#[test]
fn list_claiming_more_elements_than_the_input_holds_is_refused() {
    let m = RunManifest {
        run: [1; 32],
        name: "r".into(),
        shepherd: [2; 32],
        inner_steps: 1,
        artifacts: vec![],
        parameters: vec![],
    };
    let mut bytes = m.encode();
    // layout: segment table, root pointer, one data word, then the pointers run, name,
    // shepherd, artifacts: the artifacts list pointer is word 5 of the segment
    let at = 8 + 5 * 8;
    assert_eq!(bytes[at] & 3, 1, "expected a list pointer");
    // element size 7 (inline composite), word count 2^29 - 1: about 4 GiB claimed
    bytes[at + 4..at + 8].copy_from_slice(&[0xff; 4]);
    assert!(matches!(RunManifest::decode(&bytes), Err(DecodeError::Malformed { .. })));
}

#[test]
fn wrong_length_key_is_refused() {
    let m = Heartbeat { run: [1; 32], round: 0, unix_ms: 0, free_memory_bytes: 0 };
    let mut message = capnp::message::Builder::new_default();
    let mut root = message.init_root::<pcp_schema::wire::pcp_capnp::heartbeat::Builder<'_>>();
    root.set_run(&m.run[..31]);
    let bytes = capnp::serialize::write_message_to_words(&message);
    assert!(matches!(
        Heartbeat::decode(&bytes),
        Err(DecodeError::FieldLength { field: "run", expected: 32, got: 31, .. })
    ));
}
