//! Opening a round in the star: its announcement through the shepherd's uplink,
//! every participant's fetch through the swarm, and the uploads planned.

use crate::aggregators::Pool;
use crate::network::{Flow, fair_share, fair_share_growing};
use crate::report::RoundStats;

use super::{
    ANNOUNCEMENT_BYTES, Ev, HEARTBEAT_ANSWER_BYTES, HEARTBEAT_REQUEST_BYTES, INLINE_PARTICIPANTS, PARTICIPANT_BYTES,
    Sim, Swarm, secs, us,
};

impl Sim<'_> {
    /// Tells round `r`'s participants, at their next heartbeat, that its deadline moved.
    pub(super) fn tell_extension(&mut self, r: u64, now: u64) {
        let shepherd = self.world.shepherd;
        let mut at = Vec::with_capacity(self.participants.len());
        for &w in &self.participants {
            let ws = &self.workers[w as usize];
            if ws.alive {
                let lat = self.world.latency(&ws.spec, 0, &shepherd);
                at.push((us(self.world.next_poll(&ws.spec, secs(now)) + 2.0 * lat), w));
            }
        }
        for (t, w) in at {
            self.push(t, Ev::Extend { w, r });
        }
    }

    /// Schedules round `r`'s deadline; returns when its announcement becomes
    /// visible (after the close and the shepherd's overhead, from round 2),
    /// seconds. As pcp-node does, the deadline moves by the time from the input
    /// that opened the round to the announcement: workers get the whole window
    /// however long the shepherd's close took.
    fn deadline_and_visibility(&mut self, r: u64, deadline_ms: u64) -> f64 {
        let overhead = if r > 1 { self.setup.overhead_s } else { 0.0 };
        let visible = secs(self.now.max(self.closed_at)) + overhead;
        // the close, from the input that decided it, leads the next deadline
        self.shepherd.announced(us(visible) / 1000);
        let late_ms = us(visible).saturating_sub(self.now) / 1000;
        let deadline_ms = match late_ms {
            0 => deadline_ms,
            ms => self.shepherd.postpone(ms).unwrap_or(deadline_ms),
        };
        let deadline_us = deadline_ms * 1000;
        self.deadlines.insert(r, deadline_us);
        self.deadlines.retain(|k, _| *k + 2 >= r);
        self.push(deadline_us, Ev::Deadline { r });
        visible
    }

    /// When each of `fetches` (of `plan`'s workers, for round `r`, whose steps take
    /// about `round_s`) is done. In a swarm a worker serves the round's blobs only once
    /// its own fetch is done: the serving capacity starts at the shepherd's uplink and
    /// grows by each such worker's uplink, less what its contribution takes of it.
    /// Records the shepherd's share of the bytes, which go through its cipher.
    fn serve(&mut self, r: u64, plan: &[(u32, f64, f64, f64)], round_s: f64, fetches: &[Flow]) -> Vec<f64> {
        let up = self.world.shepherd.up;
        let (fetched, share) = match self.setup.swarm {
            Swarm::Factor(f) => (fair_share(up * f.max(1.0), fetches), 1.0 / f.max(1.0)),
            Swarm::Peers => {
                let contribution = self.contribution_bytes(r);
                let gains: Vec<f64> = plan
                    .iter()
                    .map(|(w, ..)| {
                        let link = self.workers[*w as usize].spec.link.up;
                        (link - contribution / round_s.max(1e-3)).max(0.0)
                    })
                    .collect();
                // aggregators seed the round's blobs too: they fetch them first, on their own links
                let seeds = up + self.agg.pool.as_ref().filter(|p| p.active()).map_or(0.0, Pool::up);
                let fetched = fair_share_growing(seeds, fetches, &gains);
                let total: f64 = fetches.iter().map(|f| f.bytes).sum();
                let first = fetches.iter().map(|f| f.start).fold(f64::INFINITY, f64::min);
                let last = fetched.iter().copied().filter(|t| t.is_finite()).fold(first, f64::max);
                let share = if total > 0.0 { (up * (last - first).max(0.0) / total).min(1.0) } else { 1.0 };
                (fetched, share)
            }
        };
        self.served.retain(|round, _| round + 4 > r);
        self.served.insert(r, share);
        self.cpu.serve(share * fetches.iter().map(|f| f.bytes).sum::<f64>());
        fetched
    }

    /// Bytes of round `r`'s announcement ([`INLINE_PARTICIPANTS`]): the participants
    /// listed inline, or the participants blob's hash; and the blob's bytes each
    /// participant fetches from the swarm past them.
    fn announcement_bytes(participants: usize) -> (f64, f64) {
        if participants <= INLINE_PARTICIPANTS {
            (ANNOUNCEMENT_BYTES + PARTICIPANT_BYTES * participants as f64, 0.0)
        } else {
            (ANNOUNCEMENT_BYTES + PARTICIPANT_BYTES, PARTICIPANT_BYTES * participants as f64)
        }
    }

    /// Round `r`'s announcement reaches each of `polls` (worker, heartbeat tick,
    /// one-way latency) through the shepherd's uplink: when each worker knows the
    /// round. Its bytes go through the shepherd's cipher, and heartbeats take their
    /// share of the shepherd's loop from now on.
    fn announce(&mut self, polls: &[(u32, f64, f64)], participants: usize) -> Vec<f64> {
        let (bytes, _) = Self::announcement_bytes(participants);
        let flows: Vec<Flow> = polls
            .iter()
            .map(|(w, tick, lat)| Flow { start: tick + lat, bytes, cap: self.workers[*w as usize].spec.link.down })
            .collect();
        let done = fair_share(self.world.shepherd.up, &flows);
        let now = self.now;
        self.cpu.heartbeats(self.alive, self.world.config.poll_s);
        self.cpu.cipher(now, bytes * polls.len() as f64);
        self.window.control_bytes_out += bytes * polls.len() as f64;
        polls.iter().zip(done).map(|((_, _, lat), d)| d + lat).collect()
    }

    /// Adds the heartbeats of a round of `s.wall_s` to its control bytes (the
    /// shepherd's, in and out).
    pub(super) fn control_bytes(&self, s: &mut RoundStats, _participants: u64) {
        let poll = self.world.config.poll_s;
        if poll > 0.0 {
            let beats = self.alive as f64 * s.wall_s / poll;
            s.control_bytes_in += beats * HEARTBEAT_REQUEST_BYTES;
            s.control_bytes_out += beats * HEARTBEAT_ANSWER_BYTES;
        }
    }

    /// Round `r`'s live `participants`, each with its first heartbeat tick once the
    /// announcement is visible (at `visible`; `after_send`: a worker busy sending an
    /// older contribution sees it after the send) and its one-way latency to the
    /// shepherd; and when each knows the round ([`Sim::announce`]).
    fn hear(&mut self, participants: &[u32], visible: f64, after_send: bool) -> (Vec<(u32, f64, f64)>, Vec<f64>) {
        let shepherd = self.world.shepherd;
        let mut polls = Vec::with_capacity(participants.len());
        for &w in participants {
            let ws = &self.workers[w as usize];
            if !ws.alive {
                continue;
            }
            let lat = self.world.latency(&ws.spec, 0, &shepherd);
            let free = match ws.busy {
                Some((_, until)) if after_send => secs(until).max(visible),
                _ => visible,
            };
            polls.push((w, self.world.next_poll(&ws.spec, free), lat));
        }
        let discovered = self.announce(&polls, participants.len());
        (polls, discovered)
    }

    /// Plans round `r`: discovery, fetch, training and upload of every participant.
    pub(super) fn open(&mut self, r: u64, deadline_ms: u64, participants: &[u32]) {
        let visible = self.deadline_and_visibility(r, deadline_ms);
        let (polls, discovered) = self.hear(participants, visible, true);
        let (_, blob) = Self::announcement_bytes(participants.len());
        let mut plan: Vec<(u32, f64, f64, f64)> = Vec::with_capacity(polls.len());
        let mut fetches = Vec::with_capacity(polls.len());
        for ((w, _, lat), discover) in polls.into_iter().zip(discovered) {
            let ws = &self.workers[w as usize];
            let bytes = blob
                + match self.held_fetch_bytes(r) {
                    Some(update) if r > 1 && ws.held == Some(r - 1) => update,
                    _ => self.setup.params_bytes,
                };
            fetches.push(Flow { start: discover + lat, bytes, cap: ws.spec.link.down });
            plan.push((w, discover, lat, bytes));
        }
        let round_s = self.setup.tau as f64 * self.setup.step_seconds;
        let fetched = self.serve(r, &plan, round_s, &fetches);
        let mut uploads = Vec::with_capacity(plan.len());
        let mut trains = Vec::with_capacity(plan.len());
        for ((w, _, lat, _), done) in plan.iter().zip(&fetched) {
            let ready = done + lat;
            let train = self.train_seconds(*w);
            let up = self.workers[*w as usize].spec.link.up;
            uploads.push(Flow { start: ready + train, bytes: self.upload_bytes(r), cap: up });
            trains.push((ready, train));
        }
        let uploaded = fair_share(self.upload_link(), &uploads);
        for (((w, discover, lat, bytes), (ready, train)), up) in plan.iter().zip(trains).zip(uploaded) {
            let arrive = up + lat;
            self.push(us(*discover), Ev::Discover { w: *w, r });
            let bytes = bytes.round() as u64;
            self.push(us(ready), Ev::ParamsReady { w: *w, r, train_us: us(train), arrive_us: us(arrive), bytes });
        }
    }

    /// Overlap: plans round `r`'s discovery and fetches, and the upload rates of its
    /// contributions (the state machines decide when each is sent).
    pub(super) fn open_overlapped(&mut self, r: u64, deadline_ms: u64, participants: &[u32]) {
        let visible = self.deadline_and_visibility(r, deadline_ms);
        // a round's steps take about the budget (τ typical steps before there is one)
        let round_s =
            self.shepherd.budget_ms().map_or(self.setup.tau as f64 * self.setup.step_seconds, |b| b as f64 / 1e3);
        let (polls, discovered) = self.hear(participants, visible, false);
        let (_, blob) = Self::announcement_bytes(participants.len());
        let mut plan: Vec<(u32, f64, f64, f64)> = Vec::with_capacity(polls.len());
        let mut fetches = Vec::with_capacity(polls.len());
        for ((w, _, lat), discover) in polls.into_iter().zip(discovered) {
            let ws = &self.workers[w as usize];
            // the state machine fetches one round after another: a sparse update
            // needs the round before it
            let (bytes, after) = match (self.held_fetch_bytes(r), ws.fetched) {
                (Some(update), Some((f, done))) if r > 1 && f + 1 == r => (update, secs(done)),
                _ => (self.setup.params_bytes, 0.0),
            };
            fetches.push(Flow { start: (discover + lat).max(after), bytes: bytes + blob, cap: ws.spec.link.down });
            plan.push((w, discover, lat, bytes + blob));
        }
        let fetched = self.serve(r, &plan, round_s, &fetches);
        // uploads from when each worker's steps of round r should end
        let mut uploads = Vec::with_capacity(plan.len());
        for ((w, discover, lat, _), done) in plan.iter().zip(&fetched) {
            let ws = &self.workers[*w as usize];
            let end = match ws.trained_at {
                Some((t, end)) if t == r => secs(end),
                Some((t, end)) if t + 1 == r => secs(end) + round_s,
                _ => done + lat + round_s,
            };
            uploads.push(Flow { start: end.max(*discover), bytes: self.upload_bytes(r), cap: ws.spec.link.up });
        }
        let uploaded = fair_share(self.upload_link(), &uploads);
        for (((w, discover, lat, bytes), done), (flow, up)) in
            plan.iter().zip(fetched).zip(uploads.iter().zip(uploaded))
        {
            let ready = us(done + lat);
            let ws = &mut self.workers[*w as usize];
            ws.fetched = Some((r, ready));
            ws.uploads.retain(|(u, _)| u + 2 >= r);
            ws.uploads.push((r, us(up - flow.start)));
            self.push(us(*discover), Ev::Discover { w: *w, r });
            let bytes = bytes.round() as u64;
            self.push(ready, Ev::ParamsReady { w: *w, r, train_us: 0, arrive_us: 0, bytes });
        }
    }
}
