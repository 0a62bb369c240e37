//! A small deterministic cluster of candidates over a network the tests cut and
//! heal: elections, commits, Raft's figure 8, pre-votes and best effort. The fault
//! simulator (`pcp-simulations`) runs the same type under seeded faults.

use super::*;
use crate::RunId;

const LEASE: u64 = 1_000;
/// A message's delay, ms.
const DELAY: u64 = 10;
/// A state fetch, ms.
const FETCH: u64 = 50;

fn key(i: usize) -> PublicKey {
    PublicKey([1 + i as u8; 32])
}

fn state(term: u64, round: u64, tag: u8) -> Replica {
    Replica { term, round, params: [tag; 32] }
}

#[derive(Clone, Copy, Debug)]
enum Delivery {
    Msg { from: usize, msg: Message },
    Holds(Replica),
}

struct Cluster {
    nodes: Vec<Candidate>,
    up: Vec<bool>,
    /// `link[a][b]`: whether `a` reaches `b`.
    link: Vec<Vec<bool>>,
    queue: Vec<(u64, usize, Delivery)>,
    now: u64,
    /// Everything each node did, by node.
    log: Vec<Vec<Action>>,
    /// What each node persisted last (survives a crash).
    disk: Vec<Option<HardState>>,
}

impl Cluster {
    /// `n` candidates; node 0 creates the run from `initial`.
    fn new(n: usize, mode: Mode, initial: Replica) -> Self {
        let order: Vec<PublicKey> = (0..n).map(key).collect();
        let succession = Succession::new(RunId([3; 32]), order[0], &order[1..]);
        // name nodes in succession order: node i owns terms i+1, i+1+n, …
        let keys: Vec<PublicKey> = succession.order().to_vec();
        let mut nodes = Vec::new();
        let log = vec![Vec::new(); n];
        let (creator, actions) = Candidate::create(keys[0], succession.clone(), LEASE, mode, initial, 0);
        nodes.push(creator);
        for k in &keys[1..] {
            nodes.push(Candidate::new(*k, succession.clone(), LEASE, mode, None, Some(initial), 0));
        }
        let mut c = Self {
            nodes,
            up: vec![true; n],
            link: vec![vec![true; n]; n],
            queue: Vec::new(),
            now: 0,
            log,
            disk: vec![None; n],
        };
        c.carry_out(0, actions);
        c
    }

    fn index(&self, k: &PublicKey) -> usize {
        self.nodes.iter().position(|c| c.me() == *k).expect("a candidate")
    }

    fn carry_out(&mut self, i: usize, actions: Vec<Action>) {
        for a in actions {
            self.log[i].push(a.clone());
            match a {
                Action::Send { to, msg } => {
                    let to = self.index(&to);
                    if self.link[i][to] {
                        self.queue.push((self.now + DELAY, to, Delivery::Msg { from: i, msg }));
                    }
                }
                Action::Fetch { state, from } => {
                    let from = self.index(&from);
                    if self.link[from][i] && self.up[from] {
                        self.queue.push((self.now + FETCH, i, Delivery::Holds(state)));
                    }
                }
                Action::Persist(h) => self.disk[i] = Some(h),
                _ => {}
            }
        }
    }

    fn input(&mut self, i: usize, input: Input) {
        if !self.up[i] {
            return;
        }
        let actions = self.nodes[i].handle(input, self.now);
        self.carry_out(i, actions);
    }

    /// Runs for `ms`, ticking every node every 100 ms.
    fn run(&mut self, ms: u64) {
        let end = self.now + ms;
        while self.now < end {
            self.now += DELAY;
            let due: Vec<_> = self.queue.iter().filter(|(at, ..)| *at <= self.now).copied().collect();
            self.queue.retain(|(at, ..)| *at > self.now);
            for (_, to, d) in due {
                match d {
                    Delivery::Msg { from, msg } => self.input(to, Input::Message { from: self.nodes[from].me(), msg }),
                    Delivery::Holds(s) => self.input(to, Input::Holds(s)),
                }
            }
            if self.now.is_multiple_of(100) {
                for i in 0..self.nodes.len() {
                    self.input(i, Input::Tick);
                }
            }
        }
    }

    /// The node leading the highest term, if any.
    fn leader(&self) -> Option<usize> {
        (0..self.nodes.len())
            .filter(|i| self.up[*i] && self.nodes[*i].is_leader())
            .max_by_key(|i| self.nodes[*i].term())
    }

    /// The leader `i` completes `round` with parameters `tag`.
    fn complete(&mut self, i: usize, round: u64, tag: u8) -> Replica {
        let s = state(self.nodes[i].term(), round, tag);
        self.input(i, Input::Holds(s));
        s
    }

    fn commits(&self, i: usize) -> Vec<Replica> {
        self.log[i].iter().filter_map(|a| if let Action::Commit(s) = a { Some(*s) } else { None }).collect()
    }

    fn crash(&mut self, i: usize) {
        self.up[i] = false;
        self.queue.retain(|(_, to, _)| *to != i);
    }

    /// Restarts `i` from its disk, holding `held`.
    fn restart(&mut self, i: usize, held: Option<Replica>) {
        let c = &self.nodes[i];
        self.nodes[i] = Candidate::new(c.me(), c.succession().clone(), LEASE, c.mode(), self.disk[i], held, self.now);
        self.up[i] = true;
    }

    fn isolate(&mut self, i: usize, cut: bool) {
        for j in 0..self.nodes.len() {
            self.link[i][j] = !cut;
            self.link[j][i] = !cut;
        }
    }
}

#[test]
fn the_creator_leads_and_a_majority_commits_each_round() {
    let mut c = Cluster::new(3, Mode::Majority, state(0, 0, 0));
    assert_eq!(c.commits(0), vec![state(1, 0, 0)], "the manifest's state is committed from the start");
    c.run(300);
    assert!(c.nodes[0].may_act(c.now), "a majority answered its lease");
    let s = c.complete(0, 1, 11);
    assert!(c.commits(0).len() == 1, "not before a follower holds it");
    c.run(200);
    assert_eq!(c.commits(0).last(), Some(&s));
    assert!((1..3).all(|i| c.nodes[i].held() == Some(s)), "followers fetched it");
}

#[test]
fn a_dead_leader_is_succeeded_by_vote_and_the_new_term_commits_first() {
    let mut c = Cluster::new(3, Mode::Majority, state(0, 0, 0));
    c.run(300);
    let s1 = c.complete(0, 1, 11);
    c.run(300);
    c.crash(0);
    c.run(3 * LEASE);
    let l = c.leader().expect("a successor");
    assert_eq!(l, 1, "term 2's owner");
    assert_eq!(c.nodes[1].term(), 2);
    let from = state(2, 1, 11);
    assert!(c.log[1].contains(&Action::Lead { term: 2, from }), "{:?}", c.log[1]);
    assert!(c.log[1].contains(&Action::Campaign { term: 2, pre: true }));
    assert_eq!(c.commits(1), vec![from], "its first commit is round 1's state under term 2");
    assert_eq!(c.nodes[2].held(), Some(from), "taken without a fetch: same parameters");
    assert_ne!(s1, from);
    assert_eq!(c.disk[2], Some(HardState { term: 2, voted_for: Some(key_of(&c, 1)) }));
}

fn key_of(c: &Cluster, i: usize) -> PublicKey {
    c.nodes[i].me()
}

/// Raft's figure 8, as seed 19423 played it: a state held by a minority is never
/// committed by a later leader, and one a later term committed outranks it.
#[test]
fn a_state_held_by_a_minority_never_outranks_a_committed_one() {
    let mut c = Cluster::new(3, Mode::Majority, state(0, 0, 0));
    c.run(300);
    c.complete(0, 1, 11);
    c.run(300);
    // c0 completes round 2 and crashes before anyone holds it
    c.isolate(0, true);
    c.complete(0, 2, 20);
    c.crash(0);
    c.isolate(0, false);
    c.run(3 * LEASE);
    assert_eq!(c.leader(), Some(1));
    // c1 redoes round 2 differently and crashes before releasing it
    c.isolate(1, true);
    let other = c.complete(1, 2, 21);
    c.crash(1);
    c.isolate(1, false);
    assert!(!c.commits(1).contains(&other));
    // c0 comes back with its round 2 of term 1
    c.restart(0, Some(state(1, 2, 20)));
    c.run(8 * LEASE);
    let l = c.leader().expect("a leader");
    assert_eq!(l, 2, "c0's round 2 (term 1) ranks below c2's round 1 (term 2): only c2 wins");
    let committed = c.commits(2);
    assert_eq!(committed.first().map(|s| s.round), Some(1), "{committed:?}");
    // c1 comes back with its round 2 of term 2: the leader's newer term wins
    c.restart(1, Some(other));
    c.run(3 * LEASE);
    assert_eq!(c.leader(), Some(2));
    assert!(c.nodes.iter().all(|n| n.held().is_some_and(|h| h.term >= 3)), "every candidate took the leader's state");
    for i in 0..3 {
        assert!(!c.commits(i).iter().any(|s| s.round == 2 && (s.params == [20; 32] || s.params == [21; 32])));
    }
}

/// A leader cut off from the other candidates commits nothing and stops acting;
/// the majority elects another, and the old leader steps down when the cut heals.
#[test]
fn a_leader_in_a_minority_commits_nothing() {
    let mut c = Cluster::new(3, Mode::Majority, state(0, 0, 0));
    c.run(300);
    c.isolate(0, true);
    let lost = c.complete(0, 1, 11);
    c.run(LEASE);
    assert!(!c.nodes[0].may_act(c.now), "no majority answers");
    c.run(3 * LEASE);
    assert!(!c.commits(0).contains(&lost));
    assert_eq!(c.leader(), Some(1));
    c.isolate(0, false);
    c.run(LEASE);
    assert!(!c.nodes[0].is_leader(), "stepped down");
    assert!(c.log[0].iter().any(|a| matches!(a, Action::Stopped { term: 1, why: Stop::Newer(2) })));
    assert_eq!(c.nodes[0].held(), Some(state(2, 0, 0)), "it dropped its uncommitted round");
}

/// Pre-votes: a candidate cut off for many leases does not raise the run's term
/// when it returns, and the healthy leader keeps leading.
#[test]
fn a_returning_candidate_does_not_depose_a_healthy_leader() {
    let mut c = Cluster::new(3, Mode::Majority, state(0, 0, 0));
    c.run(300);
    c.isolate(2, true);
    c.run(10 * LEASE);
    assert_eq!(c.nodes[2].term(), 1, "pre-votes changed nothing: {:?}", c.log[2]);
    c.isolate(2, false);
    c.run(2 * LEASE);
    assert_eq!(c.leader(), Some(0));
    assert_eq!(c.nodes[0].term(), 1);
    assert!(c.nodes[0].may_act(c.now));
}

/// A candidate whose disk was lost may not vote until it holds a leader's state:
/// the two behind cannot elect one of them past a committed round.
#[test]
fn a_candidate_without_its_disk_does_not_vote() {
    let mut c = Cluster::new(3, Mode::Majority, state(0, 0, 0));
    c.run(300);
    let s = c.complete(0, 1, 11);
    c.isolate(2, true); // c2 stays behind
    c.run(300);
    assert_eq!(c.commits(0).last(), Some(&s), "c0 and c1 hold it");
    // c1 loses its disk, c0 dies; c2 returns
    c.crash(0);
    c.crash(1);
    let n = &c.nodes[1];
    c.nodes[1] = Candidate::new(n.me(), n.succession().clone(), LEASE, n.mode(), c.disk[1], None, c.now).lost_state();
    c.up[1] = true;
    c.isolate(2, false);
    c.run(10 * LEASE);
    assert_eq!(c.leader(), None, "nobody may lead past round 1 without it");
    c.restart(0, Some(s));
    c.run(10 * LEASE);
    let l = c.leader().expect("c0 back: a leader");
    assert_eq!(c.nodes[l].held().map(|h| (h.round, h.params)), Some((1, [11; 32])));
}

#[test]
fn best_effort_survives_a_dead_candidate_of_two() {
    let mut c = Cluster::new(2, Mode::BestEffort, state(0, 0, 0));
    c.run(300);
    let s = c.complete(0, 1, 11);
    c.run(300);
    assert_eq!(c.commits(0).last(), Some(&s));
    c.crash(0);
    c.run(6 * LEASE);
    assert_eq!(c.leader(), Some(1), "the survivor leads alone");
    let s2 = c.complete(1, 2, 22);
    c.run(200);
    assert_eq!(c.commits(1).last(), Some(&s2));
    // under majority, the same run stops
    let mut c = Cluster::new(2, Mode::Majority, state(0, 0, 0));
    c.run(300);
    c.crash(0);
    c.run(6 * LEASE);
    assert_eq!(c.leader(), None);
}

/// A node whose loop stalled does not count the stall as lapses on waking.
#[test]
fn a_stalled_follower_does_not_campaign_on_waking() {
    let mut c = Cluster::new(3, Mode::Majority, state(0, 0, 0));
    c.run(300);
    let before = c.log[1].len();
    let t = c.now + 5 * LEASE;
    let actions = c.nodes[1].handle(Input::Tick, t);
    assert!(actions.is_empty(), "{actions:?}");
    assert!(c.log[1].len() == before);
}

#[test]
fn a_lone_candidate_resumes_at_once() {
    // alone, it leads the term it kept (its workers follow that term) at its first tick
    for (mode, from) in [(Mode::Majority, state(4, 7, 7)), (Mode::BestEffort, state(4, 7, 7))] {
        let succession = Succession::new(RunId([3; 32]), key(0), &[]);
        let hard = Some(HardState { term: 4, voted_for: Some(key(0)) });
        let mut c = Candidate::new(key(0), succession, LEASE, mode, hard, Some(state(4, 7, 7)), 10_000);
        let actions = c.handle(Input::Tick, 10_100);
        assert!(actions.contains(&Action::Lead { term: 4, from }), "{mode:?}: {actions:?}");
        assert!(actions.contains(&Action::Commit(from)), "{mode:?}");
    }
}

#[test]
fn forged_and_out_of_turn_messages_are_refused() {
    let mut c = Cluster::new(3, Mode::Majority, state(0, 0, 0));
    c.run(300);
    let stranger = PublicKey([99; 32]);
    let msg = Message::Lease { term: 9, sent_ms: 0, state: state(9, 5, 5) };
    let a = c.nodes[1].handle(Input::Message { from: stranger, msg }, c.now);
    assert_eq!(a, vec![Action::Rejected { from: stranger, reason: Rejection::NotCandidate }]);
    // term 3 is c2's: c1 may not claim it
    let from = key_of(&c, 1);
    let msg = Message::Lease { term: 3, sent_ms: 0, state: state(3, 5, 5) };
    let a = c.nodes[2].handle(Input::Message { from, msg }, c.now);
    assert!(matches!(a[0], Action::Rejected { reason: Rejection::NotTheirTurn { term: 3 }, .. }), "{a:?}");
    assert_eq!(c.nodes[2].term(), 1);
}
