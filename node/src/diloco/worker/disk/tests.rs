use super::*;
use pcp_protocol::diloco::Tensors;

/// M1: a worker keeps the highest term and the chain it followed across a
/// restart, so a stale leader's announcements stay refused and it never trains a
/// round it already trained from other parameters.
#[test]
fn the_followed_chain_survives_a_restart_and_damage_is_ignored() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = chain_path(dir.path(), RunId([3; 32]));
    assert_eq!(load_chain(&path), Chain::default(), "nothing saved: a joiner");
    let mut chain = Chain::default();
    chain.follow(4, 17, [9; 32]);
    save_chain(&path, &chain).expect("saves");
    let back = load_chain(&path);
    assert_eq!(back, chain);
    assert!(back.admits(4, 16, &[1; 32]).is_err(), "an older round stays refused after the restart");
    assert!(back.admits(5, 17, &[8; 32]).is_err(), "the same round from other parameters too");
    std::fs::write(&path, b"{\"term\": 1}").expect("writes");
    assert_eq!(load_chain(&path), Chain::default(), "a damaged file is ignored, not fatal");
}

/// A worker keeps the highest term it has seen (a lease, whether or not it
/// trained a round of it); a damaged or oversized file reads as none.
#[test]
fn the_highest_term_seen_survives_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = term_path(dir.path(), RunId([3; 32]));
    assert_eq!(load_term(&path), 0, "nothing saved");
    save_term(&path, 7).expect("saves");
    assert_eq!(load_term(&path), 7);
    std::fs::write(&path, b"not json").expect("writes");
    assert_eq!(load_term(&path), 0, "damage is ignored");
    std::fs::write(&path, vec![b' '; 5000]).expect("writes");
    assert_eq!(load_term(&path), 0, "an oversized file is not read");
}

#[test]
fn the_error_feedback_survives_a_restart_and_damage_is_ignored() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run = RunId([9; 32]);
    let path = feedback_path(dir.path(), run);
    let settings = Settings::default();
    // nothing saved yet: zeros
    let mut ef = load_feedback(&path, &[100, 3], settings);
    assert_eq!(ef.buffer, vec![vec![0.0; 100], vec![0.0; 3]]);
    let delta: Tensors = vec![(0..100).map(|i| i as f32 * 0.01 - 0.3).collect(), vec![0.5, -0.25, 1.0]];
    ef.compress_seeded(&delta, 1.0, 1);
    save_feedback(&path, &ef).expect("saves");
    let back = load_feedback(&path, &[100, 3], settings);
    assert_eq!(back.buffer, ef.buffer, "what was not sent survives the restart");
    assert!(back.buffer.iter().flatten().any(|v| *v != 0.0));
    // another run's shapes, or a damaged file: a fresh buffer, not a crash
    assert_eq!(load_feedback(&path, &[99, 3], settings).buffer, vec![vec![0.0; 99], vec![0.0; 3]]);
    std::fs::write(&path, b"junk").expect("writes");
    assert_eq!(load_feedback(&path, &[100, 3], settings).buffer, vec![vec![0.0; 100], vec![0.0; 3]]);
}
