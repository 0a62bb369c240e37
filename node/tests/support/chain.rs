//! What the failover tests check of a run's events: that the rounds leaders
//! completed, and the ones workers trained, form one chain of parameters.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde_json::Value;

use crate::cluster::{events, find};

/// An event's round.
pub(crate) fn round(e: &Value) -> u64 {
    e["round"].as_u64().unwrap_or_else(|| panic!("no round in {e}"))
}

/// An event's parameters hash.
pub(crate) fn hash(e: &Value) -> String {
    e["params_hash"].as_str().unwrap_or_else(|| panic!("no params_hash in {e}")).to_owned()
}

/// A hash's first 12 digits, to print.
pub(crate) fn short(h: &str) -> &str {
    &h[..h.len().min(12)]
}

/// The rounds `leaders` (name, events) completed, by number, with their result
/// and who completed it; panics unless each number has one result and every
/// completed round started from the previous round's result.
pub(crate) fn chain(leaders: &[(&str, PathBuf)]) -> BTreeMap<u64, (String, String)> {
    let mut results: BTreeMap<u64, (String, String)> = BTreeMap::new();
    for (name, path) in leaders {
        for e in find(path, "round_completed") {
            let (r, h) = (round(&e), hash(&e));
            if let Some((first, by)) = results.get(&r) {
                assert!(
                    *first == h,
                    "round {r} completed twice with different parameters: {} by {by}, {} by {name}",
                    short(first),
                    short(&h)
                );
            } else {
                results.insert(r, (h, name.to_string()));
            }
        }
    }
    for (name, path) in leaders {
        let all = events(path);
        for (k, e) in all.iter().enumerate().filter(|(_, e)| e["event"] == "round_completed") {
            let r = round(e);
            let start = all[..k]
                .iter()
                .rev()
                .find(|s| s["event"] == "round_started" && s["round"] == r)
                .unwrap_or_else(|| panic!("{name} completed round {r} without starting it"));
            if r == 1 {
                continue;
            }
            let (previous, by) = results
                .get(&(r - 1))
                .unwrap_or_else(|| panic!("{name} completed round {r}, but no leader completed round {}", r - 1));
            let base = hash(start);
            assert!(
                base == *previous,
                "{name}'s round {r} started from {}, not from round {}'s result {} (completed by {by})",
                short(&base),
                r - 1,
                short(previous)
            );
        }
    }
    results
}

/// A leader's round that workers applied: it accepted a worker's contribution to it.
#[derive(Debug)]
pub(crate) struct Applied {
    /// Who led it.
    pub(crate) leader: String,
    /// Its number.
    pub(crate) round: u64,
    /// The parameters the round started from.
    pub(crate) base: String,
    /// Its result, if the leader completed it.
    pub(crate) result: Option<String>,
}

/// The rounds of `leaders` into which one of `workers` (peer ids) contributed.
pub(crate) fn applied(leaders: &[(&str, PathBuf)], workers: &[String]) -> Vec<Applied> {
    let mut out = Vec::new();
    for (name, path) in leaders {
        let all = events(path);
        let mut seen = BTreeSet::new();
        for (k, e) in all.iter().enumerate() {
            let accepted = e["event"] == "contribution_received"
                && e["accepted"] == true
                && workers.iter().any(|w| e["peer"] == w.as_str());
            if !accepted || !seen.insert(round(e)) {
                continue;
            }
            let r = round(e);
            let started = all[..k]
                .iter()
                .rposition(|s| s["event"] == "round_started" && s["round"] == r)
                .unwrap_or_else(|| panic!("{name} accepted a contribution to round {r} without starting it"));
            // the round's completion, if any, is logged before the contribution that
            // completed it: looked for from the start (up to a restart of the round)
            let result = all[started + 1..]
                .iter()
                .take_while(|s| s["event"] != "round_started" || s["round"] != r)
                .find(|c| c["event"] == "round_completed" && c["round"] == r)
                .map(hash);
            out.push(Applied { leader: name.to_string(), round: r, base: hash(&all[started]), result });
        }
    }
    out.sort_by_key(|a| a.round);
    out
}

/// The rounds `leaders` completed with no contribution taken (every one refused:
/// the round leaves the parameters as they were), by number, with those parameters.
pub(crate) fn empty_rounds(leaders: &[(&str, PathBuf)]) -> BTreeMap<u64, BTreeSet<String>> {
    let mut out: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    for (_, path) in leaders {
        for e in find(path, "round_completed").iter().filter(|e| e["contributors"] == 0) {
            out.entry(round(e)).or_default().insert(hash(e));
        }
    }
    out
}

/// Panics unless the rounds workers trained form one chain: each round number
/// trained from one set of parameters, the result of the round before it that they
/// trained (whoever led it), or of an earlier one through rounds a leader completed
/// empty from those parameters (`empty`, from [`empty_rounds`]). A round completed
/// twice is allowed when workers trained on from one result only (a deposed
/// leader's round, discarded as the failure model of docs/failover.md says); it is
/// reported.
pub(crate) fn one_chain(applied: &[Applied], empty: &BTreeMap<u64, BTreeSet<String>>) {
    let listing = || {
        applied
            .iter()
            .map(|a| {
                let result = a.result.as_deref().map_or("-", short);
                format!("  round {} by {}: {} -> {}", a.round, a.leader, short(&a.base), result)
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut by_round: BTreeMap<u64, (BTreeSet<&str>, BTreeSet<&str>)> = BTreeMap::new();
    for a in applied {
        let (bases, results) = by_round.entry(a.round).or_default();
        bases.insert(&a.base);
        results.extend(a.result.as_deref());
    }
    for (r, (bases, results)) in &by_round {
        assert_eq!(bases.len(), 1, "workers trained round {r} from different parameters:\n{}", listing());
        if results.len() > 1 {
            eprintln!(
                "round {r} completed with {} results; workers trained on from one:\n{}",
                results.len(),
                listing()
            );
        }
        if *r == 1 {
            continue;
        }
        let base = bases.first().expect("one base");
        // past the rounds completed empty from this base, to the round that made it
        let mut before = r - 1;
        while before > 1 && !by_round.contains_key(&before) && empty.get(&before).is_some_and(|e| e.contains(*base)) {
            before -= 1;
        }
        match by_round.get(&before) {
            Some((_, previous)) if previous.contains(base) => {}
            Some(_) => panic!(
                "workers trained round {r} from parameters no round {before} they trained ended with:\n{}",
                listing()
            ),
            None => panic!("workers trained round {r} but not round {before}:\n{}", listing()),
        }
    }
}

/// Where workers' own events name the parameters a round they trained started
/// from (`params_hash` in `round_announced` or `contribution_sent`; today's
/// workers name none, and [`applied`] reads the leaders' events instead), panics
/// unless each round number has one.
pub(crate) fn one_base_a_round(workers: &[PathBuf]) {
    let mut bases: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    for path in workers {
        for e in events(path) {
            if (e["event"] == "round_announced" || e["event"] == "contribution_sent")
                && let (Some(r), Some(h)) = (e["round"].as_u64(), e["params_hash"].as_str())
            {
                bases.entry(r).or_default().insert(h.to_owned());
            }
        }
    }
    for (r, hashes) in bases {
        assert_eq!(hashes.len(), 1, "workers trained round {r} from different parameters: {hashes:?}");
    }
}
