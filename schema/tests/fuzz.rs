//! Stable-Rust fuzzing of every wire decoder: arbitrary bytes, and valid encodings
//! with bytes overwritten, never panic, and whatever decodes re-encodes to bytes
//! that decode again. 4,096 cases of each test in CI (under a second; see the
//! time budget in docs/threat-model.md).

use pcp_schema::{
    AcceptEntry, Accepts, Ack, BlobRequest, BlobResponse, BlobWant, Contribution, EnvelopeHeader, FrameHead, Heartbeat,
    Message, MessageKind, NodeHello, RoundAnnouncement, RunManifest, ScreenReport, ScreenRequest, ShardFailure,
    ShardVote, SignedEnvelope, Slice, SliceReportEntry, SliceReports,
};
use proptest::collection::vec;
use proptest::prelude::*;

/// Decodes `bytes` as `M`; what decodes must survive its own round trip.
fn survives<M: Message>(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(m) = M::decode(bytes) {
        let again = m.encode();
        prop_assert!(M::decode(&again).is_ok(), "{} decoded, re-encoded, and no longer decodes", M::NAME);
    }
    Ok(())
}

/// Every decoder on `bytes`.
fn every_decoder(bytes: &[u8]) -> Result<(), TestCaseError> {
    survives::<NodeHello>(bytes)?;
    survives::<RunManifest>(bytes)?;
    survives::<RoundAnnouncement>(bytes)?;
    survives::<Contribution>(bytes)?;
    survives::<Ack>(bytes)?;
    survives::<Heartbeat>(bytes)?;
    survives::<BlobRequest>(bytes)?;
    survives::<BlobResponse>(bytes)?;
    survives::<SignedEnvelope>(bytes)?;
    survives::<FrameHead>(bytes)?;
    survives::<Slice>(bytes)?;
    survives::<SliceReports>(bytes)?;
    survives::<Accepts>(bytes)?;
    survives::<ShardVote>(bytes)?;
    survives::<ScreenRequest>(bytes)?;
    survives::<ScreenReport>(bytes)?;
    let _ = BlobResponse::chunk_range(bytes);
    Ok(())
}

/// Valid encodings of each message kind, to mutate.
fn seeds() -> Vec<Vec<u8>> {
    let hello = NodeHello {
        peer: [1; 32],
        protocol_version: 2,
        agent: "pcp".into(),
        capabilities: Default::default(),
        certificate: vec![9; 136],
        pow_nonce: 5,
    };
    let envelope = SignedEnvelope {
        header: EnvelopeHeader {
            signer: [2; 32],
            kind: MessageKind::Heartbeat,
            run: [3; 32],
            round: 4,
            nonce: 5,
            unix_ms: 6,
        },
        payload: Heartbeat { free_memory_bytes: 7, ..Heartbeat::new([3; 32], 4, 6) }.encode(),
        signature: [8; 64],
    };
    vec![
        hello.encode(),
        Ack::refuse([1; 32], 3, pcp_schema::AckCode::Late, "late").encode(),
        Heartbeat { free_memory_bytes: 10, ..Heartbeat::new([1; 32], 3, 9) }.encode(),
        BlobRequest { blob: [4; 32], want: BlobWant::Chunk(3) }.encode(),
        BlobResponse::Chunk(vec![7; 300]).encode(),
        envelope.encode(),
        head_of(&envelope).encode(),
        Slice { run: [1; 32], round: 2, shard: 3, worker: [4; 32], bytes: vec![5; 64] }.encode(),
        SliceReports {
            run: [1; 32],
            round: 2,
            reports: vec![SliceReportEntry {
                shard: 3,
                worker: [4; 32],
                hash: [5; 32],
                norms: vec![1.0, 2.0],
                maxes: vec![0.5, 0.25],
                bounded_norm: 2.2,
            }],
        }
        .encode(),
        Accepts {
            run: [1; 32],
            round: 2,
            entries: vec![AcceptEntry {
                worker: [4; 32],
                seq: 0,
                weight: 1.0,
                norm: 2.0,
                bound: 3.0,
                hashes: vec![(3, [5; 32])],
            }],
            closed: Some(1),
        }
        .encode(),
        ShardVote { run: [1; 32], round: 2, shard: 3, outcome: Err(ShardFailure::Missing) }.encode(),
        ScreenRequest {
            run: [1; 32],
            round: 2,
            contribution: [3; 32],
            contribution_round: 1,
            params_hash: [4; 32],
            delta: vec![5; 40],
            tensor_bounds: vec![1.0, f64::INFINITY],
            element_bounds: vec![0.5],
            bound_scale: 1.0,
            outer_scale: 0.7,
            rows: 2,
            windows: vec![7; 10],
            slices: Some(([6; 32], vec![[8; 32], [9; 32]])),
            holders: vec![vec![[10; 32], [11; 32]], vec![[12; 32]]],
        }
        .encode(),
        ScreenReport { run: [1; 32], round: 2, contribution: [3; 32], before: 2.0, after: 1.9, reversed: 2.1 }.encode(),
    ]
}

/// The head of `envelope`: its fields without the payload, as the RPC codec sends it.
fn head_of(envelope: &SignedEnvelope) -> FrameHead {
    FrameHead {
        header: envelope.header,
        payload_len: envelope.payload.len() as u64,
        payload_hash: [9; 32],
        signature: envelope.signature,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn arbitrary_bytes_never_panic_a_decoder(bytes in vec(any::<u8>(), 0..2048)) {
        every_decoder(&bytes)?;
    }

    #[test]
    fn overwritten_bytes_in_valid_messages_never_panic_a_decoder(
        pick in any::<prop::sample::Index>(),
        edits in vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let seeds = seeds();
        let mut bytes = pick.get(&seeds).clone();
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        every_decoder(&bytes)?;
    }
}
