//! Verified streaming with blake3 subtree hashing. A blob is cut into [`CHUNK_SIZE`]
//! chunks; each chunk is a complete subtree of the blob's blake3 tree, so its chaining
//! value can be checked on its own. The list of chunk chaining values (the outboard)
//! is checked once by merging it up to the root, which must equal the blob's content id.

use blake3::hazmat::{ChainingValue, HasherExt, Mode, left_subtree_len, merge_subtrees_non_root, merge_subtrees_root};
use pcp_protocol::BlobHash;
use pcp_schema::{CHUNK_SIZE, chunk_count};

const CHUNK: u64 = CHUNK_SIZE as u64;

/// A blob's size and the chaining value of each chunk. For a single-chunk blob the only
/// entry is the root hash itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outboard {
    /// Blob size in bytes.
    pub size: u64,
    /// One entry per chunk.
    pub cvs: Vec<ChainingValue>,
}

/// Number of bytes of chunk `index` in a blob of `size` bytes.
pub fn chunk_len(size: u64, index: u32) -> usize {
    let start = u64::from(index) * CHUNK;
    size.saturating_sub(start).min(CHUNK) as usize
}

/// The chaining value of chunk `index` of a blob of `size` bytes.
pub fn chunk_cv(size: u64, index: u32, data: &[u8]) -> ChainingValue {
    if chunk_count(size) == 1 {
        return *blake3::hash(data).as_bytes();
    }
    let mut hasher = blake3::Hasher::new();
    hasher.set_input_offset(u64::from(index) * CHUNK);
    hasher.update(data);
    hasher.finalize_non_root()
}

fn subtree(cvs: &[ChainingValue], first: usize, len: u64) -> ChainingValue {
    if len <= CHUNK {
        return cvs[first];
    }
    let left = left_subtree_len(len);
    let l = subtree(cvs, first, left);
    let r = subtree(cvs, first + (left / CHUNK) as usize, len - left);
    merge_subtrees_non_root(&l, &r, Mode::Hash)
}

impl Outboard {
    /// The root hash the chaining values merge to, or `None` when their count does not
    /// match the size.
    pub fn root(&self) -> Option<BlobHash> {
        if self.cvs.len() as u64 != chunk_count(self.size) {
            return None;
        }
        if self.size <= CHUNK {
            return Some(BlobHash(self.cvs[0]));
        }
        let left = left_subtree_len(self.size);
        let l = subtree(&self.cvs, 0, left);
        let r = subtree(&self.cvs, (left / CHUNK) as usize, self.size - left);
        Some(merge_subtrees_root(&l, &r, Mode::Hash).into())
    }

    /// Number of chunks.
    pub fn chunks(&self) -> u32 {
        u32::try_from(self.cvs.len()).unwrap_or(u32::MAX)
    }

    /// Whether `data` is exactly chunk `index`.
    pub fn verify_chunk(&self, index: u32, data: &[u8]) -> bool {
        let Some(expected) = self.cvs.get(index as usize) else {
            return false;
        };
        data.len() == chunk_len(self.size, index) && chunk_cv(self.size, index, data) == *expected
    }
}

/// Builds outboards chunk by chunk.
#[derive(Debug)]
pub struct OutboardBuilder {
    size: u64,
    cvs: Vec<ChainingValue>,
}

impl OutboardBuilder {
    /// For a blob of `size` bytes.
    pub fn new(size: u64) -> Self {
        Self { size, cvs: Vec::with_capacity(chunk_count(size) as usize) }
    }

    /// Adds the next chunk.
    pub fn push(&mut self, data: &[u8]) {
        let index = u32::try_from(self.cvs.len()).unwrap_or(u32::MAX);
        self.cvs.push(chunk_cv(self.size, index, data));
    }

    /// The outboard and the blob's content id.
    pub fn finish(self) -> Option<(Outboard, BlobHash)> {
        let outboard = Outboard { size: self.size, cvs: self.cvs };
        let root = outboard.root()?;
        Some((outboard, root))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outboard(data: &[u8]) -> (Outboard, BlobHash) {
        let mut b = OutboardBuilder::new(data.len() as u64);
        if data.is_empty() {
            b.push(data);
        }
        for c in data.chunks(CHUNK_SIZE) {
            b.push(c);
        }
        b.finish().expect("chunk count matches size")
    }

    #[test]
    fn root_equals_blake3_for_many_sizes() {
        let data: Vec<u8> = (0..(5 * CHUNK_SIZE + 3)).map(|i| (i * 7 % 251) as u8).collect();
        for len in [
            0,
            1,
            CHUNK_SIZE - 1,
            CHUNK_SIZE,
            CHUNK_SIZE + 1,
            2 * CHUNK_SIZE,
            3 * CHUNK_SIZE + 17,
            4 * CHUNK_SIZE,
            5 * CHUNK_SIZE + 3,
        ] {
            let (ob, root) = outboard(&data[..len]);
            assert_eq!(root, BlobHash::of(&data[..len]), "len {len}");
            for (i, c) in (0..).zip(data[..len].chunks(CHUNK_SIZE)) {
                assert!(ob.verify_chunk(i, c));
            }
        }
    }

    #[test]
    fn tampered_chunk_or_outboard_is_detected() {
        let data: Vec<u8> = (0..3 * CHUNK_SIZE).map(|i| (i % 251) as u8).collect();
        let (mut ob, root) = outboard(&data);
        let mut chunk = data[CHUNK_SIZE..2 * CHUNK_SIZE].to_vec();
        chunk[100] ^= 1;
        assert!(!ob.verify_chunk(1, &chunk));
        assert!(!ob.verify_chunk(1, &data[..CHUNK_SIZE]), "chunk 0 is not chunk 1");
        assert!(!ob.verify_chunk(7, &data[..CHUNK_SIZE]), "out of range");
        ob.cvs[2][0] ^= 1;
        assert_ne!(ob.root(), Some(root));
        ob.cvs.pop();
        assert_eq!(ob.root(), None);
    }
}
