//! Reading checked sparse messages fast: the histogram of a tensor's codes
//! that [`Packed::check`] measures, and the cache-blocked add of a batch of
//! messages into a dense sum ([`add_batch`]).
//!
//! Adding one message of the default layout touches 2 of every 64 elements of
//! the sum, spread over all of it: about 44% of the cache lines of a 498 MB sum
//! (gpt2-124m), read and written back, for 3.9 MB of message. [`add_batch`]
//! adds a batch of messages block by block of the sum instead
//! ([`BLOCK_ELEMENTS`], which stays in a core's L2 cache): every message of the
//! batch adds its entries of one block before the next block is touched, so the
//! sum crosses the memory bus once a batch instead of once a message. Each
//! element receives the same additions, of the same products, in the same order
//! as when the messages are added one after the other, so the sum is the same
//! bit for bit, whatever the batch, the block or the threads.

use std::ops::Range;

use super::{BitReader, DecodeError, Layout, PARALLEL_ELEMENTS, Packed, PackedTensor, offset_bits, visit};
use crate::diloco::Tensors;

/// Elements of the sum a batch is added to at a time: 128 Ki f32 (512 KiB), in
/// a core's L2 cache with room for the messages' bits streaming through. A
/// top-k layout whose chunk does not divide it rounds it up to a multiple of
/// the chunks.
pub const BLOCK_ELEMENTS: usize = 1 << 17;

/// Code words of a chunk at most this many bits are counted whole (one
/// histogram slot per combination of a chunk's codes) rather than code by code.
const WORD_HISTOGRAM_BITS: usize = 8;

/// Adds `weight` × the kept values of each `(message, weight)` of `batch` to
/// `sum`, tensor by tensor and block by block of [`BLOCK_ELEMENTS`]; a tensor of
/// at least 2^20 elements has its blocks split over `threads` threads. A
/// message's tensor whose size is not the sum's is skipped (messages are
/// checked against the sizes before they are added). The sum is the same, bit
/// for bit, as [`Packed::add_to`] of each message in turn.
pub fn add_batch(sum: &mut Tensors, batch: &[(&Packed, f32)], threads: usize) {
    add_batch_with(sum, batch, threads, BLOCK_ELEMENTS, PARALLEL_ELEMENTS);
}

/// [`add_batch`] with blocks of at least `block` elements, tensors of at least
/// `parallel` elements split over the threads (small ones let tests cross
/// block and thread boundaries at small sizes).
pub(crate) fn add_batch_with(
    sum: &mut Tensors,
    batch: &[(&Packed, f32)],
    threads: usize,
    block: usize,
    parallel: usize,
) {
    for (index, dense) in sum.iter_mut().enumerate() {
        let n = dense.len();
        let members: Vec<(&Packed, f32)> =
            batch.iter().filter(|(p, _)| p.tensors.get(index).is_some_and(|t| t.n == n)).copied().collect();
        if members.is_empty() || n == 0 {
            continue;
        }
        let block = block_len(&members, n, block);
        let blocks = n.div_ceil(block);
        let parts = if n >= parallel { threads.clamp(1, blocks) } else { 1 };
        let run = |range: Range<usize>, dense: &mut [f32], offset: usize| {
            for b in range {
                let (lo, hi) = (b * block, ((b + 1) * block).min(n));
                let slice = &mut dense[lo - offset..hi - offset];
                for (p, weight) in &members {
                    p.add_chunks(index, p.chunks_in(index, lo, hi), slice, lo, *weight);
                }
            }
        };
        if parts == 1 {
            run(0..blocks, dense, 0);
            continue;
        }
        let per = blocks.div_ceil(parts);
        std::thread::scope(|scope| {
            let mut rest: &mut [f32] = dense;
            let mut offset = 0;
            for p in 0..parts {
                let (b0, b1) = ((p * per).min(blocks), ((p + 1) * per).min(blocks));
                let end = (b1 * block).min(n);
                let (mine, tail) = std::mem::take(&mut rest).split_at_mut(end - offset);
                rest = tail;
                let start = offset;
                offset = end;
                let run = &run;
                scope.spawn(move || run(b0..b1, mine, start));
            }
        });
    }
}

/// The block of a tensor of `n` elements for `members`: `block` rounded up to a
/// multiple of every top-k member's chunk (a chunk never spans two blocks), or
/// the whole tensor.
fn block_len(members: &[(&Packed, f32)], n: usize, block: usize) -> usize {
    let mut unit = 1usize;
    for (p, _) in members {
        if !p.layout.strided {
            let c = p.layout.chunk as usize;
            unit = match (unit / gcd(unit, c)).checked_mul(c) {
                Some(l) if l < n => l,
                _ => return n,
            };
        }
    }
    block.max(1).div_ceil(unit).saturating_mul(unit).clamp(1, n)
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Packed {
    /// The chunks (strided: the kept entries) of tensor `index` whose elements
    /// lie in `lo..hi`, `lo` a multiple of the chunk and `hi` one or the end.
    fn chunks_in(&self, index: usize, lo: usize, hi: usize) -> Range<usize> {
        let n = self.tensors[index].n;
        if self.layout.strided {
            let (first, stride) = (self.layout.first(self.seed, index), self.layout.stride());
            let entry = |at: usize| at.saturating_sub(first).div_ceil(stride);
            let kept = self.chunks(index);
            return entry(lo).min(kept)..entry(hi).min(kept);
        }
        let c = self.layout.chunk as usize;
        lo / c..hi.min(n).div_ceil(c)
    }

    /// Adds `weight` × the kept values of chunks (strided: entries) `range` of
    /// tensor `index` into `dense`, which starts at the tensor's element `offset`
    /// and holds every element of those chunks. The message was checked: its
    /// offsets are not checked again.
    pub(super) fn add_chunks(&self, index: usize, range: Range<usize>, dense: &mut [f32], offset: usize, weight: f32) {
        let t = &self.tensors[index];
        // the same product `weight × value` for every entry of a code
        let mut products = [0.0f32; 256];
        products.iter_mut().zip(&t.table).for_each(|(p, v)| *p = weight * v);
        let layout = self.layout;
        let body = body(&self.bytes, layout, self.seed, index, t);
        let bits = usize::from(layout.bits);
        let bmask = (1u64 << bits) - 1;
        if layout.strided {
            let (first, stride) = (layout.first(self.seed, index), layout.stride());
            let mut reader = BitReader::at_bit(body, range.start * bits);
            for e in range {
                dense[first + e * stride - offset] += products[(reader.get(bits) & bmask) as usize];
            }
            return;
        }
        let c = layout.chunk as usize;
        let (full, _) = layout.split(t.n);
        let (keep, width) = (layout.kept(c), offset_bits(c));
        let narrow = layout.chunk_bits(c);
        let mut rest = range.clone();
        if narrow <= 56 && keep > 0 && range.start < full {
            let chunks = range.start..range.end.min(full);
            let shape = (c, Narrow { keep, width, bits });
            match keep {
                1 => add_narrow::<1>(body, chunks, shape, &products, dense, offset),
                2 => add_narrow::<2>(body, chunks, shape, &products, dense, offset),
                4 => add_narrow::<4>(body, chunks, shape, &products, dense, offset),
                _ => add_narrow_any(body, chunks, shape, &products, dense, offset),
            }
            rest = range.end.min(full).max(range.start)..range.end;
        }
        if rest.is_empty() {
            return;
        }
        // the last, shorter chunk, or chunks too wide for one word: checked already
        let _ = visit(&self.bytes, layout, self.seed, index, t, rest, |i, code| {
            dense[i - offset] += products[code];
        });
    }
}

/// The packed bits of tensor `index`.
fn body<'a>(bytes: &'a [u8], layout: Layout, seed: u64, index: usize, t: &PackedTensor) -> &'a [u8] {
    &bytes[t.at..t.at + layout.bits_of(t.n, seed, index).div_ceil(8)]
}

/// The chunks of a narrow layout (a chunk's bits fit one word): `KEEP` (or
/// `keep`) entries of `width` offset bits and `bits` code bits each.
#[derive(Clone, Copy, Debug)]
struct Narrow {
    keep: usize,
    width: usize,
    bits: usize,
}

impl Narrow {
    /// Bits a chunk takes.
    fn chunk_bits(self) -> usize {
        self.keep * (self.width + self.bits)
    }

    /// Calls `f(chunk, word)` for chunks `chunks` of `body`, each chunk's bits
    /// the low bits of `word`: 64-bit words of whole chunks where a chunk's bits
    /// divide 64 (the default layout's 16), a bit reader otherwise.
    #[inline(always)]
    fn for_each(self, body: &[u8], chunks: Range<usize>, mut f: impl FnMut(usize, u64)) {
        let narrow = self.chunk_bits();
        let mut chunk = chunks.start;
        if narrow < 64 && 64 % narrow == 0 && (chunk * narrow).is_multiple_of(8) {
            let per = 64 / narrow;
            let mask = (1u64 << narrow) - 1;
            let from = chunk * narrow / 8;
            let whole = (chunks.end - chunk) / per;
            for eight in body[from..from + whole * 8].chunks_exact(8) {
                let mut b = [0u8; 8];
                b.copy_from_slice(eight);
                let mut word = u64::from_le_bytes(b);
                for _ in 0..per {
                    f(chunk, word & mask);
                    word >>= narrow;
                    chunk += 1;
                }
            }
        }
        let mut reader = BitReader::at_bit(body, chunk * narrow);
        for c in chunk..chunks.end {
            f(c, reader.take(narrow));
        }
    }
}

/// Adds full chunks of `KEEP` entries each, a chunk read as one word.
#[inline]
fn add_narrow<const KEEP: usize>(
    body: &[u8],
    chunks: Range<usize>,
    (c, shape): (usize, Narrow),
    products: &[f32; 256],
    dense: &mut [f32],
    offset: usize,
) {
    let narrow = shape.chunk_bits();
    let (width, bits) = (shape.width, shape.bits);
    let (wmask, bmask) = ((1u64 << width) - 1, (1u64 << bits) - 1);
    let code_shift = KEEP * width;
    let add = |dense: &mut [f32], chunk: usize, word: u64| {
        let start = chunk * c - offset;
        let (mut offsets, mut codes) = (word, word >> code_shift);
        for _ in 0..KEEP {
            // a code is at most 8 bits: the mask keeps the index in the table
            dense[start + (offsets & wmask) as usize] += products[(codes & bmask & 0xff) as usize];
            offsets >>= width;
            codes >>= bits;
        }
    };
    let mut chunk = chunks.start;
    if narrow < 64 && 64 % narrow == 0 && (chunk * narrow).is_multiple_of(8) {
        // whole 64-bit words of chunks, read straight from the bytes
        let per = 64 / narrow;
        let mask = (1u64 << narrow) - 1;
        let from = chunk * narrow / 8;
        let whole = (chunks.end - chunk) / per;
        for eight in body[from..from + whole * 8].chunks_exact(8) {
            let mut b = [0u8; 8];
            b.copy_from_slice(eight);
            let mut word = u64::from_le_bytes(b);
            for _ in 0..per {
                add(dense, chunk, word & mask);
                word >>= narrow;
                chunk += 1;
            }
        }
    }
    let mut reader = BitReader::at_bit(body, chunk * narrow);
    for ch in chunk..chunks.end {
        add(dense, ch, reader.take(narrow));
    }
}

/// [`add_narrow`] for any number of entries a chunk.
fn add_narrow_any(
    body: &[u8],
    chunks: Range<usize>,
    (c, shape): (usize, Narrow),
    products: &[f32; 256],
    dense: &mut [f32],
    offset: usize,
) {
    let (wmask, bmask) = ((1u64 << shape.width) - 1, (1u64 << shape.bits) - 1);
    let code_shift = shape.keep * shape.width;
    shape.for_each(body, chunks, |chunk, word| {
        let start = chunk * c - offset;
        let (mut offsets, mut codes) = (word, word >> code_shift);
        for _ in 0..shape.keep {
            dense[start + (offsets & wmask) as usize] += products[(codes & bmask) as usize];
            offsets >>= shape.width;
            codes >>= shape.bits;
        }
    });
}

/// Counts the codes of tensor `index` into `counts` (one slot per code),
/// checking every offset as [`visit`] does, and failing with the same error.
pub(super) fn count_codes(
    bytes: &[u8],
    layout: Layout,
    seed: u64,
    index: usize,
    t: &PackedTensor,
    chunks: usize,
    counts: &mut [u64],
) -> Result<(), DecodeError> {
    let c = layout.chunk as usize;
    let (full, _) = layout.split(t.n);
    let (keep, width, bits) = (layout.kept(c), offset_bits(c), usize::from(layout.bits));
    let narrow = layout.chunk_bits(c);
    if layout.strided || narrow > 56 || keep == 0 || full == 0 {
        return visit(bytes, layout, seed, index, t, 0..chunks, |_, code| counts[code] += 1);
    }
    let body = body(bytes, layout, seed, index, t);
    let shape = Narrow { keep, width, bits };
    let valid = if bits <= 2 && narrow < 64 && 64 % narrow == 0 {
        count_bit_planes(body, full, shape, c, counts)
    } else if keep * bits <= WORD_HISTOGRAM_BITS {
        // one slot per chunk's combination of codes, expanded once at the end;
        // four histograms in turn, so that equal words in a row do not wait on
        // each other's increments
        let mut words = [[0u64; 1 << WORD_HISTOGRAM_BITS]; 4];
        let valid = count_narrow(body, 0..full, shape, c, |chunk, w| words[chunk & 3][w as usize] += 1);
        for (w, count) in (0..1usize << WORD_HISTOGRAM_BITS).map(|w| (w, words.iter().map(|h| h[w]).sum::<u64>())) {
            for e in 0..keep {
                counts[(w >> (e * bits)) & ((1 << bits) - 1)] += count;
            }
        }
        valid
    } else {
        let bmask = (1u64 << bits) - 1;
        count_narrow(body, 0..full, shape, c, |_, mut w| {
            for _ in 0..keep {
                counts[(w & bmask) as usize] += 1;
                w >>= bits;
            }
        })
    };
    if !valid {
        // the same error as a plain visit finds (its counts are thrown away)
        return visit(bytes, layout, seed, index, t, 0..full, |_, _| {});
    }
    visit(bytes, layout, seed, index, t, full..chunks, |_, code| counts[code] += 1)
}

/// Reads chunks `chunks` of `shape`, checks that each chunk's offsets are below
/// `c` and increasing, and gives each chunk's codes, as one word, to `codes`.
/// Returns whether every offset was valid (a chunk with a bad one still has its
/// codes counted).
fn count_narrow(body: &[u8], chunks: Range<usize>, shape: Narrow, c: usize, mut codes: impl FnMut(usize, u64)) -> bool {
    let code_shift = shape.keep * shape.width;
    let mut bad = false;
    shape.for_each(body, chunks, |chunk, word| {
        bad |= !offsets_valid(word, shape, c as u64);
        codes(chunk, word >> code_shift);
    });
    !bad
}

/// Whether a chunk's offsets (the low bits of `word`) are below `c` and increasing.
#[inline(always)]
fn offsets_valid(word: u64, shape: Narrow, c: u64) -> bool {
    let wmask = (1u64 << shape.width) - 1;
    let mut offsets = word;
    // `previous + 1`, so that the first offset may be 0
    let (mut floor, mut bad) = (0u64, false);
    for _ in 0..shape.keep {
        let o = offsets & wmask;
        bad |= o < floor || o >= c;
        floor = o + 1;
        offsets >>= shape.width;
    }
    !bad
}

/// [`count_narrow`] for codes of 1 or 2 bits in chunks whose bits divide 64
/// (the default layout): 64-bit words of whole chunks, each code's bits counted
/// by a population count of the word's low and high code bits instead of one
/// by one. Adds to `counts` and returns whether every offset was valid.
fn count_bit_planes(body: &[u8], full: usize, shape: Narrow, c: usize, counts: &mut [u64]) -> bool {
    let narrow = shape.chunk_bits();
    let per = 64 / narrow;
    let whole = full / per;
    // the low bit of every code of every chunk of a word
    let mut low = 0u64;
    for chunk in 0..per {
        for e in 0..shape.keep {
            low |= 1 << (chunk * narrow + shape.keep * shape.width + e * shape.bits);
        }
    }
    let mask = (1u64 << narrow) - 1;
    // a power-of-two chunk's offsets are below it by their width: only their
    // order is checked, every chunk of the word at once
    let lanes = (c == 1 << shape.width).then(|| Lanes::new(per, narrow, shape.width));
    let (mut ones, mut twos, mut threes) = (0u64, 0u64, 0u64);
    let mut bad = false;
    for eight in body[..whole * 8].chunks_exact(8) {
        let mut b = [0u8; 8];
        b.copy_from_slice(eight);
        let word = u64::from_le_bytes(b);
        match lanes {
            Some(lanes) => bad |= !lanes.increasing(word, shape.keep),
            None => {
                for chunk in 0..per {
                    bad |= !offsets_valid((word >> (chunk * narrow)) & mask, shape, c as u64);
                }
            }
        }
        let (lo, hi) = (word & low, (word >> 1) & low);
        if shape.bits == 1 {
            ones += u64::from(lo.count_ones());
        } else {
            ones += u64::from((lo & !hi).count_ones());
            twos += u64::from((hi & !lo).count_ones());
            threes += u64::from((lo & hi).count_ones());
        }
    }
    let entries = (whole * per * shape.keep) as u64;
    for (code, n) in [entries - ones - twos - threes, ones, twos, threes].into_iter().enumerate() {
        if let Some(slot) = counts.get_mut(code) {
            *slot += n;
        }
    }
    let bmask = (1u64 << shape.bits) - 1;
    let rest = count_narrow(body, whole * per..full, shape, c, |_, mut w| {
        for _ in 0..shape.keep {
            counts[(w & bmask) as usize] += 1;
            w >>= shape.bits;
        }
    });
    !bad && rest
}

/// The chunks of a 64-bit word as lanes of `narrow` bits, for comparing their
/// offsets all at once (SIMD within a register).
#[derive(Clone, Copy, Debug)]
struct Lanes {
    /// An offset's bits in every lane.
    offset: u64,
    /// `2^width − 1` in every lane.
    below: u64,
    /// Bit `width` of every lane.
    carry: u64,
    width: usize,
}

impl Lanes {
    fn new(per: usize, narrow: usize, width: usize) -> Self {
        let ones = (0..per).fold(0u64, |acc, lane| acc | 1 << (lane * narrow));
        let wmask = (1u64 << width) - 1;
        Self { offset: ones * wmask, below: ones * wmask, carry: ones << width, width }
    }

    /// Whether every lane's `keep` offsets increase: for each pair,
    /// `next + 2^width − 1 − previous` (never negative, so no lane borrows from
    /// the next) reaches `2^width` exactly when `next > previous`.
    #[inline(always)]
    fn increasing(self, word: u64, keep: usize) -> bool {
        let mut ok = true;
        for e in 1..keep {
            let previous = (word >> ((e - 1) * self.width)) & self.offset;
            let next = (word >> (e * self.width)) & self.offset;
            ok &= ((next + self.below - previous) & self.carry) == self.carry;
        }
        ok
    }
}
#[cfg(test)]
mod tests {
    use super::super::{Layout, encode_seeded, subtract};
    use super::*;
    use proptest::prelude::*;

    fn wave(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 * 0.377 + seed).sin() * (i as f32 * 0.013 + seed).cos()) * 1e-2).collect()
    }

    /// A layout from a few numbers: top-k (narrow or wide chunks) or strided.
    fn layout(chunk: u32, k_frac: f64, bits: u8, strided: bool) -> Layout {
        if strided {
            Layout { chunk, k: 1, bits, strided }
        } else {
            Layout { chunk, k: ((f64::from(chunk) * k_frac) as u32).clamp(1, chunk), bits, strided }
        }
    }

    proptest! {
        #[test]
        fn a_blocked_batch_adds_the_same_bits_as_one_message_at_a_time(
            sizes in proptest::collection::vec(0usize..3000, 1..4),
            messages in proptest::collection::vec(
                (1u32..200, 0.0f64..0.5, prop_oneof![Just(1u8), Just(2), Just(4), Just(8)], any::<bool>(), 0u64..9,
                 -4.0f32..4.0),
                1..6,
            ),
            block in 1usize..700,
            parallel in 1usize..4000,
            threads in 1usize..5,
        ) {
            let base: Tensors = sizes.iter().enumerate().map(|(i, n)| wave(*n, i as f32 + 0.5)).collect();
            let mut packed = Vec::new();
            let mut expected = base.clone();
            for (m, (chunk, k_frac, bits, strided, seed, weight)) in messages.iter().enumerate() {
                let layout = layout(*chunk, *k_frac, *bits, *strided);
                let tensors: Tensors = sizes.iter().map(|n| wave(*n, m as f32 * 3.1)).collect();
                let (bytes, sent) = encode_seeded(&tensors, layout, *seed);
                let p = Packed::check(&bytes, &sizes, layout, *seed).expect("the encoder's message checks");
                // the reference: each message's unpacked entries, one message after the other
                subtract(&mut expected, &sent, -*weight);
                packed.push((p, *weight));
            }
            let batch: Vec<(&Packed, f32)> = packed.iter().map(|(p, w)| (p, *w)).collect();
            let mut sum = base.clone();
            add_batch_with(&mut sum, &batch, threads, block, parallel);
            let bits = |t: &Tensors| -> Vec<Vec<u32>> { t.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect() };
            prop_assert_eq!(bits(&sum), bits(&expected));
        }
    }

    proptest! {
        #[test]
        fn the_fast_count_finds_what_a_plain_visit_finds(
            shape in prop_oneof![
                Just((64u32, 2u32, 2u8)), Just((16, 4, 1)), Just((32, 1, 2)), Just((8, 2, 2)),
                Just((96, 2, 2)), Just((64, 3, 4)), Just((128, 4, 2)), Just((16, 2, 8)),
            ],
            n in 1usize..5000,
            flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 0..4),
        ) {
            let (chunk, k, bits) = shape;
            let layout = Layout { chunk, k, bits, strided: false };
            let (mut bytes, _) = encode_seeded(&vec![wave(n, 0.9)], layout, 0);
            let packed = Packed::check(&bytes, &[n], layout, 0).expect("the encoder's message checks");
            let t = &packed.tensors[0];
            let at = t.at;
            for (i, x) in &flips {
                let i = at + i.index(bytes.len() - at);
                bytes[i] ^= x;
            }
            let chunks = layout.split(n).0 + usize::from(layout.split(n).1 > 0);
            let mut fast = vec![0u64; 1 << bits];
            let mut plain = vec![0u64; 1 << bits];
            let got = count_codes(&bytes, layout, 0, 0, t, chunks, &mut fast);
            let want = visit(&bytes, layout, 0, 0, t, 0..chunks, |_, code| plain[code] += 1);
            prop_assert_eq!(&got, &want);
            if want.is_ok() {
                prop_assert_eq!(fast, plain);
            }
        }
    }

    #[test]
    fn blocks_hold_whole_chunks_of_every_message() {
        let sizes = [10_000];
        let t: Tensors = vec![wave(10_000, 1.0)];
        let make = |layout: Layout| {
            let (bytes, _) = encode_seeded(&t, layout, 0);
            Packed::check(&bytes, &sizes, layout, 0).expect("checks")
        };
        let (a, b) = (make(layout(64, 0.05, 2, false)), make(layout(96, 0.05, 2, false)));
        let s = make(layout(7, 0.0, 2, true));
        // lcm(64, 96) = 192: 1000 rounds up to 1152; a strided message adds no constraint
        assert_eq!(block_len(&[(&a, 1.0), (&b, 1.0), (&s, 1.0)], 10_000, 1000), 1152);
        assert_eq!(block_len(&[(&s, 1.0)], 10_000, 1000), 1000);
        // a chunk larger than the tensor: one block
        let big = make(layout(20_000, 0.01, 2, false));
        assert_eq!(block_len(&[(&big, 1.0)], 10_000, 1000), 10_000);
    }

    #[test]
    fn a_bad_offset_is_found_by_the_fast_count() {
        // default layout: a chunk of 64 is 16 bits, two 6-bit offsets then two 2-bit codes
        let layout = Layout { chunk: 64, k: 2, bits: 2, strided: false };
        let (mut bytes, _) = encode_seeded(&vec![wave(64 * 300, 0.2)], layout, 0);
        let body = bytes.len() - 300 * 2;
        // chunk 200: make the second offset equal to the first
        let at = body + 200 * 2;
        let word = u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let first = word & 0x3f;
        let word = (word & !(0x3f << 6)) | (first << 6);
        bytes[at..at + 2].copy_from_slice(&word.to_le_bytes());
        assert!(matches!(
            Packed::check(&bytes, &[64 * 300], layout, 0),
            Err(DecodeError::Offset { index: 0, len: 64, .. })
        ));
    }
}
