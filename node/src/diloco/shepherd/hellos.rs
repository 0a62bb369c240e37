//! What the shepherd keeps of each worker's hello, and who may join by heartbeat.
//!
//! A hello's proof (join certificate, proof-of-work nonce) is checked again at every
//! contribution, and its backend names the worker in `worker_joined`. [`Hellos`] keeps
//! them for at most [`MAX_HELLOS`] keys: the live workers, the hellos whose key has not
//! sent its first heartbeat yet (each holds a slot of its address in the run's
//! admission, released with it), and the last [`MAX_LEFT`] workers that left. A hello
//! that finds it full makes room by dropping the oldest entry that is not a live
//! worker (one that left first, then one that waits), so one-time hellos cannot lock
//! newcomers out: only [`MAX_HELLOS`] live workers fill it. A hello whose key has not
//! become a live worker within [`PENDING_HELLO_MS`] is dropped too.
//!
//! A heartbeat from a key that is not a live worker joins it only if the run admitted
//! it before ([`Hellos::may_rejoin`]): it said hello (it waits, is live, or left
//! recently), or the replicated state a resumed or elected shepherd starts from names
//! it (the last completed round's contributors and those that missed its deadline).
//! Anyone else is told to say hello: a worker refused on a heartbeat joins again.
//!
//! An open run's proof of work ([`pcp_protocol::admit::Difficulty`]): a hello from a
//! new key needs the bits of the last hour's join rate, which [`Hellos`] counts
//! ([`JoinRate`]); a key the run admitted before needs the floor, and one the
//! replicated state names none (the shepherd that admitted it checked its proof).

use pcp_protocol::PublicKey;
use pcp_schema::AckCode;

use crate::diloco::wire::peer_name;
use crate::diloco::{Refusal, wire};
use crate::observe::events as ev;

use super::Host;

use std::collections::{BTreeMap, HashMap, HashSet};

use pcp_protocol::admit::{Difficulty, JoinRate};

/// Keys whose hello the shepherd keeps: live workers, hellos waiting for their first
/// heartbeat, and workers that left recently.
pub(super) const MAX_HELLOS: usize = 4096;
/// Workers that left whose hello is kept, so that a heartbeat rejoins them without a
/// new hello (one that timed out through a network hiccup); beyond, the one that left
/// first goes.
pub(super) const MAX_LEFT: usize = 1024;
/// A hello whose key has not become a live worker this long after is dropped, and
/// its address slot released: room for the compile its answer may wait for, the
/// artifact's fetch and the engine's load. A worker slower than that is refused at
/// its first heartbeat and says hello again.
pub(super) const PENDING_HELLO_MS: u64 = 15 * 60 * 1000;

/// The proof a hello carried: its join certificate and proof-of-work nonce.
pub(super) type Proof = (Vec<u8>, u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Said hello at `since` (monotonic ms); `order` is its place among those waiting.
    Waiting { since: u64, order: u64 },
    /// A live worker of the state machine.
    Live,
    /// Left; `order` is its place among those that left.
    Left { order: u64 },
}

#[derive(Debug)]
struct Entry {
    proof: Proof,
    /// `backend` or `backend:target`.
    backend: String,
    state: State,
    /// Named by the replicated state and back without a hello: its proof of work
    /// was checked by the shepherd that admitted it.
    vouched: bool,
}

/// The hellos a shepherd keeps (see the module's docs).
#[derive(Debug, Default)]
pub(super) struct Hellos {
    entries: HashMap<PublicKey, Entry>,
    /// Waiting hellos, oldest first.
    waiting: BTreeMap<u64, PublicKey>,
    /// Workers that left, the first to leave first.
    left: BTreeMap<u64, PublicKey>,
    next: u64,
    /// Workers the replicated state names, not yet back.
    returning: HashSet<PublicKey>,
    /// New keys admitted by hello over the last hour.
    joins: JoinRate,
}

impl Hellos {
    /// No hello yet; `returning` are the workers of the state the shepherd starts from.
    pub(super) fn new(returning: impl IntoIterator<Item = PublicKey>) -> Self {
        Self { returning: returning.into_iter().collect(), ..Self::default() }
    }

    /// The proof `key`'s hello carried (none: empty).
    pub(super) fn proof(&self, key: &PublicKey) -> Proof {
        self.entries.get(key).map(|e| e.proof.clone()).unwrap_or_default()
    }

    /// The proof-of-work bits a hello from `key` needs at `now_ms` under `rule`: none
    /// for a key the replicated state vouches for, the floor for one the run admitted
    /// before, and for a new key the bits of the last hour's joins.
    pub(super) fn pow_needed(&mut self, key: &PublicKey, rule: Difficulty, now_ms: u64) -> u8 {
        if self.vouched(key) {
            0
        } else if self.entries.contains_key(key) {
            rule.floor
        } else {
            rule.bits(self.joins.last_hour(now_ms))
        }
    }

    /// The proof-of-work bits `key` is held to after joining (at a contribution, or
    /// a heartbeat that rejoins it): none if the replicated state vouches for it,
    /// else the floor.
    pub(super) fn pow_floor(&self, key: &PublicKey, rule: Difficulty) -> u8 {
        if self.vouched(key) { 0 } else { rule.floor }
    }

    fn vouched(&self, key: &PublicKey) -> bool {
        match self.entries.get(key) {
            Some(e) => e.vouched,
            None => self.returning.contains(key),
        }
    }

    /// The backend `key`'s hello announced (none: empty).
    pub(super) fn backend(&self, key: &PublicKey) -> String {
        self.entries.get(key).map(|e| e.backend.clone()).unwrap_or_default()
    }

    /// Keeps `key`'s hello. It waits for its first heartbeat unless `key` is a live
    /// worker already. Returns the key of a waiting hello dropped to make room (its
    /// address slot is to be released), or `Err` when every entry is a live worker.
    pub(super) fn hello(
        &mut self,
        key: PublicKey,
        proof: Proof,
        backend: String,
        now_ms: u64,
    ) -> Result<Option<PublicKey>, Full> {
        let dropped = match self.entries.get(&key) {
            Some(_) => None,
            None => self.make_room().ok_or(Full)?,
        };
        if !self.entries.contains_key(&key) && !self.returning.contains(&key) {
            self.joins.record(now_ms);
        }
        let vouched = self.vouched(&key);
        let live = self.entries.get(&key).is_some_and(|e| e.state == State::Live);
        self.unlist(&key);
        let state = if live {
            State::Live
        } else {
            let order = self.order();
            self.waiting.insert(order, key);
            State::Waiting { since: now_ms, order }
        };
        self.entries.insert(key, Entry { proof, backend, state, vouched });
        Ok(dropped)
    }

    /// `key` joined the state machine's workers. Returns the key of a waiting hello
    /// dropped to make room for it (a returning worker without a hello), if any.
    pub(super) fn joined(&mut self, key: PublicKey) -> Option<PublicKey> {
        let vouched = self.returning.remove(&key);
        if self.entries.contains_key(&key) {
            self.unlist(&key);
            if let Some(e) = self.entries.get_mut(&key) {
                e.state = State::Live;
            }
            return None;
        }
        // a live worker is kept even when every entry is one: it is in the machine already
        let dropped = self.make_room().flatten();
        self.entries
            .insert(key, Entry { proof: Proof::default(), backend: String::new(), state: State::Live, vouched });
        dropped
    }

    /// `key` left the state machine's workers: kept among the last [`MAX_LEFT`].
    pub(super) fn left(&mut self, key: PublicKey) {
        if !self.entries.contains_key(&key) {
            return;
        }
        self.unlist(&key);
        let order = self.order();
        self.left.insert(order, key);
        if let Some(e) = self.entries.get_mut(&key) {
            e.state = State::Left { order };
        }
        while self.left.len() > MAX_LEFT {
            if let Some((_, first)) = self.left.pop_first() {
                self.entries.remove(&first);
            }
        }
    }

    /// Drops the hellos that have waited [`PENDING_HELLO_MS`] by `now_ms`; returns
    /// their keys (their address slots are to be released).
    pub(super) fn expire(&mut self, now_ms: u64) -> Vec<PublicKey> {
        let mut expired = Vec::new();
        while let Some((&order, &key)) = self.waiting.first_key_value() {
            let since = match self.entries.get(&key).map(|e| e.state) {
                Some(State::Waiting { since, order: listed }) if listed == order => since,
                _ => {
                    self.waiting.pop_first();
                    continue;
                }
            };
            if now_ms.saturating_sub(since) < PENDING_HELLO_MS {
                break;
            }
            self.waiting.pop_first();
            self.entries.remove(&key);
            expired.push(key);
        }
        expired
    }

    /// Whether a heartbeat may join `key`: the run admitted it before.
    pub(super) fn may_rejoin(&self, key: &PublicKey) -> bool {
        self.entries.contains_key(key) || self.returning.contains(key)
    }

    /// Whether `key` holds an address slot of the run: a live worker, or a hello
    /// waiting for its first heartbeat.
    pub(super) fn holds_slot(&self, key: &PublicKey) -> bool {
        self.entries.get(key).is_some_and(|e| !matches!(e.state, State::Left { .. }))
    }

    /// Keys kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    /// Keys kept by state: (live, waiting, left).
    fn counts(&self) -> (u64, u64, u64) {
        self.entries.values().fold((0, 0, 0), |(l, w, g), e| match e.state {
            State::Live => (l + 1, w, g),
            State::Waiting { .. } => (l, w + 1, g),
            State::Left { .. } => (l, w, g + 1),
        })
    }

    /// Room for one more entry: `None` if there is none (every entry is a live
    /// worker), else the key of the waiting hello dropped for it, if one was.
    fn make_room(&mut self) -> Option<Option<PublicKey>> {
        if self.entries.len() < MAX_HELLOS {
            return Some(None);
        }
        if let Some((_, first)) = self.left.pop_first() {
            self.entries.remove(&first);
            return Some(None);
        }
        let (_, oldest) = self.waiting.pop_first()?;
        self.entries.remove(&oldest);
        Some(Some(oldest))
    }

    /// Takes `key` off the waiting and left lists.
    fn unlist(&mut self, key: &PublicKey) {
        match self.entries.get(key).map(|e| e.state) {
            Some(State::Waiting { order, .. }) => {
                self.waiting.remove(&order);
            }
            Some(State::Left { order }) => {
                self.left.remove(&order);
            }
            _ => {}
        }
    }

    fn order(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

/// Every key [`Hellos`] keeps is a live worker: a hello finds no room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Full;

impl Host {
    /// Whether `key` may take part now: the run's `--admit` with the proof its hello
    /// carried, and its slot in the run's admission (the cap per address; see
    /// [`pcp_bootstrap::Admission::admit_worker`]), which only a live worker or a
    /// waiting hello keeps. The one-line reason if not.
    pub(super) fn admit(&mut self, key: PublicKey) -> Result<(), Refusal> {
        let (certificate, nonce) = self.hellos.proof(&key);
        let bits = self.hellos.pow_floor(&key, self.plan.trust.difficulty());
        self.plan.trust.check_at(&self.run, &key, (&certificate, nonce), wire::unix_ms(), bits)?;
        self.take_slot(key)?;
        if !self.hellos.holds_slot(&key) {
            // a contribution from a participant that left: counted, with no slot
            self.node.admission().worker_left(self.run, key);
        }
        Ok(())
    }

    fn take_slot(&mut self, key: PublicKey) -> Result<(), Refusal> {
        let cap = self.plan.trust.max_workers_per_ip;
        self.node
            .admission()
            .admit_worker(self.run, key, cap)
            .map_err(|e| Refusal::new(AckCode::NotAdmitted, e.to_string()))
    }

    /// Admits the signer of a hello with `proof`, announcing `backend`, and keeps it.
    pub(super) fn admit_hello(&mut self, key: PublicKey, proof: Proof, backend: String) -> Result<(), Refusal> {
        // the run's candidates, named in its id, fetch the manifest with a hello too
        let bits = if self.manifest.candidates.contains(&key.0) || self.manifest.shepherd == key.0 {
            0
        } else {
            self.hellos.pow_needed(&key, self.plan.trust.difficulty(), wire::mono_ms())
        };
        self.plan.trust.check_at(&self.run, &key, (&proof.0, proof.1), wire::unix_ms(), bits)?;
        self.take_slot(key)?;
        match self.hellos.hello(key, proof, backend, wire::mono_ms()) {
            Ok(dropped) => {
                if let Some(dropped) = dropped {
                    self.node.admission().forget(self.run, dropped);
                }
                Ok(())
            }
            Err(Full) => {
                self.node.admission().forget(self.run, key);
                let reason = format!("the shepherd holds as many workers as it can ({MAX_HELLOS})");
                Err(Refusal::new(AckCode::Full, reason))
            }
        }
    }

    /// Whether a heartbeat from `key`, not a live worker, joins it: the run's
    /// `--admit`, then only a key the run admitted before ([`Hellos::may_rejoin`]),
    /// then its slot.
    pub(super) fn admit_rejoin(&mut self, key: PublicKey) -> Result<(), Refusal> {
        let (certificate, nonce) = self.hellos.proof(&key);
        let bits = self.hellos.pow_floor(&key, self.plan.trust.difficulty());
        self.plan.trust.check_at(&self.run, &key, (&certificate, nonce), wire::unix_ms(), bits)?;
        if !self.hellos.may_rejoin(&key) {
            let reason = format!(
                "heartbeat from {} refused: it has not said hello to run {} (a heartbeat rejoins only a worker \
                 the run admitted)",
                peer_name(&key),
                self.run
            );
            return Err(Refusal::new(AckCode::NotAdmitted, reason));
        }
        self.take_slot(key)
    }

    /// The state machine reports `key` joined.
    pub(super) fn hello_joined(&mut self, key: PublicKey) {
        if let Some(dropped) = self.hellos.joined(key) {
            self.node.admission().forget(self.run, dropped);
        }
    }

    /// The state machine reports `key` left: its slot goes, its hello is kept a while.
    pub(super) fn hello_left(&mut self, key: PublicKey) {
        self.hellos.left(key);
        self.node.admission().worker_left(self.run, key);
    }

    /// Says what the run's admission holds ([`ev::AdmissionHeld`]) at `round`'s close.
    pub(super) fn admission_held(&mut self, round: u64) {
        let (live, waiting, left) = self.hellos.counts();
        let now = wire::mono_ms();
        let joins_last_hour = self.hellos.joins.last_hour(now);
        let pow_bits = u64::from(self.plan.trust.difficulty().bits(joins_last_hour));
        self.events.emit(ev::Event::AdmissionHeld(ev::AdmissionHeld {
            round,
            hellos: live + waiting + left,
            live,
            waiting,
            left,
            joins_last_hour,
            pow_bits,
        }));
    }

    /// Drops the hellos that waited too long for their first heartbeat.
    pub(super) fn expire_hellos(&mut self) {
        for key in self.hellos.expire(wire::mono_ms()) {
            tracing::debug!(peer = %peer_name(&key), "a hello never followed by a heartbeat: dropped");
            self.node.admission().forget(self.run, key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: usize) -> PublicKey {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&(i as u64).to_le_bytes());
        PublicKey(bytes)
    }

    fn proof(i: usize) -> Proof {
        (vec![i as u8], i as u64)
    }

    /// A table of proofs that never releases one: a hello is refused once
    /// [`MAX_HELLOS`] keys have said hello, whether or not any became a worker.
    fn never_released(proofs: &mut BTreeMap<PublicKey, Proof>, key: PublicKey, proof: Proof) -> bool {
        if proofs.len() >= MAX_HELLOS && !proofs.contains_key(&key) {
            return false;
        }
        proofs.insert(key, proof);
        true
    }

    #[test]
    fn one_time_hellos_cannot_lock_newcomers_out() {
        // the attack: MAX_HELLOS one-time hellos, then a newcomer is refused for good
        let mut proofs = BTreeMap::new();
        assert!((0..MAX_HELLOS).all(|i| never_released(&mut proofs, key(i), proof(i))));
        let refused = !never_released(&mut proofs, key(MAX_HELLOS), proof(MAX_HELLOS));
        assert!(refused, "a table that never releases locks the newcomer out");

        // hellos that never became workers, and workers that joined and left: each hello
        // is kept, the table stays bounded, and the oldest goes first
        let mut hellos = Hellos::default();
        let n = 2 * MAX_HELLOS + 1;
        for i in 0..n {
            let dropped = hellos.hello(key(i), proof(i), "cpu".into(), i as u64).expect("never full");
            if i % 2 == 1 {
                hellos.joined(key(i));
                hellos.left(key(i));
            }
            assert!(hellos.len() <= MAX_HELLOS);
            if let Some(dropped) = dropped {
                assert!(dropped != key(i) && !hellos.may_rejoin(&dropped), "a waiting hello dropped for room");
            }
        }
        let newcomer = key(n);
        assert_eq!(hellos.hello(newcomer, proof(n), "rocm:gfx942".into(), n as u64).map(|_| ()), Ok(()));
        assert!(hellos.may_rejoin(&newcomer) && hellos.holds_slot(&newcomer));
        assert_eq!((hellos.proof(&newcomer), hellos.backend(&newcomer)), (proof(n), "rocm:gfx942".to_owned()));
        assert_eq!(hellos.len(), MAX_HELLOS);
        assert!(!hellos.may_rejoin(&key(0)), "the oldest waiting hello went");
        // at most MAX_LEFT of those that left are kept
        assert!(hellos.left.len() <= MAX_LEFT);
    }

    #[test]
    fn a_full_table_of_live_workers_refuses_and_one_leaving_makes_room() {
        let mut hellos = Hellos::default();
        for i in 0..MAX_HELLOS {
            hellos.hello(key(i), proof(i), String::new(), 0).expect("room");
            hellos.joined(key(i));
        }
        let newcomer = key(MAX_HELLOS);
        assert_eq!(hellos.hello(newcomer, proof(0), String::new(), 1), Err(Full));
        assert!(!hellos.may_rejoin(&newcomer));
        // a live worker saying hello again is kept live
        assert_eq!(hellos.hello(key(3), proof(33), String::new(), 1), Ok(None));
        assert!(hellos.holds_slot(&key(3)) && hellos.expire(PENDING_HELLO_MS * 2).is_empty());
        assert_eq!(hellos.proof(&key(3)), proof(33));
        hellos.left(key(7));
        assert!(hellos.may_rejoin(&key(7)) && !hellos.holds_slot(&key(7)));
        assert_eq!(hellos.hello(newcomer, proof(0), String::new(), 1), Ok(None), "the one that left made room");
        assert!(!hellos.may_rejoin(&key(7)));
        assert_eq!(hellos.len(), MAX_HELLOS);
    }

    #[test]
    fn a_waiting_hello_is_dropped_when_it_never_becomes_a_worker() {
        let mut hellos = Hellos::default();
        hellos.hello(key(1), proof(1), String::new(), 1_000).expect("room");
        hellos.hello(key(2), proof(2), String::new(), 2_000).expect("room");
        hellos.hello(key(3), proof(3), String::new(), 3_000).expect("room");
        hellos.joined(key(3));
        assert!(hellos.expire(1_000 + PENDING_HELLO_MS - 1).is_empty());
        // saying hello again starts its wait over
        hellos.hello(key(1), proof(1), String::new(), 2_500).expect("room");
        assert_eq!(hellos.expire(2_000 + PENDING_HELLO_MS), vec![key(2)]);
        assert_eq!(hellos.expire(10 * PENDING_HELLO_MS), vec![key(1)]);
        assert!(!hellos.may_rejoin(&key(1)) && !hellos.may_rejoin(&key(2)));
        assert!(hellos.holds_slot(&key(3)), "a live worker does not expire");
        assert_eq!(hellos.len(), 1);
    }

    #[test]
    fn a_heartbeat_joins_only_a_key_the_run_admitted() {
        let (stranger, greeted, returning) = (key(1), key(2), key(3));
        let mut hellos = Hellos::new([returning]);
        assert!(!hellos.may_rejoin(&stranger), "no hello, not in the replicated state");
        assert!(hellos.may_rejoin(&returning), "a worker of the state the shepherd resumed from");
        assert!(!hellos.holds_slot(&returning));
        hellos.hello(greeted, proof(2), "cuda:sm_90".into(), 0).expect("room");
        assert!(hellos.may_rejoin(&greeted) && hellos.holds_slot(&greeted));
        // joined and left: a heartbeat rejoins it, with the proof and backend it said
        hellos.joined(greeted);
        hellos.left(greeted);
        assert!(hellos.may_rejoin(&greeted) && !hellos.holds_slot(&greeted));
        assert_eq!((hellos.proof(&greeted), hellos.backend(&greeted)), (proof(2), "cuda:sm_90".to_owned()));
        hellos.joined(returning);
        hellos.left(returning);
        assert!(hellos.may_rejoin(&returning) && hellos.returning.is_empty());
        // past MAX_LEFT more departures, the first to leave must say hello again
        for i in 100..100 + MAX_LEFT {
            hellos.hello(key(i), proof(i), String::new(), 0).expect("room");
            hellos.joined(key(i));
            hellos.left(key(i));
        }
        assert!(!hellos.may_rejoin(&greeted) && !hellos.may_rejoin(&returning));
        assert!(hellos.may_rejoin(&key(100 + MAX_LEFT - 1)));
        assert_eq!(hellos.len(), MAX_LEFT);
    }

    #[test]
    fn a_new_key_pays_the_join_rate_a_known_one_the_floor_a_vouched_one_nothing() {
        let rule = Difficulty { floor: 20, joins_per_hour: 4 };
        let returning = key(1_000);
        let mut hellos = Hellos::new([returning]);
        let minute = 60_000;
        // the first 4 new keys of the hour pay the floor; then a bit per doubling
        let mut asked = Vec::new();
        for i in 0..17 {
            asked.push(hellos.pow_needed(&key(i), rule, i as u64));
            hellos.hello(key(i), proof(i), String::new(), i as u64).expect("room");
        }
        assert_eq!(asked, [20, 20, 20, 20, 20, 21, 21, 21, 21, 22, 22, 22, 22, 22, 22, 22, 22]);
        assert_eq!(hellos.pow_needed(&key(99), rule, 17), 23);
        // a key the run admitted pays the floor again, whatever the rate, and a
        // worker of the replicated state nothing, before and after it rejoins
        assert_eq!(hellos.pow_needed(&key(3), rule, 17), 20);
        assert_eq!(hellos.pow_floor(&key(3), rule), 20);
        assert_eq!((hellos.pow_needed(&returning, rule, 17), hellos.pow_floor(&returning, rule)), (0, 0));
        hellos.joined(returning);
        assert_eq!(hellos.pow_floor(&returning, rule), 0);
        hellos.hello(returning, proof(0), String::new(), 18).expect("room");
        assert_eq!(hellos.pow_floor(&returning, rule), 0, "its hello keeps the vouching");
        // neither counted as a join; an hour later the rate is back to the floor
        assert_eq!(hellos.pow_needed(&key(99), rule, 18), 23);
        assert_eq!(hellos.pow_needed(&key(99), rule, 61 * minute), 20);
        // no floor: no proof of work however fast keys come
        let free = Difficulty { floor: 0, joins_per_hour: 1 };
        assert_eq!(hellos.pow_needed(&key(99), free, 18), 0);
    }
}
