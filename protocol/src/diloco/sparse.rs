//! SparseLoCo's pseudo-gradient encoding (arXiv 2508.15706): each tensor is cut
//! into chunks, the k entries of largest magnitude of every chunk are kept, and
//! their values are quantized to 2 (4 or 8) bits by the statistical quantizer of
//! the reference code: centred on their mean and binned at `Rσ / 2^bits` around
//! it (R = 6 at 4 bits as in the reference code, 3 at 2 bits, 8 at 8 bits). At 2 and 4 bits a value decodes to its bin's mean, from a per-tensor table
//! of 4 or 16 floats; at 8 bits, to the bin's centre, `mean + (code − 128) × step`,
//! from two floats (a 256-entry table would cost more than the values of a small
//! tensor). What was not sent stays in an [`ErrorFeedback`] buffer and is sent in a
//! later round.
//!
//! The same format carries both directions: a worker's contribution (by
//! default chunk 64, k 2, 2 bits: 8 bits per kept entry, 128× fewer bytes than
//! fp32 less the tables; SparseLoCo's own chunk 4096, k 64 is `sparse:chunk=4096,k=64`)
//! and the shepherd's aggregated update (k 8 at 4 bits by default),
//! re-sparsified from the union of the contributions with the shepherd's own
//! error feedback. A strided layout (`select=stride`) keeps every s-th element
//! from an offset that cycles with the round, and sends no offsets at all.
//!
//! Wire format, version 1 (all integers little-endian):
//!
//! ```text
//! b"PCPS" | version u8 = 1 | chunk u32 | k u32 | bits u8 | strided u8 | seed u64 | tensor count u32
//! per tensor: elements u32 | table: 2^bits × bf16 (8 bits: mean, step) | packed bits, padded to a byte
//!   packed bits: for each chunk (the last may be shorter), its kept entries'
//!   offsets within the chunk (ceil(log2(chunk length)) bits each, strictly
//!   increasing), then their codes (`bits` each)
//! ```
//!
//! A chunk of `len` elements keeps `max(1, ceil(len × k / chunk))` entries, so the
//! byte length of a message follows from the tensor sizes and the layout alone:
//! [`Layout::encoded_len`]. [`decode`] checks the layout and that length before it
//! allocates anything, then that every offset is in its chunk and increasing.

use super::Tensors;
use super::bf16::{from_bf16, to_bf16};

mod blocked;
mod encode;

pub use blocked::{BLOCK_ELEMENTS, add_batch};
pub use encode::encode_seeded_on;
pub(crate) use encode::groups;

const MAGIC: &[u8; 4] = b"PCPS";
const VERSION: u8 = 1;
const HEADER: usize = 4 + 1 + 4 + 4 + 1 + 1 + 8 + 4;
/// The quantizer's range in standard deviations, by bits: values within ±range/2 σ
/// of the mean get their own bins. The reference code's 6 at 4 bits; 3 at 2 bits,
/// where 6 puts two values of opposite sign (a small tensor's two kept entries)
/// into one bin and decodes both as their mean; 8 at 8 bits (256 bins).
fn range_sigmas(bits: u8) -> f64 {
    match bits {
        0..=2 => 3.0,
        3..=4 => 6.0,
        _ => 8.0,
    }
}
/// The largest chunk a layout may name.
pub const MAX_CHUNK: u32 = 1 << 20;

/// How a sparse message is laid out: chunk size, entries kept per full chunk and
/// bits per kept value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    /// Elements per chunk.
    pub chunk: u32,
    /// Entries kept per full chunk.
    pub k: u32,
    /// Bits per kept value: 1, 2, 4 or 8.
    pub bits: u8,
    /// Which entries are kept: the top k by magnitude of every chunk (offsets sent),
    /// or every `chunk / k`-th element from an offset that cycles with the round
    /// (nothing sent: both ends know it).
    pub strided: bool,
}

impl Layout {
    /// Checks the numbers: `1 <= k <= chunk <= MAX_CHUNK`, bits 2, 4 or 8.
    pub fn check(&self) -> Result<(), String> {
        if self.chunk == 0 || self.chunk > MAX_CHUNK {
            return Err(format!("chunk {} is outside 1..={MAX_CHUNK}", self.chunk));
        }
        if self.k == 0 || self.k > self.chunk {
            return Err(format!("k {} is outside 1..={} (the chunk)", self.k, self.chunk));
        }
        if ![1, 2, 4, 8].contains(&self.bits) {
            return Err(format!("bits {} is not 1, 2, 4 or 8", self.bits));
        }
        if self.strided && !self.chunk.is_multiple_of(self.k) {
            return Err(format!("a strided layout needs k {} to divide the chunk {}", self.k, self.chunk));
        }
        Ok(())
    }

    /// A strided layout's stride.
    fn stride(&self) -> usize {
        (self.chunk / self.k) as usize
    }

    /// A strided layout's first index in tensor `index` of a message seeded `seed`:
    /// it cycles with the seed (the round), so every element is sent once every
    /// `stride` rounds.
    fn first(&self, seed: u64, index: usize) -> usize {
        ((seed % self.stride() as u64) as usize + index) % self.stride()
    }

    /// The entries a strided layout keeps in tensor `index` of `n` elements.
    fn strided_in(&self, n: usize, seed: u64, index: usize) -> usize {
        let first = self.first(seed, index);
        if first < n { (n - 1 - first) / self.stride() + 1 } else { 0 }
    }

    /// Entries kept in a chunk of `len` elements.
    fn kept(&self, len: usize) -> usize {
        if len == 0 {
            return 0;
        }
        (len * self.k as usize).div_ceil(self.chunk as usize).clamp(1, len)
    }

    /// The chunks of a tensor of `n` elements: (start, length).
    fn chunks(&self, n: usize) -> impl Iterator<Item = (usize, usize)> {
        let c = self.chunk as usize;
        (0..n.div_ceil(c)).map(move |i| (i * c, c.min(n - i * c)))
    }

    /// Full chunks of a tensor of `n` elements, and the last one's length (0: none).
    fn split(&self, n: usize) -> (usize, usize) {
        let c = self.chunk as usize;
        (n / c, n % c)
    }

    /// Entries kept in a tensor of `n` elements.
    pub fn kept_in(&self, n: usize) -> usize {
        let (full, last) = self.split(n);
        full * self.kept(self.chunk as usize) + self.kept(last)
    }

    /// Packed bits of one chunk of `len` elements.
    fn chunk_bits(&self, len: usize) -> usize {
        self.kept(len) * (offset_bits(len) + usize::from(self.bits))
    }

    fn tensor_bits(&self, n: usize) -> usize {
        let (full, last) = self.split(n);
        full * self.chunk_bits(self.chunk as usize) + self.chunk_bits(last)
    }

    /// The packed bits of tensor `index` of `n` elements in a message seeded `seed`.
    fn bits_of(&self, n: usize, seed: u64, index: usize) -> usize {
        if self.strided { self.strided_in(n, seed, index) * usize::from(self.bits) } else { self.tensor_bits(n) }
    }

    /// The exact byte length of a message seeded `seed`.
    fn seeded_len(&self, sizes: &[usize], seed: u64) -> usize {
        HEADER
            + sizes
                .iter()
                .enumerate()
                .map(|(i, n)| 4 + 2 * self.table_len() + self.bits_of(*n, seed, i).div_ceil(8))
                .sum::<usize>()
    }

    /// bf16 values in a tensor's table: the bins' means, or at 8 bits (mean, step).
    fn table_len(&self) -> usize {
        if self.bits >= 8 { 2 } else { 1 << self.bits }
    }

    /// The byte length of a message for tensors of `sizes` elements: exact for
    /// top-k layouts; for strided ones the largest over the rounds (a tensor keeps
    /// one entry more or fewer depending on where its stride starts).
    pub fn encoded_len(&self, sizes: &[usize]) -> usize {
        if self.strided {
            let stride = self.stride();
            // the longest: every tensor starting at 0
            HEADER
                + sizes
                    .iter()
                    .map(|n| 4 + 2 * self.table_len() + (n.div_ceil(stride) * usize::from(self.bits)).div_ceil(8))
                    .sum::<usize>()
        } else {
            self.seeded_len(sizes, 0)
        }
    }
}

/// Bits that address an offset in a chunk of `len` elements.
fn offset_bits(len: usize) -> usize {
    if len <= 1 { 0 } else { (usize::BITS - (len - 1).leading_zeros()) as usize }
}

/// A sparse run's settings, as its manifest records them: the workers' layout,
/// their error-feedback decay, and the layout of the shepherd's update (top-k
/// runs: `down_k` entries per chunk; strided runs: the workers' stride), at
/// `down_bits`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Settings {
    /// What workers send.
    pub up: Layout,
    /// Workers' error-feedback decay, in thousandths (950: 0.95).
    pub decay_milli: u16,
    /// Entries per chunk of the shepherd's update (top-k runs).
    pub down_k: u32,
    /// Bits per value of the shepherd's update.
    pub down_bits: u8,
}

impl Default for Settings {
    /// chunk 64, k 4 (6.2% of the entries), 2 bits, decay 0.5, update k 8 at 4
    /// bits: chosen by measurement (the tables in docs/diloco.md). Against SparseLoCo's
    /// chunk 4096 and k 64, 64-element chunks halve the offset bits (6 instead of
    /// 12), which buys twice the density for the same bytes. k 4 sends 61× fewer
    /// bytes than fp32 and ended level with it on both measured runs (the main job
    /// −0.3%, a 6-round shaped-link run +0.1 to +0.9%); k 2 sends 115× fewer but
    /// ended 1.0% and 3.0% behind, so it is the opt-in (`sparse:k=2`).
    /// Decay 0.5 instead of 0.95: DiLoCo's workers restart every round from the
    /// shared parameters, so what a round did not send is found again by the
    /// next one; an error feedback that keeps it for long counts it twice.
    fn default() -> Self {
        Self { up: Layout { chunk: 64, k: 4, bits: 2, strided: false }, decay_milli: 500, down_k: 8, down_bits: 4 }
    }
}

impl Settings {
    /// The workers' error-feedback decay.
    pub fn decay(&self) -> f32 {
        f32::from(self.decay_milli) / 1000.0
    }

    /// What the shepherd's update is laid out as: the workers' chunks with `down_k`
    /// entries each (strided: the workers' stride), at `down_bits`.
    pub fn down(&self) -> Layout {
        let k = if self.up.strided { self.up.k } else { self.down_k };
        Layout { chunk: self.up.chunk, k, bits: self.down_bits, strided: self.up.strided }
    }

    /// The canonical spelling, as in the manifest:
    /// `sparse:chunk=4096,k=64,bits=2,decay=0.95,down=256,downbits=8` (strided
    /// layouts add `select=stride`).
    pub fn spec(&self) -> String {
        let select = if self.up.strided { ",select=stride" } else { "" };
        format!(
            "sparse:chunk={},k={},bits={},decay={},down={},downbits={}{select}",
            self.up.chunk,
            self.up.k,
            self.up.bits,
            self.decay(),
            self.down_k,
            self.down_bits,
        )
    }

    /// Parses `sparse` (the defaults) or `sparse:` followed by any of
    /// `chunk=N`, `k=N`, `bits=1|2|4|8`, `decay=F` (0 to 1), `down=N`,
    /// `downbits=1|2|4|8` and `select=top|stride`, comma-separated;
    /// `stride=S` is `select=stride,chunk=S,k=1`.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut s = Self::default();
        let rest = match spec.strip_prefix("sparse") {
            Some("") => return Ok(s),
            Some(rest) => rest.strip_prefix(':').ok_or_else(|| format!("{spec:?} is not sparse[:key=value,…]"))?,
            None => return Err(format!("{spec:?} is not a sparse encoding")),
        };
        for part in rest.split(',').filter(|p| !p.is_empty()) {
            let (key, value) = part.split_once('=').ok_or_else(|| format!("{part:?} is not key=value"))?;
            let int = || value.parse::<u32>().map_err(|_| format!("{key}={value:?} is not a whole number"));
            let bits = || u8::try_from(int()?).map_err(|_| format!("{key}={value} is not 1, 2, 4 or 8"));
            match key {
                "chunk" => s.up.chunk = int()?,
                "k" => s.up.k = int()?,
                "bits" => s.up.bits = bits()?,
                "down" => s.down_k = int()?,
                "downbits" => s.down_bits = bits()?,
                "stride" => {
                    s.up.strided = true;
                    s.up.chunk = int()?;
                    s.up.k = 1;
                }
                "select" => {
                    s.up.strided = match value {
                        "top" => false,
                        "stride" => true,
                        other => return Err(format!("select={other:?} is not top or stride")),
                    }
                }
                "decay" => {
                    let d: f64 = value.parse().map_err(|_| format!("decay={value:?} is not a number"))?;
                    if !(0.0..=1.0).contains(&d) {
                        return Err(format!("decay={value} is outside 0..=1"));
                    }
                    s.decay_milli = (d * 1000.0).round() as u16;
                }
                other => {
                    return Err(format!(
                        "unknown sparse setting {other:?} (chunk, k, bits, decay, down, downbits, select, stride)"
                    ));
                }
            }
        }
        s.up.check()?;
        s.down().check().map_err(|e| format!("down: {e}"))?;
        Ok(s)
    }
}

/// One tensor's kept entries: increasing indices into the flat tensor, and values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SparseTensor {
    /// Flat indices, strictly increasing.
    pub indices: Vec<u32>,
    /// The decoded values at those indices.
    pub values: Vec<f32>,
}

/// A decoded sparse message: one [`SparseTensor`] per parameter tensor.
pub type SparseTensors = Vec<SparseTensor>;

/// Why bytes did not decode as a sparse message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not a pcp sparse message.
    #[error("bad magic or version (not a pcp sparse message)")]
    Magic,
    /// The message's layout is not the run's.
    #[error("layout chunk {chunk}, k {k}, {bits} bits; the run uses chunk {want_chunk}, k {want_k}, {want_bits} bits")]
    Layout {
        /// From the header.
        chunk: u32,
        /// From the header.
        k: u32,
        /// From the header.
        bits: u8,
        /// Expected.
        want_chunk: u32,
        /// Expected.
        want_k: u32,
        /// Expected.
        want_bits: u8,
    },
    /// The tensor count or a tensor's size differs from the parameters'.
    #[error("expected {expected} elements in tensor {index}, header says {got}")]
    Size {
        /// Which tensor (`usize::MAX`: the count).
        index: usize,
        /// From the header.
        got: usize,
        /// Expected.
        expected: usize,
    },
    /// Seeded for another round.
    #[error("seeded {got}, expected {expected} (a message for another round)")]
    Seed {
        /// From the header.
        got: u64,
        /// Expected.
        expected: u64,
    },
    /// Fewer or more bytes than the layout implies.
    #[error("{got} bytes; the layout implies {expected}")]
    Length {
        /// Received.
        got: usize,
        /// Implied by the sizes and the layout.
        expected: usize,
    },
    /// An offset outside its chunk, or not above the previous one.
    #[error("tensor {index}: offset {offset} in a chunk of {len} is out of range or out of order")]
    Offset {
        /// Which tensor.
        index: usize,
        /// The offset read.
        offset: usize,
        /// The chunk's length.
        len: usize,
    },
}

/// Encodes the chunked top-k of `tensors` (seed 0); returns the bytes and exactly
/// what a receiver decodes from them.
pub fn encode(tensors: &Tensors, layout: Layout) -> (Vec<u8>, SparseTensors) {
    encode_seeded(tensors, layout, 0)
}

/// Where a message's seed is: after the magic, version, chunk, k, bits and strided.
const SEED_AT: usize = 4 + 1 + 4 + 4 + 1 + 1;

/// Rebinds a top-k message to `seed` (another round), as [`encode_seeded`] with that
/// seed would have written it: a top-k layout's entries do not depend on the seed.
/// Returns `false`, leaving `bytes` alone, for a strided layout (whose entries it
/// places) or bytes too short to be a message. For load tests, which send the same
/// synthetic pseudo-gradient round after round.
pub fn reseed(bytes: &mut [u8], seed: u64) -> bool {
    if bytes.len() < HEADER || &bytes[..4] != MAGIC || bytes[SEED_AT - 1] != 0 {
        return false;
    }
    bytes[SEED_AT..SEED_AT + 8].copy_from_slice(&seed.to_le_bytes());
    true
}

/// Encodes what `layout` keeps of `tensors` in a message seeded `seed` (the
/// round: it places a strided layout's entries and binds the message to it).
pub fn encode_seeded(tensors: &Tensors, layout: Layout, seed: u64) -> (Vec<u8>, SparseTensors) {
    encode_seeded_on(tensors, layout, seed, 1)
}

/// The statistical quantizer: what is stored (the bins' means, or at 8 bits the
/// mean and step), the decoding table of all 2^bits bins, and each value's bin.
fn quantize(values: &[f32], bits: u8) -> (Vec<f32>, Vec<f32>, Vec<u8>) {
    let bins = 1usize << bits;
    if values.is_empty() {
        let stored = vec![0.0; Layout { chunk: 1, k: 1, bits, strided: false }.table_len()];
        let table = decoding_table(&stored, bits);
        return (stored, table, Vec::new());
    }
    let n = values.len() as f64;
    let mean = values.iter().map(|v| f64::from(*v)).sum::<f64>() / n;
    let var = if values.len() > 1 {
        values.iter().map(|v| (f64::from(*v) - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    let mut scale = range_sigmas(bits) * var.sqrt() / bins as f64;
    if !(scale.is_finite() && scale > 0.0) {
        scale = 1.0;
    }
    let offset = (bins / 2) as f64;
    let codes: Vec<u8> = values
        .iter()
        .map(|v| {
            if bits == 1 {
                // two bins split at the mean: below and above
                return u8::from(f64::from(*v) >= mean);
            }
            let q = ((f64::from(*v) - mean) / scale + offset).round();
            // NaN casts to 0: a non-finite input decodes to the non-finite table
            q.clamp(0.0, (bins - 1) as f64) as u8
        })
        .collect();
    let stored = if bits >= 8 {
        vec![mean as f32, scale as f32]
    } else {
        let mut sums = vec![0.0f64; bins];
        let mut counts = vec![0u64; bins];
        for (v, c) in values.iter().zip(&codes) {
            sums[usize::from(*c)] += f64::from(*v) - mean;
            counts[usize::from(*c)] += 1;
        }
        sums.iter().zip(&counts).map(|(s, c)| (mean + s / (*c).max(1) as f64) as f32).collect()
    };
    // the table travels as bf16: both ends decode from the rounded values
    let stored: Vec<f32> = stored.iter().map(|v| from_bf16(to_bf16(*v))).collect();
    let table = decoding_table(&stored, bits);
    (stored, table, codes)
}

/// Every bin's value, from what a message stores for a tensor: at 8 bits the bin
/// centres `mean + (code − 128) × step` (computed in f32, as both ends do).
fn decoding_table(stored: &[f32], bits: u8) -> Vec<f32> {
    if bits >= 8 {
        let (mean, step) = (stored[0], stored[1]);
        (0..256).map(|code| mean + (code as f32 - 128.0) * step).collect()
    } else {
        stored.to_vec()
    }
}

/// Decodes a message seeded 0 that must hold tensors of exactly `sizes` elements
/// in `layout`.
pub fn decode(bytes: &[u8], sizes: &[usize], layout: Layout) -> Result<SparseTensors, DecodeError> {
    decode_seeded(bytes, sizes, layout, 0)
}

/// Decodes a message that must be seeded `seed` (its round) and hold tensors of
/// exactly `sizes` elements in `layout`.
pub fn decode_seeded(bytes: &[u8], sizes: &[usize], layout: Layout, seed: u64) -> Result<SparseTensors, DecodeError> {
    Ok(Packed::check(bytes, sizes, layout, seed)?.unpack())
}

/// A sparse message checked and measured without being unpacked: what the
/// shepherd keeps of a contribution. [`Packed::check`] reads it once (every
/// check of [`decode_seeded`], plus its L2 norm and whether a kept value is not
/// finite, from a histogram of each tensor's codes), and [`Packed::add_to`]
/// reads it again straight into a dense sum, on several threads if asked: no
/// index or value array is ever built (8 bytes a kept entry against the
/// message's 1 to 3).
#[derive(Clone, Debug, PartialEq)]
pub struct Packed {
    bytes: Vec<u8>,
    layout: Layout,
    seed: u64,
    tensors: Vec<PackedTensor>,
    norm: f64,
    /// The first tensor with a kept value that is not finite.
    non_finite: Option<usize>,
}

#[derive(Clone, Debug, PartialEq)]
struct PackedTensor {
    /// Elements.
    n: usize,
    /// Where its packed bits start, in bytes.
    at: usize,
    /// Every code's value.
    table: Vec<f32>,
    /// How many kept entries hold each code.
    counts: Vec<u64>,
}

/// Tensors at least this large are added on several threads.
const PARALLEL_ELEMENTS: usize = 1 << 20;

impl Packed {
    /// Checks a message that must be seeded `seed` and hold tensors of exactly
    /// `sizes` elements in `layout`, as [`decode_seeded`] does, and keeps it.
    pub fn check(bytes: &[u8], sizes: &[usize], layout: Layout, seed: u64) -> Result<Self, DecodeError> {
        if bytes.len() < HEADER || &bytes[..4] != MAGIC || bytes[4] != VERSION {
            return Err(DecodeError::Magic);
        }
        let u32_at = |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        let (chunk, k, bits, strided) = (u32_at(5), u32_at(9), bytes[13], bytes[14]);
        let mut got_seed = [0u8; 8];
        got_seed.copy_from_slice(&bytes[15..23]);
        let got_seed = u64::from_le_bytes(got_seed);
        if got_seed != seed {
            return Err(DecodeError::Seed { got: got_seed, expected: seed });
        }
        if (chunk, k, bits, strided) != (layout.chunk, layout.k, layout.bits, u8::from(layout.strided)) {
            return Err(DecodeError::Layout {
                chunk,
                k,
                bits,
                want_chunk: layout.chunk,
                want_k: layout.k,
                want_bits: layout.bits,
            });
        }
        let count = u32_at(23) as usize;
        if count != sizes.len() {
            return Err(DecodeError::Size { index: usize::MAX, got: count, expected: sizes.len() });
        }
        let expected = layout.seeded_len(sizes, seed);
        if bytes.len() != expected {
            return Err(DecodeError::Length { got: bytes.len(), expected });
        }
        let mut at = HEADER;
        let mut tensors = Vec::with_capacity(sizes.len());
        let (mut norm, mut non_finite) = (0.0f64, None);
        let mut counts = vec![0u64; 1 << bits];
        for (index, n) in sizes.iter().copied().enumerate() {
            let got = u32_at(at) as usize;
            if got != n {
                return Err(DecodeError::Size { index, got, expected: n });
            }
            at += 4;
            let stored: Vec<f32> = bytes[at..at + 2 * layout.table_len()]
                .chunks_exact(2)
                .map(|c| from_bf16(u16::from_le_bytes([c[0], c[1]])))
                .collect();
            at += stored.len() * 2;
            let mut t = PackedTensor { n, at, table: decoding_table(&stored, bits), counts: Vec::new() };
            at += layout.bits_of(n, seed, index).div_ceil(8);
            counts.iter_mut().for_each(|c| *c = 0);
            // strided: the kept entries, which a stride starting late leaves one fewer
            let chunks = if layout.strided {
                layout.strided_in(n, seed, index)
            } else {
                layout.split(n).0 + usize::from(layout.split(n).1 > 0)
            };
            blocked::count_codes(bytes, layout, seed, index, &t, chunks, &mut counts)?;
            for (c, v) in counts.iter().zip(&t.table) {
                if *c > 0 {
                    if !v.is_finite() {
                        non_finite = non_finite.or(Some(index));
                    }
                    norm += *c as f64 * f64::from(*v) * f64::from(*v);
                }
            }
            t.counts = counts.clone();
            tensors.push(t);
        }
        Ok(Self { bytes: bytes.to_vec(), layout, seed, tensors, norm: norm.sqrt(), non_finite })
    }

    /// The elements of every tensor.
    pub fn sizes(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        self.tensors.iter().map(|t| t.n)
    }

    /// The L2 norm of the kept values.
    pub fn norm(&self) -> f64 {
        self.norm
    }

    /// The first tensor with a kept value that is NaN or infinite.
    pub fn non_finite(&self) -> Option<usize> {
        self.non_finite
    }

    /// Each tensor's L2 norm and largest kept magnitude, from its codes' counts.
    pub fn tensor_stats(&self) -> Vec<(f64, f32)> {
        self.tensors
            .iter()
            .map(|t| {
                let kept = t.counts.iter().zip(&t.table).filter(|(c, _)| **c > 0);
                let norm = kept.clone().map(|(c, v)| *c as f64 * f64::from(*v).powi(2)).sum::<f64>().sqrt();
                (norm, kept.map(|(_, v)| v.abs()).fold(0.0f32, f32::max))
            })
            .collect()
    }

    /// The message with every kept value of tensor t clipped to ±`clips[t]` and
    /// then multiplied by `scales[t]`: every value comes from its tensor's table
    /// of 2^bits codes, so this rewrites the tables, not the entries. Returns the
    /// bounded message and how many kept entries the clip changed.
    pub fn bounded(&self, scales: &[f32], clips: &[f32]) -> (Self, u64) {
        let mut out = self.clone();
        let mut clipped = 0u64;
        let mut norm = 0.0f64;
        for (t, (scale, clip)) in out.tensors.iter_mut().zip(scales.iter().zip(clips)) {
            for (v, c) in t.table.iter_mut().zip(&t.counts) {
                if v.abs() > *clip {
                    clipped += *c;
                    *v = v.signum() * *clip;
                }
                *v *= *scale;
                norm += *c as f64 * f64::from(*v).powi(2);
            }
        }
        out.norm = norm.sqrt();
        (out, clipped)
    }

    /// The kept entries, as [`decode_seeded`] returns them.
    pub fn unpack(&self) -> SparseTensors {
        self.tensors
            .iter()
            .enumerate()
            .map(|(index, t)| {
                let kept = if self.layout.strided {
                    self.layout.strided_in(t.n, self.seed, index)
                } else {
                    self.layout.kept_in(t.n)
                };
                let mut out = SparseTensor { indices: Vec::with_capacity(kept), values: Vec::with_capacity(kept) };
                // checked when it was made: visiting cannot fail
                let _ = visit(&self.bytes, self.layout, self.seed, index, t, 0..self.chunks(index), |i, code| {
                    out.indices.push(i as u32);
                    out.values.push(t.table[code]);
                });
                out
            })
            .collect()
    }

    /// Calls `f(tensor, flat index, value)` for every kept entry, in order, without
    /// unpacking, in the tensors of the range `tensors`.
    pub fn for_each_kept(&self, tensors: std::ops::Range<usize>, mut f: impl FnMut(usize, usize, f32)) {
        for (index, t) in self.tensors.iter().enumerate().take(tensors.end).skip(tensors.start) {
            // checked when it was made: visiting cannot fail
            let _ = visit(&self.bytes, self.layout, self.seed, index, t, 0..self.chunks(index), |i, code| {
                f(index, i, t.table[code]);
            });
        }
    }

    /// Chunks (strided: kept entries) of tensor `index`, the unit of a range.
    fn chunks(&self, index: usize) -> usize {
        let n = self.tensors[index].n;
        if self.layout.strided {
            self.layout.strided_in(n, self.seed, index)
        } else {
            let (full, last) = self.layout.split(n);
            full + usize::from(last > 0)
        }
    }

    /// Adds `weight` × the kept values to `sum` (tensors of the checked sizes),
    /// splitting large tensors into `threads` ranges added at once. Each element
    /// gets the same additions in the same order whatever the threads: this is
    /// [`add_batch`] of this message alone.
    pub fn add_to(&self, sum: &mut Tensors, weight: f32, threads: usize) {
        add_batch(sum, &[(self, weight)], threads);
    }

    /// The bytes the message holds (what a batch of messages costs in memory).
    pub fn len_bytes(&self) -> usize {
        self.bytes.len()
    }
}

/// Calls `f(flat index, code)` for the kept entries of chunks (strided: of kept
/// entries) `range` of tensor `index`, checking that offsets are in their chunk
/// and increasing.
fn visit(
    bytes: &[u8],
    layout: Layout,
    seed: u64,
    index: usize,
    t: &PackedTensor,
    range: std::ops::Range<usize>,
    mut f: impl FnMut(usize, usize),
) -> Result<(), DecodeError> {
    let bits = usize::from(layout.bits);
    let packed = layout.bits_of(t.n, seed, index).div_ceil(8);
    let body = &bytes[t.at..t.at + packed];
    if layout.strided {
        let (first, stride) = (layout.first(seed, index), layout.stride());
        let mut reader = BitReader::at_bit(body, range.start * bits);
        for e in range {
            f(first + e * stride, reader.get(bits) as usize);
        }
        return Ok(());
    }
    let c = layout.chunk as usize;
    let (full, last) = layout.split(t.n);
    let (keep, width) = (layout.kept(c), offset_bits(c));
    let mut reader = BitReader::at_bit(body, range.start.min(full) * layout.chunk_bits(c));
    let mut offsets = [0usize; 64];
    let narrow = layout.chunk_bits(c);
    if narrow <= 56 && keep > 0 {
        // a full chunk fits the accumulator: one refill check a chunk, then shifts
        let (wmask, bmask) = ((1u64 << width) - 1, (1u64 << bits) - 1);
        for chunk in range.start.min(full)..range.end.min(full) {
            let mut word = reader.take(narrow);
            let start = chunk * c;
            let mut previous = None;
            for slot in offsets.iter_mut().take(keep) {
                let offset = (word & wmask) as usize;
                word >>= width;
                if offset >= c || previous.is_some_and(|p| offset <= p) {
                    return Err(DecodeError::Offset { index, offset, len: c });
                }
                previous = Some(offset);
                *slot = offset;
            }
            for offset in &offsets[..keep] {
                f(start + offset, (word & bmask) as usize);
                word >>= bits;
            }
        }
        if range.end <= full {
            return Ok(());
        }
    }
    let range = if narrow <= 56 && keep > 0 { range.start.max(full)..range.end } else { range };
    for chunk in range {
        let (len, keep, width) =
            if chunk < full { (c, keep, width) } else { (last, layout.kept(last), offset_bits(last)) };
        let start = chunk * c;
        if keep <= offsets.len() {
            // offsets first, then codes: read the offsets into a small buffer
            let mut previous = None;
            for slot in offsets.iter_mut().take(keep) {
                let offset = reader.get(width) as usize;
                if offset >= len || previous.is_some_and(|p| offset <= p) {
                    return Err(DecodeError::Offset { index, offset, len });
                }
                previous = Some(offset);
                *slot = offset;
            }
            for offset in &offsets[..keep] {
                f(start + offset, reader.get(bits) as usize);
            }
        } else {
            // a wide chunk: read its offsets, then come back for the codes
            let mut codes = reader.clone();
            codes.skip(keep * width);
            let mut previous = None;
            for _ in 0..keep {
                let offset = reader.get(width) as usize;
                if offset >= len || previous.is_some_and(|p| offset <= p) {
                    return Err(DecodeError::Offset { index, offset, len });
                }
                previous = Some(offset);
                f(start + offset, codes.get(bits) as usize);
            }
            reader = codes;
        }
    }
    Ok(())
}

/// Subtracts `sparse` × `scale` from `dense` (θ ← θ − scale·Δ̂, or e ← e − Δ̂).
pub fn subtract(dense: &mut Tensors, sparse: &SparseTensors, scale: f32) {
    for (d, s) in dense.iter_mut().zip(sparse) {
        for (i, v) in s.indices.iter().zip(&s.values) {
            d[*i as usize] -= scale * v;
        }
    }
}

/// The error-feedback buffer of SparseLoCo: `e ← decay·e + Δ`, send the chunked
/// top-k of `e`, `e ← e − decode(sent)`. Workers decay it by 0.95 (the reference
/// code's default); the shepherd, re-sparsifying the aggregate, by 1 (nothing is
/// lost, only delayed).
#[derive(Clone, Debug, PartialEq)]
pub struct ErrorFeedback {
    /// The buffer, one tensor per parameter.
    pub buffer: Tensors,
    /// Multiplies the buffer before each new Δ is added.
    pub decay: f32,
    /// The layout of what is sent.
    pub layout: Layout,
}

impl ErrorFeedback {
    /// A zero buffer for tensors of `sizes` elements.
    pub fn new(sizes: &[usize], decay: f32, layout: Layout) -> Self {
        Self { buffer: sizes.iter().map(|n| vec![0.0; *n]).collect(), decay, layout }
    }

    /// Adds `delta` × `scale` to the decayed buffer and takes out what is sent: the
    /// message (seeded 0) and its decoded form.
    pub fn compress(&mut self, delta: &Tensors, scale: f32) -> (Vec<u8>, SparseTensors) {
        self.compress_seeded(delta, scale, 0)
    }

    /// [`ErrorFeedback::compress`] in a message seeded `seed` (the round).
    ///
    /// A tensor `delta` leaves empty (a Streaming DiLoCo fragment's round carries
    /// only its fragment's tensors) is left alone: its buffer neither decays nor
    /// drains, and the message carries it empty.
    pub fn compress_seeded(&mut self, delta: &Tensors, scale: f32, seed: u64) -> (Vec<u8>, SparseTensors) {
        self.compress_seeded_on(delta, scale, seed, 1)
    }

    /// [`ErrorFeedback::compress_seeded`] on `threads` threads (the same message
    /// and buffer on any number).
    pub fn compress_seeded_on(
        &mut self,
        delta: &Tensors,
        scale: f32,
        seed: u64,
        threads: usize,
    ) -> (Vec<u8>, SparseTensors) {
        let decay = self.decay;
        let update = |buffer: &mut [Vec<f32>], delta: &[Vec<f32>]| {
            for (e, d) in buffer.iter_mut().zip(delta) {
                for (e, d) in e.iter_mut().zip(d) {
                    *e = decay * *e + scale * d;
                }
            }
        };
        let sizes: Vec<usize> = self.buffer.iter().map(Vec::len).collect();
        let groups = groups(&sizes, threads);
        if groups.len() <= 1 {
            update(&mut self.buffer, delta);
        } else {
            std::thread::scope(|scope| {
                let mut rest: &mut [Vec<f32>] = &mut self.buffer;
                let mut at = 0;
                for range in groups {
                    let (mine, tail) = rest.split_at_mut(range.end - at);
                    rest = tail;
                    at = range.end;
                    let delta = delta.get(range).unwrap_or_default();
                    scope.spawn(move || update(mine, delta));
                }
            });
        }
        let masked = delta.iter().zip(&self.buffer).any(|(d, e)| d.is_empty() && !e.is_empty());
        let (bytes, sent) = if masked {
            let view: Tensors =
                self.buffer.iter().zip(delta).map(|(e, d)| if d.is_empty() { Vec::new() } else { e.clone() }).collect();
            encode_seeded_on(&view, self.layout, seed, threads)
        } else {
            encode_seeded_on(&self.buffer, self.layout, seed, threads)
        };
        subtract(&mut self.buffer, &sent, 1.0);
        (bytes, sent)
    }
}

/// Writes bits LSB-first into a byte vector.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    filled: usize,
}

impl<'a> BitWriter<'a> {
    fn new(out: &'a mut Vec<u8>) -> Self {
        Self { out, acc: 0, filled: 0 }
    }

    /// Appends the low `width` (at most 32) bits of `value`.
    fn put(&mut self, value: u64, width: usize) {
        if width == 0 {
            return;
        }
        self.acc |= (value & ((1u64 << width) - 1)) << self.filled;
        self.filled += width;
        while self.filled >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.filled -= 8;
        }
    }

    fn finish(self) {
        if self.filled > 0 {
            self.out.push(self.acc as u8);
        }
    }
}

/// Reads bits LSB-first; past the end it reads zeros (the length was checked).
/// It refills a 64-bit accumulator up to 8 bytes at a time, so a read is a few
/// shifts and masks rather than a loop over bytes.
#[derive(Clone)]
struct BitReader<'a> {
    bytes: &'a [u8],
    at: usize,
    acc: u64,
    filled: usize,
}

impl<'a> BitReader<'a> {
    /// A reader starting `bit` bits into `bytes`.
    fn at_bit(bytes: &'a [u8], bit: usize) -> Self {
        let mut r = Self { bytes, at: bit / 8, acc: 0, filled: 0 };
        r.get(bit % 8);
        r
    }

    /// Skips `n` bits.
    fn skip(&mut self, mut n: usize) {
        while n >= 32 {
            self.get(32);
            n -= 32;
        }
        self.get(n);
    }

    /// Tops the accumulator up to at least 57 bits (zeros past the end).
    #[inline]
    fn refill(&mut self) {
        let word = match self.bytes.get(self.at..self.at + 8) {
            Some(w) => {
                let mut b = [0u8; 8];
                b.copy_from_slice(w);
                u64::from_le_bytes(b)
            }
            None => {
                let mut b = [0u8; 8];
                let tail = self.bytes.get(self.at..).unwrap_or(&[]);
                b[..tail.len()].copy_from_slice(tail);
                u64::from_le_bytes(b)
            }
        };
        // whole bytes that fit above the bits held
        let take = (64 - self.filled) / 8;
        let fresh = if take == 8 { word } else { word & ((1u64 << (take * 8)) - 1) };
        self.acc |= fresh << self.filled;
        self.at += take;
        self.filled += take * 8;
    }

    /// The next `width` bits (at most 56), as the low bits of a word.
    #[inline]
    fn take(&mut self, width: usize) -> u64 {
        if self.filled < width {
            self.refill();
        }
        let v = self.acc & ((1u64 << width) - 1);
        self.acc = self.acc.checked_shr(width as u32).unwrap_or(0);
        self.filled -= width;
        v
    }

    /// The next `width` bits (at most 32).
    #[inline]
    fn get(&mut self, width: usize) -> u64 {
        if width == 0 {
            return 0;
        }
        if self.filled < width {
            self.refill();
        }
        let v = self.acc & ((1u64 << width) - 1);
        self.acc >>= width;
        self.filled -= width;
        v
    }
}

#[cfg(test)]
mod tests;
