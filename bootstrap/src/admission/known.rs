//! The signers a run knows, and the worker slots they hold: per address, per IPv6
//! /48, and in the pool of workers reached only through relays (see
//! [`Admission::admit_worker`](super::Admission::admit_worker)).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use pcp_protocol::PublicKey;

use super::{MAX_KNOWN, release};
use crate::ip_limits::network_48;

/// What an admitted worker's slot is counted under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Slot {
    /// The IPv4 address or IPv6 /64 of a direct connection.
    Address(IpAddr),
    /// Reached only through relays, whose circuits do not carry the worker's own
    /// address: one pool for all such workers of the run, whatever the relay.
    Relayed,
}

/// When a known signer was last heard from, and the slot it was admitted with.
#[derive(Debug, Clone, Copy)]
struct Heard {
    at: u64,
    /// Set by [`Admission::admit_worker`](super::Admission::admit_worker): the slot it holds.
    slot: Option<Slot>,
}

/// The signers a run knows, the longest silent first out beyond [`MAX_KNOWN`], and how
/// many of them hold each slot.
#[derive(Debug, Default)]
pub(super) struct Known {
    heard: HashMap<PublicKey, Heard>,
    order: BTreeMap<u64, PublicKey>,
    next: u64,
    /// Known signers per slot they were admitted with (at most [`MAX_KNOWN`] entries).
    per_slot: HashMap<Slot, usize>,
    /// Per IPv6 /48: its /64s that hold at least one slot.
    per_network: HashMap<IpAddr, usize>,
}

impl Known {
    /// Knows `signer`, keeping the slot it holds.
    pub(super) fn insert(&mut self, signer: PublicKey) {
        let slot = self.slot(&signer);
        self.insert_at(signer, slot);
    }

    /// Knows `signer`, holding `slot` (releasing any other it held).
    pub(super) fn insert_at(&mut self, signer: PublicKey, slot: Option<Slot>) {
        let heard = Heard { at: self.next, slot };
        if let Some(old) = self.heard.insert(signer, heard) {
            self.order.remove(&old.at);
            self.give_back(old.slot);
        }
        if let Some(slot) = slot {
            let held = self.per_slot.entry(slot).or_default();
            *held += 1;
            if *held == 1
                && let Slot::Address(address) = slot
                && let Some(network) = network_48(address)
            {
                *self.per_network.entry(network).or_default() += 1;
            }
        }
        self.order.insert(self.next, signer);
        self.next += 1;
        if self.heard.len() > MAX_KNOWN
            && let Some((_, oldest)) = self.order.pop_first()
            && let Some(old) = self.heard.remove(&oldest)
        {
            self.give_back(old.slot);
        }
    }

    pub(super) fn remove(&mut self, signer: &PublicKey) {
        if let Some(old) = self.heard.remove(signer) {
            self.order.remove(&old.at);
            self.give_back(old.slot);
        }
    }

    fn give_back(&mut self, slot: Option<Slot>) {
        let Some(slot) = slot else { return };
        release(&mut self.per_slot, slot, 1);
        if !self.per_slot.contains_key(&slot)
            && let Slot::Address(address) = slot
            && let Some(network) = network_48(address)
        {
            release(&mut self.per_network, network, 1);
        }
    }

    /// The slot `signer` holds.
    pub(super) fn slot(&self, signer: &PublicKey) -> Option<Slot> {
        self.heard.get(signer).and_then(|h| h.slot)
    }

    /// Known signers holding `slot`.
    pub(super) fn at(&self, slot: Slot) -> usize {
        self.per_slot.get(&slot).copied().unwrap_or(0)
    }

    /// The /64s of the IPv6 /48 `network` that hold a slot, not counting the one
    /// `signer` would give back on moving (the only slot of its /64 there).
    pub(super) fn networks_but(&self, network: IpAddr, signer: &PublicKey) -> usize {
        let held = self.per_network.get(&network).copied().unwrap_or(0);
        let leaves = match self.slot(signer) {
            Some(old @ Slot::Address(address)) => network_48(address) == Some(network) && self.at(old) == 1,
            _ => false,
        };
        held - usize::from(leaves)
    }

    pub(super) fn contains(&self, signer: &PublicKey) -> bool {
        self.heard.contains_key(signer)
    }

    /// Slots held, all together (for tests).
    #[cfg(test)]
    pub(super) fn slots_held(&self) -> usize {
        self.per_slot.values().sum()
    }

    /// IPv6 /48s with a slot (for tests).
    #[cfg(test)]
    pub(super) fn networks_held(&self) -> usize {
        self.per_network.len()
    }
}
