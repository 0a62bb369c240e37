//! How often a worker heartbeats, and how long the shepherd waits for a silent one.
//!
//! Every live worker's heartbeat costs the shepherd's event loop a signature
//! checked, one made and a few hundred bytes through the cipher: about
//! [`HEARTBEAT_COST_US`] on the 2-core AMD EPYC of `simulations/calibration.json`
//! (`ed25519_verify_s` + `ed25519_sign_s`). At the floor of one every
//! [`HEARTBEAT_MS`], 10,000 workers would take the whole loop. So the interval
//! grows with the run: each worker heartbeats every [`interval_ms`], which keeps
//! the heartbeats within [`LOOP_SHARE_PERCENT`] of the loop, and at most half the
//! run's lease apart, so that a worker hears the leader's lease at its heartbeats
//! even when the lease's gossip misses it.
//!
//! Workers learn the run's size from the round announcement they hold (its
//! participants); the shepherd counts its live workers, a number at least as
//! large, and gives up on a worker only after [`MISSED_HEARTBEATS`] of the
//! intervals that number gives ([`timeout_ms`]), so a worker's longer interval
//! never looks like silence.

/// The shortest interval between a worker's heartbeats, milliseconds.
pub const HEARTBEAT_MS: u64 = 500;

/// A heartbeat's cost to the shepherd's loop, microseconds (measured: see the
/// module docs).
pub const HEARTBEAT_COST_US: u64 = 50;

/// The share of the shepherd's loop the heartbeats may take, percent.
pub const LOOP_SHARE_PERCENT: u64 = 20;

/// Heartbeats a worker may miss before the shepherd drops it.
pub const MISSED_HEARTBEATS: u64 = 4;

/// The leader's lease when a run names none (pcp-node's `--lease-ms`), milliseconds.
pub const DEFAULT_LEASE_MS: u64 = 5_000;

/// The interval that keeps `workers` heartbeats within the loop's share, before
/// the lease's cap: 0.25 ms a worker, never under [`HEARTBEAT_MS`].
fn by_load_ms(workers: usize) -> u64 {
    let us = (workers as u64).saturating_mul(HEARTBEAT_COST_US).saturating_mul(100) / LOOP_SHARE_PERCENT;
    (us / 1000).max(HEARTBEAT_MS)
}

/// How often a worker of a run of `workers` with a lease of `lease_ms` heartbeats,
/// milliseconds: [`HEARTBEAT_MS`] up to 2,000 workers, 2.5 s at 10,000 with the
/// default lease (the cap: half the lease).
pub fn interval_ms(workers: usize, lease_ms: u64) -> u64 {
    by_load_ms(workers).min(lease_ms / 2).max(HEARTBEAT_MS)
}

/// How long the shepherd of `workers` live workers waits for a worker's
/// heartbeat: `configured` (`--heartbeat-timeout-ms`), or, in a run large enough
/// to heartbeat slower than [`HEARTBEAT_MS`], [`MISSED_HEARTBEATS`] intervals at
/// its size if longer. The lease's cap is left out: it only shortens a worker's
/// interval.
pub fn timeout_ms(configured: u64, workers: usize) -> u64 {
    match by_load_ms(workers) {
        HEARTBEAT_MS => configured,
        slower => configured.max(MISSED_HEARTBEATS * slower),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_runs_keep_the_floor() {
        assert_eq!(interval_ms(0, DEFAULT_LEASE_MS), HEARTBEAT_MS);
        assert_eq!(interval_ms(1_000, DEFAULT_LEASE_MS), HEARTBEAT_MS);
        assert_eq!(interval_ms(2_000, DEFAULT_LEASE_MS), HEARTBEAT_MS);
        assert_eq!(timeout_ms(10_000, 1_000), 10_000);
        assert_eq!(timeout_ms(500, 2_000), 500, "a small run keeps its configured timeout");
    }

    #[test]
    fn large_runs_keep_heartbeats_within_the_share() {
        for workers in [4_000, 10_000, 100_000, 1_000_000] {
            let ms = interval_ms(workers, u64::MAX);
            let load = workers as f64 * HEARTBEAT_COST_US as f64 / 1e3 / ms as f64;
            assert!(load <= LOOP_SHARE_PERCENT as f64 / 100.0 + 1e-9, "{workers}: {load}");
        }
        assert_eq!(interval_ms(10_000, u64::MAX), 2_500);
    }

    #[test]
    fn the_lease_caps_the_interval() {
        assert_eq!(interval_ms(10_000, DEFAULT_LEASE_MS), 2_500);
        assert_eq!(interval_ms(100_000, DEFAULT_LEASE_MS), 2_500);
        assert_eq!(interval_ms(100_000, 60_000), 25_000);
        // a lease shorter than twice the floor leaves the floor
        assert_eq!(interval_ms(100_000, 600), HEARTBEAT_MS);
    }

    #[test]
    fn the_timeout_outlasts_missed_heartbeats_at_any_lease() {
        for workers in [0, 1_000, 10_000, 100_000, usize::MAX] {
            for lease in [500, DEFAULT_LEASE_MS, 60_000, u64::MAX] {
                let (timeout, interval) = (timeout_ms(1_000, workers), interval_ms(workers, lease));
                assert!(interval == HEARTBEAT_MS || timeout >= MISSED_HEARTBEATS * interval, "{workers} {lease}");
            }
        }
        assert_eq!(timeout_ms(10_000, 100_000), 100_000);
    }
}
