//! When a shepherd checkpoints: after every K rounds (`--checkpoint-rounds`), after
//! the run's last round, and whenever it has no checkpoint yet. Between checkpoints
//! the round's state blob (parameters, optimizer state and the outer step) is what a
//! resumed shepherd starts from; the simulator charges a close the checkpoint's
//! writes by the same rule.

/// A shepherd checkpoints after every this many rounds unless told (`--checkpoint-rounds`).
pub const DEFAULT_CHECKPOINT_ROUNDS: u64 = 10;

/// Whether a shepherd that checkpoints after every `every` rounds (at least 1)
/// writes a checkpoint after `round`: every `every` rounds, the `last`, and
/// whenever it has none yet (`first`).
pub fn due(round: u64, every: u64, last: bool, first: bool) -> bool {
    first || last || round.is_multiple_of(every.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kth_round_the_last_and_the_first() {
        let due_in = |every, last_round| {
            (1..=last_round).filter(|&r| due(r, every, r == last_round, r == 1)).collect::<Vec<_>>()
        };
        assert_eq!(due_in(10, 25), [1, 10, 20, 25]);
        assert_eq!(due_in(1, 3), [1, 2, 3]);
        // 0 is taken as 1
        assert_eq!(due_in(0, 3), [1, 2, 3]);
        assert_eq!(due_in(DEFAULT_CHECKPOINT_ROUNDS, 4), [1, 4]);
    }
}
