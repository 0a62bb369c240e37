//! DiLoCo: workers run τ inner steps alone, then send their pseudo-gradient
//! θ_start − θ_end; the shepherd averages them and takes an outer Nesterov
//! step.
//!
//! * [`outer`]: the outer optimizer.
//! * [`aggregate`]: validating, bounding and averaging contributions.
//! * [`aggregation`]: parameter-shard aggregators: who sums which shard, the sum in the shepherd's order, and the replicas' votes.
//! * [`aggregator`]: an aggregator's state machine: its shards' slices, forwards, reports, sums and updates.
//! * [`checkpoint`]: when a shepherd checkpoints.
//! * [`compress`]: pseudo-gradient encodings for the wire (fp32, bf16, int8, sparse).
//! * [`rating`]: how far the shepherd trusts each participant, from its screen.
//! * [`committee`]: who screens a contribution, the committee's verdict, and spot checks.
//! * [`liveness`]: how often workers heartbeat, and when a silent one is dropped.
//! * [`fragments`]: Streaming DiLoCo's fragments and the parameter shards rounds are published in.
//! * [`sketch`]: sketches of pseudo-gradients, to refuse copies.
//! * [`sparse`]: SparseLoCo's chunked top-k with error feedback, both directions.
//! * [`shepherd`] and [`worker`]: the state machines, `(state, input, now) -> actions`.
//! * [`follower`]: a worker's side of failover: the leases it takes and the rounds its chain admits.

pub mod aggregate;
pub mod aggregation;
pub mod aggregator;
mod bf16;
pub mod checkpoint;
pub mod committee;
pub mod compress;
pub mod follower;
pub mod fragments;
pub mod liveness;
pub mod outer;
pub mod rating;
pub mod shepherd;
pub mod sketch;
pub mod sparse;
pub mod worker;

/// Parameters or a pseudo-gradient: one flat `f32` vector per tensor.
pub type Tensors = Vec<Vec<f32>>;

/// A seed for a worker's data order in a round, distinct per (run, peer, round),
/// so that workers train on different windows.
pub fn data_seed(run_seed: u64, peer: &[u8], round: u64) -> u64 {
    let mut h = blake3::Hasher::new();
    h.update(b"pcp/diloco/data-seed");
    h.update(&run_seed.to_le_bytes());
    h.update(&(peer.len() as u64).to_le_bytes());
    h.update(peer);
    h.update(&round.to_le_bytes());
    let bytes = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&bytes.as_bytes()[..8]);
    u64::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
    #[test]
    fn data_seeds_differ_per_peer_and_round() {
        let a = super::data_seed(1, b"alice", 3);
        assert_eq!(a, super::data_seed(1, b"alice", 3));
        assert_ne!(a, super::data_seed(1, b"bob", 3));
        assert_ne!(a, super::data_seed(1, b"alice", 4));
        assert_ne!(a, super::data_seed(2, b"alice", 3));
    }
}
