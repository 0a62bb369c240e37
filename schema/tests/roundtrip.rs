//! Every wire message round-trips; hostile input fails cleanly and within its bounds.

use pcp_schema::{
    AcceptEntry, Accepts, ScreenReport, ScreenRequest, ShardAggregators, ShardFailure, ShardVote, Slice,
    SliceReportEntry, SliceReports,
};
use pcp_schema::{
    Ack, AckCode, Admission, ArtifactRef, Backend, BlobRequest, BlobResponse, BlobWant, CHUNK_SIZE, Capabilities,
    Consensus, ConsensusKind, Contribution, DataSpec, DecodeError, Heartbeat, Held, MAX_CONTROL_MESSAGE, Message,
    MessageKind, NodeHello, ParameterRef, RoundAnnouncement, RunManifest, Schedule, SignedEnvelope, TensorSpec, Update,
};
use pcp_schema::{EnvelopeHeader, FrameHead, MAX_CONTRIBUTION, MAX_FRAME_HEAD};
use proptest::collection::vec;
use proptest::prelude::*;

fn shard_aggregators() -> impl Strategy<Value = ShardAggregators> {
    let tensor = vec(prop_oneof![Just(f64::INFINITY), 0.0f64..1e6], 0..4);
    let element = vec(prop_oneof![Just(f32::INFINITY), 0.0f32..1e6], 0..4);
    (vec(any::<[u8; 32]>(), 0..4), proptest::option::of(any::<[u8; 32]>()), tensor, element).prop_map(
        |(replicas, auditor, tensor_bounds, element_bounds)| ShardAggregators {
            replicas,
            auditor,
            tensor_bounds,
            element_bounds,
        },
    )
}

fn slice_report() -> impl Strategy<Value = SliceReportEntry> {
    (any::<u32>(), any::<[u8; 32]>(), any::<[u8; 32]>(), vec((any::<f64>(), any::<f32>()), 0..5), any::<f64>())
        .prop_map(|(shard, worker, hash, stats, bounded_norm)| SliceReportEntry {
            shard,
            worker,
            hash,
            norms: stats.iter().map(|s| s.0).collect(),
            maxes: stats.iter().map(|s| s.1).collect(),
            bounded_norm,
        })
}

fn accept_entry() -> impl Strategy<Value = AcceptEntry> {
    (
        any::<[u8; 32]>(),
        any::<u64>(),
        (any::<f64>(), any::<f64>(), any::<f64>()),
        vec((any::<u32>(), any::<[u8; 32]>()), 0..4),
    )
        .prop_map(|(worker, seq, (weight, norm, bound), hashes)| AcceptEntry {
            worker,
            seq,
            weight,
            norm,
            bound,
            hashes,
        })
}

fn text() -> impl Strategy<Value = String> {
    "\\PC{0,24}"
}

fn backend() -> impl Strategy<Value = Backend> {
    (text(), vec(text(), 0..4)).prop_map(|(name, targets)| Backend { name, targets })
}

fn capabilities() -> impl Strategy<Value = Capabilities> {
    (vec(backend(), 0..4), any::<u64>(), any::<bool>())
        .prop_map(|(backends, free_memory_bytes, aggregate)| Capabilities { backends, free_memory_bytes, aggregate })
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
    (text(), text(), any::<[u8; 32]>(), any::<u64>(), any::<u32>(), text(), any::<u64>()).prop_map(
        |(backend, target, blob, size, micro_batches, recompute, estimate_bytes)| ArtifactRef {
            backend,
            target,
            blob,
            size,
            micro_batches,
            recompute,
            estimate_bytes,
        },
    )
}

fn tensor() -> impl Strategy<Value = TensorSpec> {
    (text(), vec(any::<u64>(), 0..4)).prop_map(|(name, shape)| TensorSpec { name, shape })
}

fn data_spec() -> impl Strategy<Value = DataSpec> {
    (any::<[u8; 32]>(), any::<u64>(), text(), any::<f64>(), any::<u32>(), any::<u32>(), any::<bool>()).prop_map(
        |(blob, size, tokenizer, val_fraction, batch, block, int64)| DataSpec {
            blob,
            size,
            tokenizer,
            val_fraction,
            batch,
            block,
            int64,
        },
    )
}

fn schedule() -> impl Strategy<Value = Schedule> {
    (any::<f64>(), any::<f64>(), any::<u64>(), any::<u64>()).prop_map(
        |(learning_rate, min_lr, warmup_steps, total_steps)| Schedule {
            learning_rate,
            min_lr,
            warmup_steps,
            total_steps,
        },
    )
}

/// A manifest with every field set from the strategies' values.
fn manifest(
    (run, name, shepherd, inner_steps): ([u8; 32], String, [u8; 32], u32),
    (artifacts, parameters, model_hash): (Vec<ArtifactRef>, Vec<ParameterRef>, [u8; 32]),
    (rounds, seed, schedule, outer_lr, outer_momentum): (u64, u64, Schedule, f32, f32),
    (data, tensors, state_per_param, encoding): (DataSpec, Vec<TensorSpec>, u32, String),
    (screen, trim, overlap, fragments): (String, f32, bool, u32),
    (candidates, lease_ms, salt, experiment): (Vec<[u8; 32]>, u64, [u8; 32], [u8; 32]),
) -> RunManifest {
    let allowlist: Vec<[u8; 32]> = candidates.iter().rev().copied().collect();
    RunManifest {
        run,
        name,
        shepherd,
        inner_steps,
        artifacts,
        parameters,
        model_hash,
        rounds,
        seed,
        schedule,
        outer_lr,
        outer_momentum,
        data,
        tensors,
        state_per_param,
        encoding,
        screen,
        trim,
        candidates,
        lease_ms,
        failover: 1,
        salt,
        experiment,
        overlap,
        fragments,
        precision: ["f32", "bf16"][(fragments % 2) as usize].to_owned(),
        recompute: ["none", "attention", "blocks"][(fragments % 3) as usize].to_owned(),
        admission: Admission {
            admit: ["open", "allowlist", "authorizer"][(fragments % 3) as usize].to_owned(),
            authorizer: salt,
            allowlist,
            pow_bits: fragments % 33,
            pow_joins_per_hour: lease_ms as u32,
            max_participants: state_per_param,
            aggregate_max: inner_steps,
            probation_rounds: fragments,
            screen_sample: trim,
            aggregator_spot_rate: trim / 2.0,
            screeners: inner_steps / 2,
            screen_spot_rate: trim / 3.0,
        },
    }
}

/// Equality that treats NaN as equal to itself (floats in the manifest are arbitrary bits).
fn same_bits<M: std::fmt::Debug>(a: &M, b: &M) -> bool {
    format!("{a:?}") == format!("{b:?}")
}

fn roundtrip<M: Message + PartialEq + std::fmt::Debug>(m: &M) -> Result<(), TestCaseError> {
    let bytes = m.encode();
    prop_assert!(bytes.len() <= M::MAX_SIZE);
    let back = M::decode(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(back == *m || same_bits(&back, m), "{:?} != {:?}", back, m);
    // every strict prefix is refused (truncation) without panicking
    for cut in [0, 1, 7, 8, bytes.len() / 2, bytes.len() - 1] {
        prop_assert!(M::decode(&bytes[..cut.min(bytes.len() - 1)]).is_err());
    }
    Ok(())
}

proptest! {
    #[test]
    fn node_hello(
        peer in any::<[u8; 32]>(), v in any::<u32>(), agent in text(), c in capabilities(),
        certificate in vec(any::<u8>(), 0..200), pow_nonce in any::<u64>(),
    ) {
        roundtrip(&NodeHello { peer, protocol_version: v, agent, capabilities: c, certificate, pow_nonce })?;
    }

    #[test]
    fn run_manifest(
        head in (any::<[u8; 32]>(), text(), any::<[u8; 32]>(), any::<u32>()),
        refs in (vec(artifact(), 0..4), vec(parameter(), 0..4), any::<[u8; 32]>()),
        hyper in (any::<u64>(), any::<u64>(), schedule(), any::<f32>(), any::<f32>()),
        shape in (data_spec(), vec(tensor(), 0..4), any::<u32>(), text()),
        robust in (text(), any::<f32>(), any::<bool>(), any::<u32>()),
        election in (vec(any::<[u8; 32]>(), 0..4), any::<u64>(), any::<[u8; 32]>(), any::<[u8; 32]>()),
    ) {
        roundtrip(&manifest(head, refs, hyper, shape, robust, election))?;
    }

    #[test]
    fn round_announcement(
        run in any::<[u8; 32]>(), round in any::<u64>(), parameters in vec(parameter(), 0..4), d in any::<u64>(),
        participants in vec(any::<[u8; 32]>(), 0..8), finished in any::<bool>(), term in any::<u64>(),
        state in proptest::option::of(parameter()),
        update in proptest::option::of((parameter(), any::<[u8; 32]>())),
        (budget_ms, steps_end_unix_ms) in (any::<u64>(), any::<u64>()),
        (screen_commit, screen_reveal) in (any::<[u8; 32]>(), any::<[u8; 32]>()),
        participants_blob in proptest::option::of(parameter()),
        aggregators in vec(shard_aggregators(), 0..4),
    ) {
        let update = update.map(|(blob, base)| Update { blob, base });
        roundtrip(&RoundAnnouncement {
            run, round, parameters, deadline_unix_ms: d, participants, participants_blob, finished, term, state, update,
            budget_ms, steps_end_unix_ms, screen_commit, screen_reveal, aggregators,
        })?;
    }

    #[test]
    fn contribution(
        run in any::<[u8; 32]>(), round in any::<u64>(), inner_steps in any::<u32>(), samples in any::<u64>(),
        pseudo_gradient in parameter(), loss in any::<f32>(), delta in vec(any::<u8>(), 0..2048),
        bytes_down in any::<u64>(), term in any::<u64>(), params_hash in any::<[u8; 32]>(),
        (train_ms, wall_ms, sent_unix_ms) in (any::<u64>(), any::<u64>(), any::<u64>()),
        slice_hashes in vec(any::<[u8; 32]>(), 0..6),
    ) {
        roundtrip(&Contribution {
            run, round, inner_steps, samples, pseudo_gradient, loss, delta, bytes_down, term, params_hash, train_ms,
            wall_ms, sent_unix_ms, slice_hashes,
        })?;
    }

    #[test]
    fn slice(
        run in any::<[u8; 32]>(), round in any::<u64>(), shard in any::<u32>(), worker in any::<[u8; 32]>(),
        bytes in vec(any::<u8>(), 0..2048), past_a_segment in 0usize..3,
    ) {
        // past the first segment (8 KiB) and well past it
        let mut bytes = bytes;
        bytes.resize(bytes.len() + [0, 9 << 10, 300 << 10][past_a_segment], 5);
        let len = bytes.len();
        let slice = Slice { run, round, shard, worker, bytes };
        let bound = Slice::encoded_len(len);
        prop_assert!(slice.encode().len() <= bound && bound <= slice.encode().len() + 96, "{} of {bound}", slice.encode().len());
        roundtrip(&slice)?;
    }

    #[test]
    fn slice_reports(run in any::<[u8; 32]>(), round in any::<u64>(), reports in vec(slice_report(), 0..6)) {
        roundtrip(&SliceReports { run, round, reports })?;
    }

    #[test]
    fn accepts(
        run in any::<[u8; 32]>(), round in any::<u64>(), entries in vec(accept_entry(), 0..6),
        closed in proptest::option::of(any::<u64>()),
    ) {
        roundtrip(&Accepts { run, round, entries, closed })?;
    }

    #[test]
    fn shard_vote(
        run in any::<[u8; 32]>(), round in any::<u64>(), shard in any::<u32>(),
        outcome in prop_oneof![
            (any::<[u8; 32]>(), parameter()).prop_map(Ok),
            proptest::sample::select(vec![ShardFailure::Missing, ShardFailure::Duplicate, ShardFailure::PastClose])
                .prop_map(Err),
        ],
    ) {
        roundtrip(&ShardVote { run, round, shard, outcome })?;
    }

    #[test]
    fn screen_request(
        run in any::<[u8; 32]>(), round in any::<u64>(), contribution in any::<[u8; 32]>(),
        contribution_round in any::<u64>(), params_hash in any::<[u8; 32]>(), delta in vec(any::<u8>(), 0..256),
        tensor_bounds in vec(-1e30f64..1e30, 0..8), element_bounds in vec(-1e30f32..1e30, 0..8),
        bound_scale in -1e3f32..1e3, outer_scale in -1e3f32..1e3, rows in 1u32..5, width in 2usize..9,
        token in any::<u16>(), slices in proptest::option::of((any::<[u8; 32]>(), vec(any::<[u8; 32]>(), 1..4))),
        held in 0usize..3, key in any::<u8>(),
    ) {
        let windows = (0..rows as usize * width).map(|i| token.wrapping_add(i as u16)).collect();
        // each shard's holders, when any: `held` keys a shard
        let shards = slices.as_ref().map_or(0, |(_, h)| h.len());
        let holders = if held == 0 { Vec::new() } else {
            (0..shards).map(|s| (0..held).map(|i| [key.wrapping_add((s * held + i) as u8); 32]).collect()).collect()
        };
        roundtrip(&ScreenRequest {
            run, round, contribution, contribution_round, params_hash, delta, tensor_bounds, element_bounds,
            bound_scale, outer_scale, rows, windows, slices, holders,
        })?;
    }

    #[test]
    fn screen_report(
        run in any::<[u8; 32]>(), round in any::<u64>(), contribution in any::<[u8; 32]>(),
        before in -1e30f32..1e30, after in -1e30f32..1e30, reversed in -1e30f32..1e30,
    ) {
        roundtrip(&ScreenReport { run, round, contribution, before, after, reversed })?;
    }

    #[test]
    fn ack(
        run in any::<[u8; 32]>(), round in any::<u64>(), accepted in any::<bool>(), reason in text(),
        code in proptest::sample::select(AckCode::ALL), pow_bits in any::<u8>(),
    ) {
        roundtrip(&Ack { run, round, accepted, reason, code, pow_bits })?;
    }

    #[test]
    fn heartbeat(
        run in any::<[u8; 32]>(), round in any::<u64>(), unix_ms in any::<u64>(), free in any::<u64>(),
        term in any::<u64>(), follows in any::<u64>(),
        held in proptest::option::of((any::<u64>(), any::<u64>(), any::<[u8; 32]>())),
        consensus in proptest::option::of((0..4u8, any::<u64>(), any::<bool>(), any::<bool>(), any::<[u8; 32]>())),
        known in proptest::option::of(any::<[u8; 32]>()), deadline_unix_ms in any::<u64>(),
    ) {
        let held = held.map(|(term, round, params)| Held { term, round, params });
        let consensus = consensus.map(|(k, sent_ms, granted, pre, blob)| Consensus {
            kind: [ConsensusKind::Lease, ConsensusKind::Answer, ConsensusKind::VoteRequest, ConsensusKind::Vote][k as usize],
            sent_ms,
            granted,
            pre,
            blob,
        });
        roundtrip(&Heartbeat {
            run,
            round,
            unix_ms,
            free_memory_bytes: free,
            term,
            follows,
            held,
            consensus,
            known,
            deadline_unix_ms,
        })?;
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
        let header = EnvelopeHeader { kind, signer, run, round, nonce, unix_ms };
        roundtrip(&SignedEnvelope { header, payload, signature })?;
    }

    #[test]
    fn frame_head(
        kind in prop::sample::select(MessageKind::ALL.to_vec()), signer in any::<[u8; 32]>(),
        run in any::<[u8; 32]>(), round in any::<u64>(), nonce in any::<u64>(), unix_ms in any::<u64>(),
        len in 0..=MAX_CONTROL_MESSAGE as u64, payload_hash in any::<[u8; 32]>(), sig in vec(any::<u8>(), 64),
    ) {
        let signature: [u8; 64] = sig.try_into().map_err(|_| TestCaseError::fail("len"))?;
        let header = EnvelopeHeader { kind, signer, run, round, nonce, unix_ms };
        let head = FrameHead { header, payload_len: len, payload_hash, signature };
        roundtrip(&head)?;
        prop_assert!(head.encode().len() <= MAX_FRAME_HEAD);
    }

    #[test]
    fn random_bytes_fail_cleanly(bytes in vec(any::<u8>(), 0..4096)) {
        let _ = FrameHead::decode(&bytes);
        // only checks that nothing panics or hangs; any result is allowed
        let _ = SignedEnvelope::decode(&bytes);
        let _ = NodeHello::decode(&bytes);
        let _ = RunManifest::decode(&bytes);
        let _ = RoundAnnouncement::decode(&bytes);
        let _ = Contribution::decode(&bytes);
        let _ = Ack::decode(&bytes);
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
fn a_manifest_without_precision_reads_as_f32() {
    let mut m = manifest(
        ([1; 32], "r".into(), [2; 32], 1),
        (vec![], vec![], [3; 32]),
        (1, 2, Schedule::default(), 0.7, 0.9),
        (DataSpec::default(), vec![], 2, "fp32".into()),
        ("score".into(), 0.25, true, 3),
        (vec![[4; 32]], 5_000, [5; 32], [6; 32]),
    );
    assert_eq!(RunManifest::decode(&m.encode()).expect("decodes").precision, "bf16");
    // a manifest from before the field leaves it unset
    m.precision = String::new();
    assert_eq!(RunManifest::decode(&m.encode()).expect("decodes").precision, "f32");
}

#[test]
fn list_claiming_more_elements_than_the_input_holds_is_refused() {
    let m = manifest(
        ([1; 32], "r".into(), [2; 32], 1),
        (vec![], vec![], [3; 32]),
        (1, 2, Schedule::default(), 0.7, 0.9),
        (DataSpec::default(), vec![], 2, "fp32".into()),
        ("score".into(), 0.25, true, 4),
        (vec![[4; 32]], 5_000, [5; 32], [6; 32]),
    );
    let mut bytes = m.encode();
    // layout: segment table, root pointer, the data words (the root pointer's bytes 4-5),
    // then the pointers run, name, shepherd, artifacts: artifacts is the fourth pointer
    let data_words = usize::from(u16::from_le_bytes([bytes[12], bytes[13]]));
    let at = 8 + (1 + data_words + 3) * 8;
    assert_eq!(bytes[at] & 3, 1, "expected a list pointer");
    // element size 7 (inline composite), word count 2^29 - 1: about 4 GiB claimed
    bytes[at + 4..at + 8].copy_from_slice(&[0xff; 4]);
    assert!(matches!(RunManifest::decode(&bytes), Err(DecodeError::Malformed { .. })));
}

#[test]
fn wrong_length_key_is_refused() {
    let m = Heartbeat::new([1; 32], 0, 0);
    let mut message = capnp::message::Builder::new_default();
    let mut root = message.init_root::<pcp_schema::wire::pcp_capnp::heartbeat::Builder<'_>>();
    root.set_run(&m.run[..31]);
    let bytes = capnp::serialize::write_message_to_words(&message);
    assert!(matches!(
        Heartbeat::decode(&bytes),
        Err(DecodeError::FieldLength { field: "run", expected: 32, got: 31, .. })
    ));
}

#[test]
fn only_contributions_slices_and_screen_requests_may_carry_large_payloads() {
    let envelope = |kind| SignedEnvelope {
        header: EnvelopeHeader { kind, signer: [1; 32], run: [2; 32], round: 3, nonce: 4, unix_ms: 5 },
        payload: vec![7; MAX_CONTROL_MESSAGE + 1],
        signature: [6; 64],
    };
    let large = [MessageKind::Contribution, MessageKind::Slice, MessageKind::ScreenRequest];
    for kind in large {
        let big = envelope(kind);
        assert_eq!(SignedEnvelope::decode(&big.encode()).ok(), Some(big));
    }
    for kind in MessageKind::ALL.into_iter().filter(|k| !large.contains(k)) {
        let err = SignedEnvelope::decode(&envelope(kind).encode()).err();
        assert!(matches!(err, Some(DecodeError::TooLarge { .. })), "{kind:?}: {err:?}");
    }
}

#[test]
fn a_slice_report_with_unpaired_statistics_is_refused() {
    let entry = SliceReportEntry {
        shard: 1,
        worker: [2; 32],
        hash: [3; 32],
        norms: vec![1.0, 2.0],
        maxes: vec![1.0, 2.0],
        bounded_norm: 1.5,
    };
    let good = SliceReports { run: [4; 32], round: 5, reports: vec![entry.clone()] };
    assert_eq!(SliceReports::decode(&good.encode()).ok(), Some(good));
    let bad = SliceReports { run: [4; 32], round: 5, reports: vec![SliceReportEntry { maxes: vec![1.0], ..entry }] };
    let err = SliceReports::decode(&bad.encode()).err();
    assert!(matches!(err, Some(DecodeError::Invalid { field: "reports", .. })), "{err:?}");
}

#[test]
fn a_frame_head_claiming_more_than_its_kind_allows_is_refused() {
    let head = |kind, payload_len| FrameHead {
        header: EnvelopeHeader { kind, signer: [1; 32], run: [2; 32], round: 3, nonce: 4, unix_ms: 5 },
        payload_len,
        payload_hash: [6; 32],
        signature: [7; 64],
    };
    let ok = head(MessageKind::Heartbeat, MAX_CONTROL_MESSAGE as u64);
    assert_eq!(FrameHead::decode(&ok.encode()).ok(), Some(ok));
    let err = FrameHead::decode(&head(MessageKind::Heartbeat, MAX_CONTROL_MESSAGE as u64 + 1).encode()).err();
    assert!(err.is_some_and(|e| e.to_string().contains("exceed heartbeat's limit")));
    let big = head(MessageKind::Contribution, MAX_CONTRIBUTION as u64);
    assert!(FrameHead::decode(&big.encode()).is_ok());
    assert!(FrameHead::decode(&head(MessageKind::Contribution, u64::MAX).encode()).is_err());
}

#[test]
fn a_screen_request_whose_holders_do_not_match_its_slices_is_refused() {
    let good = ScreenRequest {
        run: [1; 32],
        round: 2,
        contribution: [3; 32],
        contribution_round: 2,
        params_hash: [4; 32],
        delta: Vec::new(),
        tensor_bounds: vec![1.0],
        element_bounds: vec![1.0],
        bound_scale: 1.0,
        outer_scale: 1.0,
        rows: 1,
        windows: vec![1, 2],
        slices: Some(([5; 32], vec![[6; 32], [7; 32]])),
        holders: vec![vec![[8; 32]], vec![[9; 32], [10; 32]]],
    };
    assert_eq!(ScreenRequest::decode(&good.encode()).ok(), Some(good.clone()));
    let short = ScreenRequest { holders: vec![vec![[8; 32]]], ..good.clone() };
    let err = ScreenRequest::decode(&short.encode()).err();
    assert!(matches!(err, Some(DecodeError::Invalid { field: "sliceHolders", .. })), "{err:?}");
    let crowded = ScreenRequest { holders: vec![vec![[8; 32]; pcp_schema::MAX_HOLDERS + 1], vec![]], ..good };
    let err = ScreenRequest::decode(&crowded.encode()).err();
    assert!(matches!(err, Some(DecodeError::Invalid { field: "sliceHolders", .. })), "{err:?}");
}
