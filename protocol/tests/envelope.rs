//! Signing, verification and replay refusal of envelopes.

use pcp_protocol::{
    Binding, BlobHash, Identity, OpenError, PayloadError, ReplayError, ReplayGuard, RunId, head_of, open, seal,
    verify_head,
};
use pcp_schema::{Heartbeat, Message, NodeHello, SignedEnvelope};
use proptest::prelude::*;
use rand::{RngCore, SeedableRng, rngs::StdRng};

fn identity(rng: &mut StdRng) -> Identity {
    let mut secret = [0u8; 32];
    rng.fill_bytes(&mut secret);
    Identity::from_secret(secret)
}

fn heartbeat(run: RunId) -> Heartbeat {
    Heartbeat { free_memory_bytes: 1 << 30, ..Heartbeat::new(run.0, 3, 1_000) }
}

fn binding(run: RunId, nonce: u64, unix_ms: u64) -> Binding {
    Binding { run, round: 3, nonce, unix_ms }
}

#[test]
fn sealed_envelope_opens_and_decodes() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(1);
    let me = identity(&mut rng);
    let run = RunId(*BlobHash::of(b"run").as_bytes());
    let bytes = seal(&me, binding(run, 7, 1_000), &heartbeat(run)).encode();
    let v = open(&bytes)?;
    assert_eq!(v.signer(), me.public());
    assert_eq!(v.binding(), binding(run, 7, 1_000));
    assert_eq!(v.decode::<Heartbeat>()?, heartbeat(run));
    assert!(matches!(v.decode::<NodeHello>(), Err(PayloadError::WrongKind { .. })));
    Ok(())
}

#[test]
fn tampered_payload_header_or_signer_is_refused() {
    let mut rng = StdRng::seed_from_u64(2);
    let me = identity(&mut rng);
    let other = identity(&mut rng);
    let run = RunId([1; 32]);
    let good = seal(&me, binding(run, 1, 1_000), &heartbeat(run));

    let mut payload = good.clone();
    payload.payload[20] ^= 1;
    let mut round = good.clone();
    round.header.round += 1;
    let mut kind = good.clone();
    kind.header.kind = pcp_schema::MessageKind::NodeHello;
    // claims to be signed by `other` but was signed by `me`
    let mut signer = good.clone();
    signer.header.signer = other.public().0;
    let mut sig = good.clone();
    sig.signature[0] ^= 0x80;

    for (name, bad) in [("payload", payload), ("round", round), ("kind", kind), ("signer", signer), ("signature", sig)]
    {
        let result = open(&bad.encode());
        assert!(
            matches!(result, Err(OpenError::BadSignature { .. } | OpenError::InvalidKey { .. })),
            "tampered {name} was accepted: {result:?}"
        );
    }
}

/// A frame head verifies on its own, with the envelope's signature, and names the
/// payload it announces; any change to it fails.
#[test]
fn a_frame_head_verifies_before_its_payload_arrives() {
    let mut rng = StdRng::seed_from_u64(3);
    let me = identity(&mut rng);
    let run = RunId([4; 32]);
    let envelope = seal(&me, binding(run, 9, 2_000), &heartbeat(run));
    let head = head_of(&envelope);
    assert_eq!(verify_head(&head).ok(), Some(me.public()));
    assert_eq!(head.payload_len, envelope.payload.len() as u64);
    assert_eq!(head.clone().with_payload(envelope.payload.clone()), envelope);

    let mut len = head.clone();
    len.payload_hash[0] ^= 1;
    let mut kind = head.clone();
    kind.header.kind = pcp_schema::MessageKind::Contribution;
    let mut round = head.clone();
    round.header.round += 1;
    for (name, bad) in [("hash", len), ("kind", kind), ("round", round)] {
        assert!(verify_head(&bad).is_err(), "tampered {name} was accepted");
    }
}

#[test]
fn replays_stale_future_and_foreign_runs_are_refused() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(3);
    let me = identity(&mut rng);
    let run = RunId([1; 32]);
    let mut guard = ReplayGuard::new(30_000, 4, 16);
    let now = 100_000;
    let first = open(&seal(&me, binding(run, 1, now), &heartbeat(run)).encode())?;
    guard.check(&first, run, now)?;
    assert!(matches!(guard.check(&first, run, now + 1), Err(ReplayError::Replayed { nonce: 1, .. })));
    let stale = open(&seal(&me, binding(run, 2, now - 30_001), &heartbeat(run)).encode())?;
    assert!(matches!(guard.check(&stale, run, now), Err(ReplayError::Stale { .. })));
    let future = open(&seal(&me, binding(run, 3, now + 30_001), &heartbeat(run)).encode())?;
    assert!(matches!(guard.check(&future, run, now), Err(ReplayError::Future { .. })));
    assert!(matches!(guard.check(&first, RunId([2; 32]), now), Err(ReplayError::WrongRun { .. })));
    // the per-signer budget bounds memory; old entries are forgotten after the window
    for nonce in 10..13 {
        let m = open(&seal(&me, binding(run, nonce, now), &heartbeat(run)).encode())?;
        guard.check(&m, run, now)?;
    }
    let over = open(&seal(&me, binding(run, 20, now), &heartbeat(run)).encode())?;
    assert!(matches!(guard.check(&over, run, now), Err(ReplayError::Flooded { .. })));
    let later = now + 30_001;
    let fresh = open(&seal(&me, binding(run, 21, later), &heartbeat(run)).encode())?;
    guard.check(&fresh, run, later)?;
    assert_eq!(guard.len(), 1);
    Ok(())
}

/// L2: Sybils that fill the guard do not lock out a signer that comes after them,
/// and a signer the caller vouches for is never forgotten to make room.
#[test]
fn a_full_guard_forgets_the_least_recent_unknown_signer_not_a_known_one() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(4);
    let run = RunId([1; 32]);
    let mut guard = ReplayGuard::new(30_000, 4, 8);
    let now = 100_000;
    let worker = identity(&mut rng);
    let admitted = open(&seal(&worker, binding(run, 1, now), &heartbeat(run)).encode())?;
    guard.check_known(&admitted, run, now, true)?;
    for i in 0..20u64 {
        let sybil = identity(&mut rng);
        let m = open(&seal(&sybil, binding(run, 1, now), &heartbeat(run)).encode())?;
        guard.check(&m, run, now + i)?; // never Flooded: the oldest Sybil is forgotten
    }
    let newcomer = identity(&mut rng);
    let m = open(&seal(&newcomer, binding(run, 1, now), &heartbeat(run)).encode())?;
    guard.check(&m, run, now + 50)?;
    assert!(
        matches!(guard.check(&admitted, run, now + 60), Err(ReplayError::Replayed { .. })),
        "the admitted worker's nonces are still remembered"
    );
    Ok(())
}

/// L3: answers are checked for their run and age (nonces repeat: a leader answers
/// many heartbeats with the one announcement it signed).
#[test]
fn answers_are_checked_for_run_and_age() -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(5);
    let me = identity(&mut rng);
    let run = RunId([1; 32]);
    let guard = ReplayGuard::new(30_000, 4, 16);
    let now = 100_000;
    let answer = open(&seal(&me, binding(run, 1, now), &heartbeat(run)).encode())?;
    guard.fresh(&answer, run, now)?;
    guard.fresh(&answer, run, now + 1)?;
    guard.fresh(&answer, RunId([0; 32]), now)?;
    assert!(matches!(guard.fresh(&answer, RunId([2; 32]), now), Err(ReplayError::WrongRun { .. })));
    assert!(matches!(guard.fresh(&answer, run, now + 30_001), Err(ReplayError::Stale { .. })));
    Ok(())
}

proptest! {
    #[test]
    fn random_bytes_never_open(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        // random input must fail cleanly (no panic); a valid signature by chance is impossible
        prop_assert!(open(&bytes).is_err());
    }

    #[test]
    fn any_single_bit_flip_is_refused(seed in any::<u64>(), bit in any::<prop::sample::Index>()) {
        let mut rng = StdRng::seed_from_u64(seed);
        let me = identity(&mut rng);
        let run = RunId([9; 32]);
        let mut bytes = seal(&me, binding(run, seed, 5), &heartbeat(run)).encode();
        let i = bit.index(bytes.len() * 8);
        bytes[i / 8] ^= 1 << (i % 8);
        // a flip in padding or an unused pointer bit may leave the content unchanged
        if let Ok(v) = open(&bytes) {
            prop_assert_eq!(v.decode::<Heartbeat>().ok(), Some(heartbeat(run)));
        }
    }
}

#[test]
fn envelope_over_the_limit_is_refused_before_parsing() {
    let bytes = vec![0u8; SignedEnvelope::MAX_SIZE + 1];
    assert!(matches!(open(&bytes), Err(OpenError::Decode(pcp_schema::DecodeError::TooLarge { .. }))));
}
