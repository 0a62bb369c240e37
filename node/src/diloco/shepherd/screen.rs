//! The shepherd's screen: each contribution, at the scale the round would apply
//! it, must lower the loss on a held-out batch that no worker can compute, at its
//! best step along its direction (`Losses::improvement`).
//!
//! * **A split workers never receive.** A new run withholds the last
//!   [`SCREEN_FRACTION`] of its corpus: workers fetch the rest (with, for a
//!   character vocabulary, one line of any characters only the withheld part
//!   has, so both ends build the same vocabulary; a file of `u16` tokens is cut
//!   at a token), and the screen's batches come from the withheld part. A
//!   resumed shepherd cuts the same corpus again. A successor, which has only what workers have,
//!   screens on the public validation split: its batches stay secret until they
//!   are revealed.
//! * **Committed, then revealed.** Each round's batch is drawn with a fresh
//!   secret seed. The round's announcement carries blake3 of it
//!   ([`commit`]), the next round's announcement the seed itself, so anyone
//!   holding the split can audit which batch screened a round, but no worker
//!   knows it while it could still tune an update to it.
//! * **A committee's batch is spent.** Where committees screen on the
//!   withheld split, their members learn a round's batch: round `r`'s is then
//!   the split's slice `r − 1` (`rows` consecutive windows, [`Screener::slice`]),
//!   which no other round uses, so what a screener learned never screens again.
//!   The split lasts [`Screener::slices`] rounds of committees (5% of
//!   OpenWebText's 9 × 10⁹ tokens: 55,000 rounds of gpt2-124m's 8 × 1,025);
//!   past them the shepherd screens alone, on batches drawn from the seed.
//! * **A bounded cost.** Screening takes two forward passes per contribution on
//!   the shepherd's loop. Once a round's screening has taken `share` of the last
//!   round's duration, a rated peer's contribution is screened with the
//!   manifest's probability only, and a contribution on probation, which must be
//!   screened to count, is refused for the round. A round screens at least
//!   [`MIN_SCREENS`] contributions whatever its budget, and a key on probation
//!   refused so has its next contribution screened whatever the budget
//!   ([`Waiting`]): the first to answer cannot keep the same newcomers out round
//!   after round. A key the screen caught is screened whatever the budget until
//!   it leaves probation again (it sits out only from its second catch, and never
//!   for a contribution that helped too little), so one false refusal costs an
//!   honest worker that round alone. A
//!   rated peer caught by a
//!   sampled screen loses its rating, so a rated attacker is caught with that
//!   probability per bad contribution, and each catch puts it back on probation,
//!   where every contribution is screened.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use pcp_protocol::PublicKey;
use pcp_protocol::diloco::Tensors;
use pcp_protocol::diloco::aggregate::Delta;
use pcp_protocol::diloco::aggregate::Rejection;
use pcp_protocol::diloco::committee::Losses;
use pcp_protocol::diloco::shepherd::{self, Input};
use rand::{Rng as _, SeedableRng as _};

use super::Screen;
use crate::diloco::scoring;
use crate::training::data::{Batch, Sampler, Split, TokenFormat, Tokens, Vocab};
use crate::training::engine::Engine;

mod bases;
use bases::{Bases, Prior};

/// The share of a new run's corpus the shepherd withholds for its screen.
pub(crate) const SCREEN_FRACTION: f64 = 0.05;

/// The corpus a new run publishes, and the split it withholds.
#[derive(Debug)]
pub(crate) struct Withheld {
    /// What workers fetch.
    pub(crate) public: PathBuf,
    /// The screen's split; `None` when the corpus is too small to spare it, or not text.
    pub(crate) split: Option<Split>,
}

/// Writes the public part of `corpus` under `dir` and tokenizes the withheld
/// tail with `vocab`. A corpus with less than `min_tokens` to withhold is
/// published whole.
pub(crate) fn withhold(
    corpus: &Path,
    dir: &Path,
    tokenizer: &str,
    vocab: &Vocab,
    min_tokens: usize,
) -> anyhow::Result<Withheld> {
    let whole = || Withheld { public: corpus.to_path_buf(), split: None };
    if matches!(tokenizer, "u16" | "bin") {
        return withhold_tokens(corpus, dir, min_tokens);
    }
    if !matches!(tokenizer, "char" | "byte") {
        return Ok(whole());
    }
    let bytes = std::fs::read(corpus).with_context(|| format!("cannot read corpus {}", corpus.display()))?;
    let mut cut = ((bytes.len() as f64) * (1.0 - SCREEN_FRACTION)) as usize;
    if tokenizer == "char" {
        let text = std::str::from_utf8(&bytes).with_context(|| format!("corpus {} is not UTF-8", corpus.display()))?;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
    }
    let (public, tail) = bytes.split_at(cut);
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tail_path = dir.join("screen-split.txt");
    std::fs::write(&tail_path, tail).with_context(|| format!("cannot write {}", tail_path.display()))?;
    let (split, _) = Tokens::from_text_file(&tail_path, vocab)?.split(0.0)?;
    if split.len() < min_tokens {
        return Ok(whole());
    }
    let mut published = public.to_vec();
    if tokenizer == "char" {
        // the characters only the withheld part has: workers must build the same vocabulary
        let have: std::collections::BTreeSet<char> = String::from_utf8_lossy(public).chars().collect();
        let missing: String = String::from_utf8_lossy(tail).chars().filter(|c| !have.contains(c)).collect();
        let missing: std::collections::BTreeSet<char> = missing.chars().collect();
        if !missing.is_empty() {
            published.push(b'\n');
            published.extend(missing.into_iter().collect::<String>().into_bytes());
        }
    }
    let public_path = dir.join("public-corpus.txt");
    std::fs::write(&public_path, published).with_context(|| format!("cannot write {}", public_path.display()))?;
    Ok(Withheld { public: public_path, split: Some(split) })
}

/// [`withhold`] of a file of `u16` token ids (nanoGPT's raw layout or llm.c's):
/// the cut is a token boundary (2 bytes). The tail goes to `screen-split.bin` as
/// raw tokens, and the public part to `public-corpus.bin` in llm.c's layout, whose
/// header says its count (so it is never read as another layout).
fn withhold_tokens(corpus: &Path, dir: &Path, min_tokens: usize) -> anyhow::Result<Withheld> {
    use std::io::{Read as _, Seek as _, Write as _};
    let tokens = Tokens::open_bin(corpus, TokenFormat::Detect)?;
    let n = tokens.all().len();
    let cut = ((n as f64) * (1.0 - SCREEN_FRACTION)) as usize;
    if n - cut < min_tokens {
        return Ok(Withheld { public: corpus.to_path_buf(), split: None });
    }
    let count = i32::try_from(cut).with_context(|| format!("corpus {}: {cut} tokens is too many", corpus.display()))?;
    let open = || std::fs::File::open(corpus).with_context(|| format!("cannot read corpus {}", corpus.display()));
    let len = open()?.metadata().with_context(|| format!("cannot read corpus {}", corpus.display()))?.len();
    // the tokens are the file's last 2n bytes, after any header
    let start = len - 2 * n as u64;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let copy = |path: &Path, header: Option<i32>, from: u64, tokens: u64| -> anyhow::Result<()> {
        let failed = || format!("cannot write {}", path.display());
        let mut out = std::io::BufWriter::new(std::fs::File::create(path).with_context(failed)?);
        if let Some(count) = header {
            let mut words = [0i32; 256];
            words[..3].copy_from_slice(&[LLMC_MAGIC, 1, count]);
            for w in words {
                out.write_all(&w.to_le_bytes()).with_context(failed)?;
            }
        }
        let mut input = open()?;
        input
            .seek(std::io::SeekFrom::Start(from))
            .with_context(|| format!("cannot read corpus {}", corpus.display()))?;
        let copied = std::io::copy(&mut input.take(2 * tokens), &mut out).with_context(failed)?;
        anyhow::ensure!(copied == 2 * tokens, "corpus {} changed while it was read", corpus.display());
        out.flush().with_context(failed)
    };
    let tail_path = dir.join("screen-split.bin");
    copy(&tail_path, None, start + 2 * cut as u64, (n - cut) as u64)?;
    let public_path = dir.join("public-corpus.bin");
    copy(&public_path, Some(count), start, cut as u64)?;
    let (split, _) = Tokens::open_bin(&tail_path, TokenFormat::NanoGpt)?.split(0.0)?;
    Ok(Withheld { public: public_path, split: Some(split) })
}

/// llm.c's token files' magic number.
const LLMC_MAGIC: i32 = 20_240_520;

/// blake3 of a screen seed, as announcements carry it.
pub(crate) fn commit(seed: &[u8; 32]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"pcp/screen-seed/v1");
    h.update(seed);
    *h.finalize().as_bytes()
}

/// What to do with a contribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Score it.
    Screen,
    /// Let it through unscreened (a rated peer not drawn, or `--screen norm`).
    Skip,
    /// Refuse it this round: it must be screened and the budget is spent.
    OverBudget,
}

/// Contributions a round screens whatever its budget: a small run, whose every
/// worker is new, is screened in full however short its rounds.
pub(crate) const MIN_SCREENS: u64 = 8;

/// A contribution must improve the held-out loss, at its best step
/// (`Losses::improvement`), by at least this share of the median improvement in
/// the last round that screened any: of the rated peers' contributions that
/// improved it (of all such contributions before any peer is rated), whether or
/// not they cleared the bar. It refuses a tiny update meant to drag the norm bound
/// down, which does best at its whole step and improves the loss by almost
/// nothing; random values mostly do best at a sliver of their step and fail
/// [`MIN_BEST_STEP`](pcp_protocol::diloco::committee::MIN_BEST_STEP) first (those
/// that point downhill on the batch meet this bar: `docs/threat-model.md`, "Junk
/// that happens to point downhill"). Honest
/// gains have a long low tail: late in a fp32 run of 20 workers (nanogpt-small, τ
/// 10) each round had one or two at 3.4–6.4% of the last round's median, where
/// the rest were within 3× of it; a tenth refused them, and a refusal is a catch.
/// (The last round's, not a rating's moving average: improvements shrink as
/// training converges.)
pub(crate) const MIN_GAIN_OF_MEDIAN: f64 = 1.0 / 40.0;

/// Keys on probation refused unscreened past the budget ([`Decision::OverBudget`]),
/// with the round that refused them: each one's next contribution is screened
/// whatever the budget. Past the budget the first [`MIN_SCREENS`] arrivals are
/// screened, and arrivals keep their order from round to round (the same fast
/// machines, the same junk sent the instant a round opens), so without this the
/// same newcomers were refused every round: in `bench/sleepers.sh --nodes 21
/// --hostile 9 --tau 10 -- --screen-share 0`'s honest run 2 of 20 honest workers
/// were refused so in 12 of their 13 rounds past the first, and 7 more in 8 or 9.
/// Each refusal buys one screen, and a key the screen then catches is owed its
/// screens on probation and sits out from its second catch. A
/// key that sends nothing for [`WAIT_ROUNDS`] rounds is forgotten, so the map
/// holds at most that many rounds' refusals.
#[derive(Debug, Default)]
pub(crate) struct Waiting(std::collections::BTreeMap<PublicKey, u64>);

/// Rounds a key refused unscreened stays owed a screen ([`Waiting`]).
pub(crate) const WAIT_ROUNDS: u64 = 2;

impl Waiting {
    /// Whether `peer` is owed a screen; it is no longer.
    fn take(&mut self, peer: &PublicKey) -> bool {
        self.0.remove(peer).is_some()
    }

    /// `peer` was refused unscreened in `round`.
    fn refused(&mut self, peer: PublicKey, round: u64) {
        self.0.insert(peer, round);
    }

    /// `round` closed: keys refused [`WAIT_ROUNDS`] rounds ago or more are forgotten.
    fn close(&mut self, round: u64) {
        self.0.retain(|_, refused| refused.saturating_add(WAIT_ROUNDS) > round);
    }
}

/// A round's screening, for its event.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RoundScreen {
    /// Contributions scored.
    pub(crate) screened: u64,
    /// Rated contributions not drawn by the sample.
    pub(crate) skipped: u64,
    /// Contributions refused because they had to be screened past the budget.
    pub(crate) over_budget: u64,
    /// Seconds spent scoring.
    pub(crate) seconds: f64,
}

/// The screen's state: its split, the open round's secret and batch, and the
/// round's cost so far.
pub(crate) struct Screener {
    mode: Screen,
    split: Split,
    /// Whether `split` is withheld from workers (else the public validation split).
    hidden: bool,
    /// A rated peer's chance of being screened past the budget.
    sample: f64,
    /// The share of the last round's duration screening may take in full.
    share: f64,
    shape: (usize, usize),
    rng: rand::rngs::StdRng,
    round: u64,
    seed: [u8; 32],
    revealed: [u8; 32],
    /// The round's batch and its loss at the round's parameters.
    batch: Option<(Batch, Option<f32>)>,
    last_round_s: Option<f64>,
    stats: RoundScreen,
    /// The scale the outer step applies a mean equal to a contribution at: the
    /// outer learning rate of a dense run (at most 1), 1 for a sparse one.
    scale: f32,
    bar: GainBar,
    waiting: Waiting,
    bases: Bases,
    /// Screening by committees (`--screeners`).
    pub(crate) committees: super::committees::Committees,
}

impl std::fmt::Debug for Screener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Screener").field("round", &self.round).field("hidden", &self.hidden).finish()
    }
}

impl Screener {
    /// A screen on `split` (`hidden`: withheld from workers) of batches `shape`,
    /// scoring a contribution at `scale` (see [`Screener`]'s field), by
    /// `committees` where they have screeners.
    pub(crate) fn new(
        mode: Screen,
        (split, hidden): (Split, bool),
        (sample, share): (f64, f64),
        shape: (usize, usize),
        scale: f32,
        committees: super::committees::Committees,
    ) -> Self {
        Self {
            scale,
            mode,
            split,
            hidden,
            sample: sample.clamp(0.0, 1.0),
            share: share.max(0.0),
            shape,
            rng: rand::rngs::StdRng::from_entropy(),
            round: 0,
            seed: [0; 32],
            revealed: [0; 32],
            batch: None,
            last_round_s: None,
            stats: RoundScreen::default(),
            bar: GainBar::default(),
            waiting: Waiting::default(),
            bases: Bases::default(),
            committees,
        }
    }

    /// The least improvement a contribution must make to pass ([`MIN_GAIN_OF_MEDIAN`]).
    pub(crate) fn min_gain(&self) -> f64 {
        self.bar.min_gain()
    }

    /// A contribution lowered the loss by `gain`, and more than its opposite did,
    /// whether or not it cleared [`Screener::min_gain`]; `rated`: its sender is out
    /// of probation.
    pub(crate) fn improved(&mut self, gain: f64, rated: bool) {
        self.bar.improved(gain, rated);
    }

    /// Whether the screen's split is withheld from workers.
    pub(crate) fn hidden(&self) -> bool {
        self.hidden
    }

    /// Opens `round`: a fresh secret seed. Returns what its announcement carries:
    /// the seed's commit and the previous round's seed (zeros with `--screen norm`).
    pub(crate) fn open(&mut self, round: u64) -> ([u8; 32], [u8; 32]) {
        if self.mode != Screen::Score {
            return ([0; 32], [0; 32]);
        }
        if self.round != 0 && self.round != round {
            self.revealed = self.seed;
        }
        if self.round != round {
            self.round = round;
            self.seed = self.rng.r#gen();
            self.batch = None;
            self.stats = RoundScreen::default();
        }
        (commit(&self.seed), self.revealed)
    }

    /// The open round's seed (revealed with the next round).
    pub(crate) fn seed(&self) -> [u8; 32] {
        self.seed
    }

    /// Whether the open round's screening is still within its budget, its share
    /// of the last round: a committee's spot check waits for it (without the
    /// [`MIN_SCREENS`] floor [`Screener::decide`] keeps for a run that screens
    /// alone: committees screen every contribution anyway).
    pub(crate) fn within_budget(&self) -> bool {
        let budget = self.last_round_s.map_or(f64::INFINITY, |s| s * self.share);
        self.stats.seconds < budget
    }

    /// Whether to score `peer`'s contribution: `must` for one on probation,
    /// `owed` for one the screen caught before and that is back on probation,
    /// screened whatever the budget until it leaves it
    /// ([`pcp_protocol::diloco::rating::Ratings::returning`]).
    pub(crate) fn decide(&mut self, peer: &PublicKey, must: bool, owed: bool) -> Decision {
        if self.mode != Screen::Score {
            return Decision::Skip;
        }
        let budget = self.last_round_s.map_or(f64::INFINITY, |s| s * self.share);
        if self.stats.seconds < budget || self.stats.screened < MIN_SCREENS {
            return Decision::Screen;
        }
        if must {
            if owed || self.waiting.take(peer) {
                return Decision::Screen;
            }
            self.stats.over_budget += 1;
            self.waiting.refused(*peer, self.round);
            return Decision::OverBudget;
        }
        if self.rng.gen_bool(self.sample) {
            return Decision::Screen;
        }
        self.stats.skipped += 1;
        Decision::Skip
    }

    /// `round` opens with `params`, which a contribution to it carried into the
    /// next round is scored at ([`Bases`]).
    pub(crate) fn based(&mut self, round: u64, params: &Tensors) {
        if self.bases.open.as_ref().is_some_and(|(r, _)| *r == round) {
            return;
        }
        let resident = self.bases.resident.take();
        self.bases.prior = self.bases.open.take().map(|(round, params)| Prior {
            round,
            params,
            before: None,
            resident: resident.filter(|(r, _)| *r == round).map(|(_, d)| d),
        });
        self.bases.open = Some((round, params.clone()));
    }

    /// Scores `applied`, a contribution to `round` carried into the open round,
    /// on the open round's batch at the parameters `round` opened with ([`Bases`]);
    /// `None` where they are not kept.
    pub(crate) async fn score_carried(
        &mut self,
        engine: &Engine,
        round: u64,
        applied: &Delta,
    ) -> anyhow::Result<Option<Losses>> {
        if self.bases.prior.as_ref().is_none_or(|p| p.round != round) {
            return Ok(None);
        }
        let started = std::time::Instant::now();
        let scale = self.scale;
        self.batch()?;
        let (Some((batch, _)), Some(prior)) = (self.batch.as_ref(), self.bases.prior.as_mut()) else {
            return Ok(None);
        };
        if prior.resident.is_none() {
            prior.resident = Some(engine.resident(prior.params.clone()).await?);
        }
        let base = prior.resident.as_ref().expect("uploaded");
        let losses = scoring::losses(engine, base, (applied, scale), batch, prior.before).await?;
        prior.before = Some(losses.before);
        self.scored(started.elapsed().as_secs_f64());
        Ok(Some(losses))
    }

    /// Scores `applied` (the contribution as the round applies it) at `params`,
    /// the open round's parameters (uploaded to the engine's device once a round).
    pub(crate) async fn score(&mut self, engine: &Engine, params: &Tensors, applied: &Delta) -> anyhow::Result<Losses> {
        let started = std::time::Instant::now();
        let scale = self.scale;
        let round = self.round;
        if self.bases.resident.as_ref().is_none_or(|(r, _)| *r != round) {
            self.bases.resident = Some((round, engine.resident(params.clone()).await?));
        }
        self.batch()?;
        let (Some((batch, before)), Some((_, base))) = (self.batch.as_mut(), self.bases.resident.as_ref()) else {
            anyhow::bail!("round {round}'s screen lost its batch");
        };
        let losses = scoring::losses(engine, base, (applied, scale), batch, *before).await?;
        *before = Some(losses.before);
        self.scored(started.elapsed().as_secs_f64());
        Ok(losses)
    }

    /// The open round's batch and its loss at the round's parameters once known:
    /// its slice of the withheld split where committees screen on it
    /// ([`Self::committees_open`]), else drawn from its secret seed.
    pub(crate) fn batch(&mut self) -> anyhow::Result<&mut (Batch, Option<f32>)> {
        if self.batch.is_none() {
            let batch = match self.slice(self.round).filter(|_| self.spends_slices()) {
                Some(batch) => batch,
                None => {
                    let mut first = [0u8; 8];
                    first.copy_from_slice(&blake3::hash(&self.seed).as_bytes()[..8]);
                    let seed = u64::from_le_bytes(first);
                    Sampler::new(self.split.clone(), self.shape.0, self.shape.1, seed)?.next_batch()
                }
            };
            self.batch = Some((batch, None));
        }
        self.batch.as_mut().context("no screen batch")
    }

    /// Whether committees reveal the batches of a split workers never receive, so
    /// that each round's must be a slice of its own.
    fn spends_slices(&self) -> bool {
        self.hidden && self.by_committees()
    }

    /// The slices of the split, one a round: `rows` windows of `block + 1` tokens.
    pub(crate) fn slices(&self) -> u64 {
        let (rows, block) = self.shape;
        (self.split.len() / (rows * (block + 1)).max(1)) as u64
    }

    /// Round `round`'s slice of the split: its `rows` consecutive windows from
    /// token `(round − 1) × rows × (block + 1)`, none past the split's end.
    pub(crate) fn slice(&self, round: u64) -> Option<Batch> {
        let (rows, block) = self.shape;
        let index = round.checked_sub(1).filter(|&i| i < self.slices())?;
        let len = rows * (block + 1);
        let start = usize::try_from(index).ok()? * len;
        let tokens: Option<Vec<u16>> = (start..start + len).map(|i| self.split.get(i)).collect();
        Batch::from_windows(rows, &tokens?)
    }

    /// Whether the open round screens by committees: they are on, and where their
    /// batches come from the withheld split, the round still has a slice of it.
    pub(crate) fn committees_open(&self) -> bool {
        self.committees_open_in(self.round)
    }

    /// Whether `round` will screen by committees ([`Self::committees_open`]):
    /// an aggregated round's contributions, which the shepherd never holds
    /// whole, are screened only so.
    pub(crate) fn committees_open_in(&self, round: u64) -> bool {
        self.by_committees() && (!self.hidden || round.checked_sub(1).is_some_and(|i| i < self.slices()))
    }

    /// The scale a contribution is screened at ([`Screener`]'s field), which a
    /// committee's request carries.
    pub(crate) fn scale(&self) -> f32 {
        self.scale
    }

    /// The shepherd scored a contribution in `seconds`.
    pub(crate) fn scored(&mut self, seconds: f64) {
        self.stats.screened += 1;
        self.stats.seconds += seconds;
    }

    /// Whether a contribution with held-out `losses` (`rated`: its sender is out
    /// of probation) passes the screen (`None`), or why it is refused.
    pub(crate) fn judge(&mut self, losses: Losses, rated: bool) -> Option<Rejection> {
        let min_gain = self.min_gain();
        let improvement = losses.improvement();
        tracing::debug!(round = self.round, ?losses, min_gain, rated, "screen verdict");
        if losses.improves() {
            self.improved(improvement, rated);
        }
        if losses.passed(min_gain) {
            return None;
        }
        let Losses { before, after, reversed } = losses;
        Some(if losses.improves() {
            Rejection::SmallImprovement { gain: improvement, needed: min_gain }
        } else {
            Rejection::NoImprovement { before, after, reversed }
        })
    }

    /// Whether it screens by committees (`--screeners` and the score screen).
    pub(crate) fn by_committees(&self) -> bool {
        self.mode == Screen::Score && self.committees.k() > 0
    }

    /// Closes the open round, which took `seconds`: its screening, for the event.
    /// The next round's budget is a share of this one's time less its screening (a
    /// budget on the whole round would feed on itself: more screening, a longer
    /// round, a larger budget).
    pub(crate) fn close(&mut self, seconds: f64) -> RoundScreen {
        let rest = seconds - self.stats.seconds;
        if rest > 0.0 {
            self.last_round_s = Some(rest);
        }
        self.bar.close();
        self.waiting.close(self.round);
        std::mem::take(&mut self.stats)
    }
}

/// The least improvement the screen asks ([`MIN_GAIN_OF_MEDIAN`]): the gains of the
/// open round, and the median of the last round that had any. Round 2's bar is a
/// fortieth of round 1's median, the drop from the initial parameters, which is
/// 3–11 times round 2's honest gains (nanogpt-small, τ 40: 1.43 in round 1, 0.13
/// in round 2; sparse, τ 20, six seeds: the lowest honest gain of round 2 at
/// 0.21–0.34 of round 1's median). Random values can point downhill early in a
/// run with a best step past 1/32, and round 2's bar refuses them: in the same
/// six runs and two more, their gains were 0–1.4% of round 1's median, and a
/// hundredth of it passed one of them (the noise worker of `sim_cli`'s
/// lying-screener test). With no bar at all in round 2 every such chance passed:
/// a key caught in round 1 is screened again in round 2.
#[derive(Clone, Debug, Default)]
struct GainBar {
    /// The improvements of the contributions that lowered the loss this round,
    /// passed or refused as too small: (gain, rated).
    gains: Vec<(f64, bool)>,
    /// The median of the rated ones (of them all where none was rated) in the last
    /// round that had any.
    last: Option<f64>,
}

impl GainBar {
    fn min_gain(&self) -> f64 {
        self.last.map_or(0.0, |g| g * MIN_GAIN_OF_MEDIAN)
    }

    /// Gains refused as too small count too: were only passed ones counted, a round
    /// whose honest gains all fell below a bar set by a larger earlier round
    /// (improvements shrink as a run converges, and each round's batch differs)
    /// would leave the bar where it was, and every later round would be refused.
    fn improved(&mut self, gain: f64, rated: bool) {
        if gain.is_finite() && gain > 0.0 && self.gains.len() < 4096 {
            self.gains.push((gain, rated));
        }
    }

    /// Closes `round`.
    fn close(&mut self) {
        let gains = std::mem::take(&mut self.gains);
        let rated = gains.iter().any(|(_, r)| *r);
        let mut gains: Vec<f64> = gains.into_iter().filter(|(_, r)| *r || !rated).map(|(g, _)| g).collect();
        if !gains.is_empty() {
            gains.sort_by(f64::total_cmp);
            let median = gains[(gains.len() - 1) / 2];
            self.last = Some(median);
        }
    }
}

/// The screen as the shepherd's host runs it.
impl super::Host {
    /// The screen, with [`Screen::Score`]: a contribution Δ, as the round would apply
    /// it (bounded per tensor and to the norm bound), is evaluated alone on the
    /// round's secret held-out batch ([`screen`]): the losses at θ, θ − Δ and θ + Δ.
    /// The loss at θ − Δ must be below the loss at θ + Δ (a sign-flipped Δ lowers
    /// the loss less than its opposite), and along the parabola through the three
    /// the loss must fall most at no less than
    /// [`MIN_BEST_STEP`](pcp_protocol::diloco::committee::MIN_BEST_STEP) of the step, and
    /// by at least the round's bar there (`Losses::improvement`: a direction's
    /// gain, so an honest Δ that overshoots the batch at the whole step, as one
    /// alone does late in a run, passes; its size is the norm bounds' to hold).
    /// Random values at a typical norm raise the loss in both directions
    /// (curvature) and do best at a sliver of their step; −Δ fails the first test. A
    /// passed screen is the contribution's [`shepherd::Screen::Passed`], which rates
    /// its sender; a failed one refuses it ([`Input::Malformed`]); a contribution
    /// carried from the round before is screened too. Past the round's screening
    /// budget, a rated peer's contribution is screened by sample and one on
    /// probation refused.
    pub(super) async fn screened(&mut self, mut input: Input<PublicKey>) -> anyhow::Result<Input<PublicKey>> {
        let Some(peer) = self.screenable(&input) else { return Ok(input) };
        let Input::Contribution { round, delta, .. } = &input else { return Ok(input) };
        let round = *round;
        let owed = self.machine.screen_owed(&peer, round);
        match self.screener.decide(&peer, self.machine.must_screen(&peer), owed) {
            Decision::Skip => return Ok(input),
            Decision::OverBudget => return Ok(Input::Malformed { peer, round, reason: Rejection::Unscreened }),
            Decision::Screen => {}
        }
        let Some(applied) = self.machine.as_applied(delta) else { return Ok(input) };
        let engine = self.engine.as_ref().context("the loss screen without the model on this host")?;
        let verdict = self.screener.score(engine, self.machine.params(), &applied).await?;
        let rated = !self.machine.ratings().on_probation(&peer);
        tracing::debug!(%peer, round, ?verdict, best_step = verdict.best_step(), gain = verdict.improvement(), "scored");
        let Some(reason) = self.screener.judge(verdict, rated) else {
            if let Input::Contribution { screen, .. } = &mut input {
                *screen = shepherd::Screen::Passed { improvement: verdict.improvement() };
            }
            return Ok(input);
        };
        // a carried contribution that helped where it was computed is only late
        if round == self.machine.completed()
            && let Some(base) = self.screener.score_carried(engine, round, &applied).await?
            && base.passed(self.screener.min_gain())
        {
            tracing::debug!(%peer, round, ?verdict, ?base, "a carried contribution no longer helps: refused as late");
            return Ok(Input::Malformed { peer, round, reason: Rejection::Late { round } });
        }
        Ok(Input::Malformed { peer, round, reason })
    }

    /// The sender of `input` if it is a contribution the screen scores: to the
    /// open round (or carried into it), of whole samples and the round's shape,
    /// from a key not sitting out. The state machine names why any other is refused.
    pub(super) fn screenable(&self, input: &Input<PublicKey>) -> Option<PublicKey> {
        let Input::Contribution { peer, round, delta, samples, .. } = input else { return None };
        let open = self.machine.completed() + 1;
        let carried = self.plan.overlap && round + 1 == open;
        if (*round != open && !carried) || self.machine.check_samples(*samples).is_err() {
            return None;
        }
        if delta.validate(&self.round_sizes(open)).is_err() {
            return None;
        }
        // a key the screen caught lately is refused before the screen is spent on it
        (!self.machine.sits_out(peer, *round)).then_some(*peer)
    }

    /// Whether a contribution with held-out `losses` (`rated`: its sender is out
    /// of probation) passes the screen (`None`), or why it is refused ([`Screener::judge`]).
    pub(super) fn judge(&mut self, losses: Losses, rated: bool) -> Option<Rejection> {
        self.screener.judge(losses, rated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A committee run's screen: 3 screeners a committee, on `hidden` tokens
    /// `0..n`, batches of 2 rows of 4 (windows of 5 tokens).
    fn screener(n: u16, hidden: bool) -> Screener {
        let split = Tokens::from_vec((0..n).collect(), "split").all();
        let committees = super::super::committees::Committees::new(3, 0.1);
        Screener::new(Screen::Score, (split, hidden), (0.25, 0.5), (2, 4), 1.0, committees)
    }

    /// Every round a committee screens on the withheld split reveals its batch to
    /// the committee: each round's batch is a slice no other round uses, and once
    /// the slices are spent no committee opens (before, each round drew 2 windows
    /// anywhere in the split, so screeners came to know the batches of later
    /// rounds: of the 8 windows rounds 2–5 would have drawn, 6 overlapped one an
    /// earlier round revealed).
    #[test]
    fn each_committee_round_screens_on_a_slice_of_the_split_no_other_round_uses() {
        let mut s = screener(53, true);
        assert_eq!(s.slices(), 5, "53 tokens: five slices of 2 windows of 5 tokens, 3 left over");
        let mut seen = std::collections::BTreeSet::new();
        let mut seed_drawn = std::collections::BTreeSet::new();
        let mut overlapped = 0;
        for round in 1..=5 {
            s.open(round);
            assert!(s.committees_open(), "round {round} has a slice");
            let windows = s.batch().expect("a batch").0.windows();
            let start = (round as u16 - 1) * 10;
            assert_eq!(windows, (start..start + 10).collect::<Vec<_>>(), "round {round}'s slice");
            assert!(windows.iter().all(|t| seen.insert(*t)), "round {round} reuses a token");
            // what a draw from a seed (here the round) would have been
            let drawn = Sampler::new(s.split.clone(), 2, 4, round).expect("sampler").next_batch();
            for w in drawn.windows().chunks(5) {
                overlapped += usize::from(w.iter().any(|t| seed_drawn.contains(t)));
            }
            seed_drawn.extend(drawn.windows());
        }
        const OVERLAPPED: usize = 6;
        assert_eq!(overlapped, OVERLAPPED, "windows drawn at random that an earlier round revealed");
        s.open(6);
        assert!(!s.committees_open(), "the split is spent: the shepherd screens alone");
        assert!(s.batch().is_ok(), "and still has a batch, drawn from the seed");
        // a successor's public split reveals nothing: its batches are drawn from the seed
        let mut public = screener(53, false);
        public.open(7);
        assert!(public.committees_open());
        assert!(public.batch().is_ok());
        assert!(screener(9, true).slice(1).is_none(), "a split shorter than one slice has none");
    }

    #[test]
    fn a_u16_corpus_withholds_its_tail_at_a_token_boundary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tokens: Vec<u16> = (0..1001u16).map(|i| i.wrapping_mul(7919)).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let corpus = dir.path().join("corpus.bin");
        std::fs::write(&corpus, &bytes).expect("written");
        let w = withhold(&corpus, &dir.path().join("state"), "u16", &Vocab::Byte, 16).expect("withheld");
        let split = w.split.expect("a split withheld");
        // the tail, 5% of 1001 tokens: the last 51, whole tokens
        let cut = (1001.0 * (1.0 - SCREEN_FRACTION)) as usize;
        assert_eq!(split.len(), 1001 - cut);
        assert_eq!((0..split.len()).map(|i| split.get(i).expect("token")).collect::<Vec<_>>(), tokens[cut..]);
        // workers get the rest, and none of the tail
        let public = crate::training::data::Corpus::load(&w.public, "u16", None, 0.0).expect("loads");
        assert_eq!(public.train.len(), cut);
        assert_eq!((0..cut).map(|i| public.train.get(i).expect("token")).collect::<Vec<_>>(), tokens[..cut]);
        // an llm.c file (the public part is one) is cut the same way
        let again = withhold(&w.public, &dir.path().join("again"), "bin", &Vocab::Byte, 16).expect("withheld");
        let tail = again.split.expect("a split withheld");
        let cut2 = (cut as f64 * (1.0 - SCREEN_FRACTION)) as usize;
        assert_eq!((0..tail.len()).map(|i| tail.get(i).expect("token")).collect::<Vec<_>>(), tokens[cut2..cut]);
        // a corpus too small to spare the split is published whole
        let small = withhold(&corpus, &dir.path().join("small"), "bin", &Vocab::Byte, 100).expect("whole");
        assert!(small.split.is_none() && small.public == corpus);
    }

    #[test]
    fn the_bar_follows_shrinking_gains_down_instead_of_refusing_every_later_round() {
        let mut bar = GainBar::default();
        assert_eq!(bar.min_gain(), 0.0, "the first round asks nothing");
        bar.improved(0.6, false);
        bar.improved(0.5, false);
        bar.close();
        assert!((bar.min_gain() - 0.0125).abs() < 1e-12, "{}", bar.min_gain());
        // converged: every gain falls below the bar and is refused, yet it counts
        bar.improved(0.02, false);
        bar.improved(0.03, false);
        bar.close();
        assert!((bar.min_gain() - 0.0005).abs() < 1e-12, "the next round asks a fortieth of 0.02: {}", bar.min_gain());
        // a round with no improvement leaves the bar where it is
        bar.close();
        assert!((bar.min_gain() - 0.0005).abs() < 1e-12);
    }

    #[test]
    fn round_two_asks_a_fortieth_of_the_drop_from_initialization() {
        // diloco_cli (τ 40): round 1's median gain 1.434, round 2's honest gains 0.134
        // and 0.130, which a bar of a tenth (0.143) refused
        let mut bar = GainBar::default();
        assert_eq!(bar.min_gain(), 0.0, "round 1 asks nothing");
        bar.improved(1.434, false);
        bar.improved(1.44, false);
        bar.close();
        assert!((bar.min_gain() - 0.03585).abs() < 1e-12, "round 2 asks a fortieth of 1.434: {}", bar.min_gain());
        bar.improved(0.134, true);
        bar.improved(0.130, true);
        bar.close();
        assert!(
            (bar.min_gain() - 0.00325).abs() < 1e-12,
            "round 3 asks a fortieth of round 2's median: {}",
            bar.min_gain()
        );
    }

    /// Past the budget the first [`MIN_SCREENS`] arrivals are screened; a newcomer
    /// that answers after them was refused every round (on main: `late` below is
    /// `OverBudget` in rounds 2, 3 and 4). Refused once, it is screened the next
    /// round, once.
    #[test]
    fn a_newcomer_refused_past_the_budget_is_screened_the_next_round() {
        let key = |i: u8| PublicKey([i; 32]);
        let (late, later) = (key(1), key(2));
        let mut s = screener(200, true);
        s.open(1);
        s.close(10.0);
        let round = |s: &mut Screener, r: u64| {
            s.open(r);
            for _ in 0..MIN_SCREENS {
                s.scored(1.0);
            }
            let decided = (s.decide(&late, true, false), s.decide(&later, true, false));
            s.close(10.0);
            decided
        };
        assert_eq!(round(&mut s, 2), (Decision::OverBudget, Decision::OverBudget), "past the floor");
        assert_eq!(round(&mut s, 3), (Decision::Screen, Decision::Screen), "both waited a round");
        assert_eq!(round(&mut s, 4), (Decision::OverBudget, Decision::OverBudget), "screened last round");
        assert_eq!(round(&mut s, 5), (Decision::Screen, Decision::Screen));
        // a key the screen caught, back on probation, is screened whatever the budget
        s.open(6);
        for _ in 0..MIN_SCREENS {
            s.scored(1.0);
        }
        assert_eq!(s.decide(&later, true, false), Decision::OverBudget);
        assert_eq!(s.decide(&late, true, true), Decision::Screen, "owed");
        assert_eq!(s.decide(&late, true, true), Decision::Screen, "owed every time, not once");
    }

    /// A contribution carried into round 3 is scored again at the parameters
    /// round 2 opened with; a round opened again (a new term) keeps them.
    #[test]
    fn the_round_before_keeps_the_parameters_it_opened_with() {
        let mut s = screener(200, true);
        s.based(1, &vec![vec![1.0]]);
        assert!(s.bases.prior.is_none(), "nothing carried into round 1");
        s.based(2, &vec![vec![2.0]]);
        s.based(3, &vec![vec![3.0]]);
        s.based(3, &vec![vec![4.0]]);
        let prior = s.bases.prior.as_ref().expect("round 2's");
        assert_eq!((prior.round, &prior.params, prior.before), (2, &vec![vec![2.0]], None));
        assert_eq!(s.bases.open.as_ref().map(|(r, p)| (*r, p[0][0])), Some((3, 3.0)));
    }

    #[test]
    fn rated_gains_set_the_bar_and_probation_cannot_drag_it_down() {
        let mut bar = GainBar::default();
        bar.improved(1.0, true);
        for _ in 0..10 {
            bar.improved(1e-9, false);
        }
        bar.close();
        assert!((bar.min_gain() - MIN_GAIN_OF_MEDIAN).abs() < 1e-12, "{}", bar.min_gain());
        bar.improved(f64::NAN, true);
        bar.improved(-1.0, true);
        bar.close();
        assert!((bar.min_gain() - MIN_GAIN_OF_MEDIAN).abs() < 1e-12, "NaN and losses are not gains");
    }
}
