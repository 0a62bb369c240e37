//! What moving whole contributions costs the volunteers' uplinks, and the
//! steady utilization it leaves at most: a ceiling, not a simulation.
//!
//! A committee member scores a contribution by applying it, so each of the K
//! members of its committee must receive the whole contribution, besides the
//! one copy its aggregators take (an aggregated run) or the shepherd reads.
//! Every round then moves `(1 + K) × bytes` a worker out of the network, and
//! whoever relays them, someone's uplink sends each byte. Two ceilings follow,
//! each counting uplinks alone (downlinks, latency and the shepherd's work can
//! only lower them):
//!
//! * **Own uplinks** ([`Ceiling::own`]): each worker serves its copies from its
//!   own uplink while it computes the next round (overlap). A worker whose
//!   copies take longer than its compute is paced by its uplink, so it is busy
//!   at most compute / max(compute, upload) of the time; the ceiling is the
//!   mean over the workers.
//! * **Pooled** ([`Ceiling::peers`], [`Ceiling::with_shepherd`]): any relay,
//!   the best a design could do. Every worker's uplink (and the shepherd's, in
//!   the second) carries an equal share of the round's bytes at once, so a
//!   round lasts at least the round's bytes over the sum of the uplinks. A
//!   shepherd that relays pays for the bytes on its cores too, which this
//!   leaves out.
//!
//! `pcp-node simulate --screeners K --aggregators N` runs the node's design (the
//! members fetch from the sender: the first ceiling's) with everything else a
//! round costs; these ceilings say what any design moving whole contributions
//! could reach at best.

use crate::world::World;

/// The steady utilization moving `copies` whole contributions a worker a round
/// leaves at most.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ceiling {
    /// Each worker serving its own copies ([the module docs](self)).
    pub own: f64,
    /// The workers' uplinks sharing the round's bytes.
    pub peers: f64,
    /// The workers' and the shepherd's uplinks sharing them.
    pub with_shepherd: f64,
    /// A round's seconds of compute on a worker.
    pub compute_s: f64,
    /// Seconds a worker's uplink takes for its copies: the median worker's.
    pub median_upload_s: f64,
}

/// The ceilings for `workers` drawn from `world` (its workers' and shepherd's
/// links), each sending `copies` × `bytes` a round while `compute_s` of
/// compute runs.
pub fn uplink_ceiling(world: &mut World, workers: usize, (copies, bytes): (f64, f64), compute_s: f64) -> Ceiling {
    let ups: Vec<f64> = (0..workers).map(|_| world.draw_node().link.up).collect();
    let each = copies * bytes;
    let busy = |upload_s: f64| compute_s / compute_s.max(upload_s);
    let own = ups.iter().map(|up| busy(each / up)).sum::<f64>() / workers.max(1) as f64;
    let round = each * workers as f64;
    let peers_s = round / ups.iter().sum::<f64>();
    let with_shepherd_s = round / (ups.iter().sum::<f64>() + world.shepherd.up);
    let mut uploads: Vec<f64> = ups.iter().map(|up| each / up).collect();
    uploads.sort_by(f64::total_cmp);
    let median_upload_s = uploads.get(uploads.len() / 2).copied().unwrap_or(0.0);
    Ceiling { own, peers: busy(peers_s), with_shepherd: busy(with_shepherd_s), compute_s, median_upload_s }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::WorldConfig;
    use crate::{Device, ModelPreset, Profile, WireEncoding};

    /// The setting: gpt2-124m, τ = 500 on H100 volunteers (the preset's
    /// 400 TFLOP/s) over residential links, the default sparse encoding.
    fn setting(workers: usize, copies: f64, tau: f64) -> Ceiling {
        let spec = ModelPreset::Gpt2_124m.spec();
        let sparse: WireEncoding = "sparse".parse().expect("the default encoding");
        let bytes = spec.encoded_bytes(sparse.encoding()) as f64;
        let compute_s = tau * spec.flops_per_step / Device::H100.flops();
        let config = WorldConfig {
            profile: Profile::Residential,
            shepherd_profile: Profile::Datacenter,
            regions: 4,
            stragglers: 0.0,
            straggler_slowdown: 1.5,
            jitter: 0.0,
            hostile: 0.0,
            poll_s: 1.0,
        };
        uplink_ceiling(&mut World::new(config, 5), workers, (copies, bytes), compute_s)
    }

    /// One copy a worker (its aggregators') leaves a residential H100 run busy:
    /// the ceiling sits above what `simulate` reaches with the norm screen and
    /// 156 aggregators (92.6%). Committees of three, each member given the whole
    /// contribution by its sender or by the other workers, cannot reach 90% at
    /// 1,000 workers or 80% at 10,000 over these uplinks. A relay with a
    /// datacenter's uplink (the shepherd's) carries 1,000 workers' bytes, and
    /// not 10,000's.
    #[test]
    fn committees_of_whole_contributions_are_bounded_by_residential_uplinks() {
        for workers in [1_000, 10_000] {
            let rows: Vec<(f64, Ceiling)> = [1.0, 2.0, 3.0, 4.0].map(|c| (c, setting(workers, c, 500.0))).to_vec();
            for (copies, c) in &rows {
                eprintln!(
                    "{workers} workers, {copies} copies: compute {:.2} s, the median upload {:.2} s; \
                     own uplinks {:.1}%, the workers' pooled {:.1}%, with the shepherd's {:.1}%",
                    c.compute_s,
                    c.median_upload_s,
                    100.0 * c.own,
                    100.0 * c.peers,
                    100.0 * c.with_shepherd
                );
            }
            let (one, three) = (rows[0].1, rows[3].1);
            assert!(one.peers >= 0.99 && one.own >= 0.926, "{workers}: one copy {one:?}");
            let target = if workers == 1_000 { 0.90 } else { 0.80 };
            assert!(three.peers < target && three.own < target, "{workers}: K = 3 {three:?}");
            // a datacenter's uplink carries 1,000 workers' copies, not 10,000's
            let relayed = if workers == 1_000 { three.with_shepherd >= 0.99 } else { three.with_shepherd < target };
            assert!(relayed, "{workers}: K = 3 through the shepherd {three:?}");
        }
        // the same committees fit the workers' uplinks where compute outlasts the bytes
        assert!(setting(1_000, 4.0, 2_000.0).peers >= 0.99);
    }
}
