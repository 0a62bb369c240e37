//! How hard an open run's proof of work is: a floor, and one more bit for each
//! doubling of the join rate past what the run admits at the floor.
//!
//! The rule ([`Difficulty`]) is in the run's signed manifest (`powBits`,
//! `powJoinsPerHour`), so a successor applies the same one and a worker can see
//! what it will pay. A shepherd counts the new keys it admitted over the last hour
//! ([`JoinRate`], in minutes) and asks a hello for [`Difficulty::bits`] of that
//! count: with `joins_per_hour` J and floor F, a hello needs F bits while the hour
//! saw at most J new keys, F + 1 up to 2J, F + 2 up to 4J, and so on to
//! [`MAX_POW_BITS`]. Each bit doubles a key's cost, so a flood of identities pays
//! about in proportion to its size squared, while a run that grows by a few hundred
//! volunteers an hour asks each of them the floor. A key the run admitted before
//! is held to the floor: a worker that rejoins does not pay again for the rate.
//!
//! The default floor, [`DEFAULT_POW_BITS`], costs about a CPU-minute: 2^28 hashes
//! at the 4.4 million a second [`super::solve_pow`] does on one core.

use super::MAX_POW_BITS;

/// The floor a public shepherd (`--shepherd --admit open`) asks by default: 2^28
/// hashes, about a minute of one core.
pub const DEFAULT_POW_BITS: u8 = 28;

/// The new keys an hour a run admits at its floor, by default.
pub const DEFAULT_JOINS_PER_HOUR: u32 = 256;

/// An open run's proof-of-work rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Difficulty {
    /// The leading zero bits every key needs (0: no proof of work, whatever the rate).
    pub floor: u8,
    /// New keys an hour admitted at the floor (0: the floor, whatever the rate).
    pub joins_per_hour: u32,
}

impl Difficulty {
    /// The bits a new key needs after `joins` new keys in the last hour.
    pub fn bits(&self, joins: u64) -> u8 {
        if self.floor == 0 || self.joins_per_hour == 0 {
            return self.floor;
        }
        let mut bits = self.floor;
        let mut limit = u64::from(self.joins_per_hour);
        while joins > limit && bits < MAX_POW_BITS {
            bits += 1;
            limit = limit.saturating_mul(2);
        }
        bits.max(self.floor)
    }
}

/// Minutes in the window a [`JoinRate`] counts.
const MINUTES: usize = 60;
const MINUTE_MS: u64 = 60_000;

/// New keys admitted over the last hour, counted a minute at a time: fixed memory
/// whatever the rate. Pure: the caller passes its clock.
#[derive(Debug, Clone)]
pub struct JoinRate {
    /// Joins in each minute, at index minute % 60.
    counts: [u64; MINUTES],
    /// The minute (`now_ms / 60,000`) last counted into.
    minute: u64,
}

impl Default for JoinRate {
    fn default() -> Self {
        Self { counts: [0; MINUTES], minute: 0 }
    }
}

impl JoinRate {
    /// Counts a join at `now_ms`.
    pub fn record(&mut self, now_ms: u64) {
        self.advance(now_ms);
        self.counts[(self.minute % MINUTES as u64) as usize] += 1;
    }

    /// Joins in the hour up to `now_ms` (the current minute and the 59 before it).
    pub fn last_hour(&mut self, now_ms: u64) -> u64 {
        self.advance(now_ms);
        self.counts.iter().sum()
    }

    /// Clears the minutes that passed since the last call.
    fn advance(&mut self, now_ms: u64) {
        let now = now_ms / MINUTE_MS;
        if now <= self.minute {
            return;
        }
        let passed = (now - self.minute).min(MINUTES as u64);
        for m in 1..=passed {
            self.counts[((self.minute + m) % MINUTES as u64) as usize] = 0;
        }
        self.minute = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_bit_per_doubling_past_the_free_rate() {
        let d = Difficulty { floor: 20, joins_per_hour: 100 };
        assert_eq!(d.bits(0), 20);
        assert_eq!(d.bits(100), 20);
        assert_eq!(d.bits(101), 21);
        assert_eq!(d.bits(200), 21);
        assert_eq!(d.bits(201), 22);
        assert_eq!(d.bits(1_000_000), MAX_POW_BITS);
        assert_eq!(d.bits(u64::MAX), MAX_POW_BITS);
    }

    #[test]
    fn no_floor_no_work() {
        assert_eq!(Difficulty { floor: 0, joins_per_hour: 10 }.bits(1 << 40), 0);
        assert_eq!(Difficulty { floor: 12, joins_per_hour: 0 }.bits(1 << 40), 12);
        // a floor above the cap is kept (the worker refuses such a run)
        assert_eq!(Difficulty { floor: 40, joins_per_hour: 1 }.bits(5), 40);
    }

    #[test]
    fn the_hour_slides() {
        let mut rate = JoinRate::default();
        let t0 = 10 * MINUTE_MS;
        for i in 0..30 {
            rate.record(t0 + i * MINUTE_MS);
        }
        assert_eq!(rate.last_hour(t0 + 29 * MINUTE_MS), 30);
        // 59 minutes after the first join it still counts; at 60 it has left the window
        assert_eq!(rate.last_hour(t0 + 59 * MINUTE_MS), 30);
        assert_eq!(rate.last_hour(t0 + 60 * MINUTE_MS), 29);
        assert_eq!(rate.last_hour(t0 + 88 * MINUTE_MS), 1);
        assert_eq!(rate.last_hour(t0 + 89 * MINUTE_MS), 0);
        // a long silence clears everything at once; a clock that steps back counts in the current minute
        rate.record(t0 + 1_000 * MINUTE_MS);
        rate.record(t0);
        assert_eq!(rate.last_hour(t0 + 1_000 * MINUTE_MS), 2);
    }
}
