//! Token streams: tokenized text in memory, or `u16` `.bin` files through mmap.

use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::vocab::{EncodeError, Vocab};

/// The magic number of llm.c's token files.
const LLMC_MAGIC: i32 = 20_240_520;
/// The llm.c file version whose tokens are `u16`.
const LLMC_VERSION: i32 = 1;
/// llm.c's header: 256 little-endian `i32`s.
const LLMC_HEADER_BYTES: usize = 256 * 4;

/// The layout of a `.bin` token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TokenFormat {
    /// nanoGPT: raw little-endian `u16` tokens, no header.
    NanoGpt,
    /// llm.c: a header of 256 `i32`s (magic 20240520, version 1, token
    /// count, ...) followed by little-endian `u16` tokens.
    LlmC,
    /// llm.c if the file starts with llm.c's magic number, nanoGPT otherwise.
    Detect,
}

/// Why a token file could not be opened.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TokenFileError {
    /// Opening or mapping the file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The token file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The token data has an odd number of bytes.
    #[error("{}: {len} bytes of token data is not a whole number of u16 tokens", path.display())]
    OddLength {
        /// The token file.
        path: PathBuf,
        /// The length of the token data in bytes.
        len: usize,
    },
    /// The file is shorter than llm.c's header.
    #[error("{}: {len} bytes is too short for the {LLMC_HEADER_BYTES}-byte llm.c header", path.display())]
    ShortHeader {
        /// The token file.
        path: PathBuf,
        /// The file length in bytes.
        len: usize,
    },
    /// The llm.c header does not start with the magic number.
    #[error("{}: bad magic {found} (expected llm.c's {LLMC_MAGIC})", path.display())]
    BadMagic {
        /// The token file.
        path: PathBuf,
        /// The first header word.
        found: i32,
    },
    /// The llm.c header has a version other than 1.
    #[error("{}: llm.c version {found} is not supported (expected {LLMC_VERSION}, u16 tokens)", path.display())]
    BadVersion {
        /// The token file.
        path: PathBuf,
        /// The header's version word.
        found: i32,
    },
    /// The llm.c header's token count disagrees with the file length.
    #[error("{}: the header says {declared} tokens but the file holds {actual}", path.display())]
    CountMismatch {
        /// The token file.
        path: PathBuf,
        /// The header's token count.
        declared: i64,
        /// The tokens actually present.
        actual: usize,
    },
}

/// Why a text corpus could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CorpusError {
    /// Reading the file failed, or it is not UTF-8.
    #[error("{}: {source}", path.display())]
    Io {
        /// The corpus.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The text has a character outside the vocabulary.
    #[error("{}: {source}", path.display())]
    Encode {
        /// The corpus.
        path: PathBuf,
        /// The unknown character.
        source: EncodeError,
    },
}

/// Why a token stream could not be split.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{name}: validation fraction {fraction} is not in [0, 1)")]
pub(crate) struct SplitError {
    /// The token stream.
    name: String,
    /// The fraction asked for.
    fraction: f64,
}

enum Storage {
    Owned(Vec<u16>),
    Mapped { map: Mmap, offset: usize },
}

/// An immutable stream of `u16` tokens, cheap to clone.
#[derive(Clone)]
pub(crate) struct Tokens {
    storage: Arc<Storage>,
    len: usize,
    name: Arc<str>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tokens({}, {} tokens)", self.name, self.len)
    }
}

impl Tokens {
    /// Tokens already in memory; `name` appears in error messages.
    pub(crate) fn from_vec(tokens: Vec<u16>, name: impl Into<Arc<str>>) -> Self {
        Self { len: tokens.len(), storage: Arc::new(Storage::Owned(tokens)), name: name.into() }
    }

    /// Reads a UTF-8 text corpus and tokenizes it with `vocab`.
    pub(crate) fn from_text_file(path: &Path, vocab: &Vocab) -> Result<Self, CorpusError> {
        let text = std::fs::read_to_string(path).map_err(|source| CorpusError::Io { path: path.to_owned(), source })?;
        let tokens = vocab.encode(&text).map_err(|source| CorpusError::Encode { path: path.to_owned(), source })?;
        Ok(Self::from_vec(tokens, path.display().to_string()))
    }

    /// Maps a `.bin` file of `u16` tokens.
    ///
    /// The file must not be modified while it is mapped.
    pub(crate) fn open_bin(path: &Path, format: TokenFormat) -> Result<Self, TokenFileError> {
        let io = |source| TokenFileError::Io { path: path.to_owned(), source };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only, and token files are written once
        // before training; a file truncated underneath us is outside the
        // contract documented above.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let format = match format {
            TokenFormat::Detect if header_word(&map, 0) == Some(LLMC_MAGIC) => TokenFormat::LlmC,
            TokenFormat::Detect => TokenFormat::NanoGpt,
            format => format,
        };
        let offset = match format {
            TokenFormat::LlmC => check_llmc_header(path, &map)?,
            TokenFormat::NanoGpt | TokenFormat::Detect => 0,
        };
        let data_len = map.len() - offset;
        if !data_len.is_multiple_of(2) {
            return Err(TokenFileError::OddLength { path: path.to_owned(), len: data_len });
        }
        Ok(Self {
            len: data_len / 2,
            storage: Arc::new(Storage::Mapped { map, offset }),
            name: path.display().to_string().into(),
        })
    }

    /// Where the tokens came from, for messages.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The token at `index`, or `None` past the end.
    pub(crate) fn get(&self, index: usize) -> Option<u16> {
        if index >= self.len {
            return None;
        }
        match &*self.storage {
            Storage::Owned(tokens) => tokens.get(index).copied(),
            Storage::Mapped { map, offset } => {
                let at = offset + 2 * index;
                Some(u16::from_le_bytes([*map.get(at)?, *map.get(at + 1)?]))
            }
        }
    }

    /// The whole stream as one split.
    pub(crate) fn all(&self) -> Split {
        Split { tokens: self.clone(), start: 0, end: self.len, part: "all" }
    }

    /// Splits into training tokens (the first `1 - val_fraction`) and
    /// validation tokens (the rest), like nanoGPT's 90%/10%.
    pub(crate) fn split(&self, val_fraction: f64) -> Result<(Split, Split), SplitError> {
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(SplitError { name: self.name.to_string(), fraction: val_fraction });
        }
        // Truncation toward zero is intended: the boundary is a token index.
        let boundary = ((self.len as f64) * (1.0 - val_fraction)) as usize;
        let boundary = boundary.min(self.len);
        let train = Split { tokens: self.clone(), start: 0, end: boundary, part: "train" };
        let val = Split { tokens: self.clone(), start: boundary, end: self.len, part: "val" };
        Ok((train, val))
    }
}

/// Reads the `index`th little-endian `i32` of a header.
fn header_word(bytes: &[u8], index: usize) -> Option<i32> {
    let at = index * 4;
    let word = bytes.get(at..at + 4)?;
    Some(i32::from_le_bytes([word[0], word[1], word[2], word[3]]))
}

/// Validates an llm.c header and returns the offset of the first token.
fn check_llmc_header(path: &Path, map: &[u8]) -> Result<usize, TokenFileError> {
    if map.len() < LLMC_HEADER_BYTES {
        return Err(TokenFileError::ShortHeader { path: path.to_owned(), len: map.len() });
    }
    let word = |index| header_word(map, index).unwrap_or_default();
    if word(0) != LLMC_MAGIC {
        return Err(TokenFileError::BadMagic { path: path.to_owned(), found: word(0) });
    }
    if word(1) != LLMC_VERSION {
        return Err(TokenFileError::BadVersion { path: path.to_owned(), found: word(1) });
    }
    let data_len = map.len() - LLMC_HEADER_BYTES;
    let actual = data_len / 2;
    if data_len.is_multiple_of(2) && usize::try_from(word(2)).ok() != Some(actual) {
        return Err(TokenFileError::CountMismatch { path: path.to_owned(), declared: i64::from(word(2)), actual });
    }
    Ok(LLMC_HEADER_BYTES)
}

/// A contiguous range of a token stream (train, val or all of it).
#[derive(Debug, Clone)]
pub(crate) struct Split {
    tokens: Tokens,
    start: usize,
    end: usize,
    part: &'static str,
}

impl Split {
    /// The number of tokens.
    pub(crate) fn len(&self) -> usize {
        self.end - self.start
    }

    /// The token at `index` within the split, or `None` past its end.
    pub(crate) fn get(&self, index: usize) -> Option<u16> {
        if index >= self.len() {
            return None;
        }
        self.tokens.get(self.start + index)
    }

    /// `path (train split)`, or just `path` for the whole stream, for messages.
    pub(crate) fn describe(&self) -> String {
        if self.part == "all" {
            return self.tokens.name().to_owned();
        }
        format!("{} ({} split)", self.tokens.name(), self.part)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn u16_bytes(tokens: &[u16]) -> Vec<u8> {
        tokens.iter().flat_map(|token| token.to_le_bytes()).collect()
    }

    fn llmc_file(tokens: &[u16], magic: i32, version: i32, count: i32) -> Vec<u8> {
        let mut header = [0i32; 256];
        header[0] = magic;
        header[1] = version;
        header[2] = count;
        let mut bytes: Vec<u8> = header.iter().flat_map(|word| word.to_le_bytes()).collect();
        bytes.extend(u16_bytes(tokens));
        bytes
    }

    fn collect(split: &Split) -> Vec<u16> {
        (0..split.len()).map(|index| split.get(index).unwrap()).collect()
    }

    #[test]
    fn nanogpt_bin_is_raw_little_endian_u16() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = [0u16, 1, 50_256, 65_535, 7];
        let path = write(dir.path(), "train.bin", &u16_bytes(&tokens));
        for format in [TokenFormat::NanoGpt, TokenFormat::Detect] {
            let file = Tokens::open_bin(&path, format).unwrap();
            assert_eq!(collect(&file.all()), tokens);
            assert_eq!(file.get(5), None);
        }
    }

    #[test]
    fn llmc_bin_skips_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = [50_256u16, 11, 22, 33];
        let path = write(dir.path(), "fineweb_val_000000.bin", &llmc_file(&tokens, LLMC_MAGIC, 1, 4));
        for format in [TokenFormat::LlmC, TokenFormat::Detect] {
            let file = Tokens::open_bin(&path, format).unwrap();
            assert_eq!(collect(&file.all()), tokens);
        }
    }

    fn open_err(bytes: &[u8], format: TokenFormat) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "bad.bin", bytes);
        let err = Tokens::open_bin(&path, format).unwrap_err().to_string();
        assert!(err.starts_with(&path.display().to_string()), "{err}");
        assert!(!err.contains('\n'), "{err}");
        err
    }

    #[test]
    fn malformed_bins_are_one_line_errors_naming_the_path() {
        assert!(
            open_err(&[1, 2, 3], TokenFormat::NanoGpt)
                .ends_with("3 bytes of token data is not a whole number of u16 tokens")
        );
        assert!(
            open_err(&[0; 100], TokenFormat::LlmC).ends_with("100 bytes is too short for the 1024-byte llm.c header")
        );
        assert!(
            open_err(&llmc_file(&[1, 2], 12345, 1, 2), TokenFormat::LlmC)
                .ends_with("bad magic 12345 (expected llm.c's 20240520)")
        );
        assert!(
            open_err(&llmc_file(&[1, 2], LLMC_MAGIC, 2, 2), TokenFormat::LlmC)
                .ends_with("llm.c version 2 is not supported (expected 1, u16 tokens)")
        );
        assert!(
            open_err(&llmc_file(&[1, 2], LLMC_MAGIC, 1, 3), TokenFormat::Detect)
                .ends_with("the header says 3 tokens but the file holds 2")
        );
        let mut odd = llmc_file(&[1, 2], LLMC_MAGIC, 1, 2);
        odd.push(0);
        assert!(
            open_err(&odd, TokenFormat::LlmC).ends_with("5 bytes of token data is not a whole number of u16 tokens")
        );
    }

    #[test]
    fn missing_file_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope.bin");
        let err = Tokens::open_bin(&path, TokenFormat::Detect).unwrap_err().to_string();
        assert!(err.starts_with(&path.display().to_string()), "{err}");
    }

    #[test]
    fn text_corpus_is_tokenized() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "input.txt", b"abba\ncab");
        let vocab = Vocab::chars_of("\nabc").unwrap();
        let tokens = Tokens::from_text_file(&path, &vocab).unwrap();
        assert_eq!(collect(&tokens.all()), [1, 2, 2, 1, 0, 3, 1, 2]);
        let bytes = Tokens::from_text_file(&path, &Vocab::Byte).unwrap();
        assert_eq!(bytes.get(0), Some(u16::from(b'a')));

        let narrow = Vocab::chars_of("ab").unwrap();
        let err = Tokens::from_text_file(&path, &narrow).unwrap_err().to_string();
        assert_eq!(err, format!("{}: character '\\n' at byte 4 is not in the 2-token vocabulary", path.display()));
    }

    #[test]
    fn split_is_first_90_percent_and_last_10() {
        let tokens = Tokens::from_vec((0..100).collect(), "corpus");
        let (train, val) = tokens.split(0.1).unwrap();
        assert_eq!(collect(&train), (0..90).collect::<Vec<_>>());
        assert_eq!(collect(&val), (90..100).collect::<Vec<_>>());
        assert_eq!(val.describe(), "corpus (val split)");
        assert_eq!(tokens.all().describe(), "corpus");
        let (train, val) = tokens.split(0.0).unwrap();
        assert_eq!((train.len(), val.len()), (100, 0));
        assert_eq!(tokens.split(1.0).unwrap_err().to_string(), "corpus: validation fraction 1 is not in [0, 1)");
        assert!(tokens.split(f64::NAN).is_err());
    }
}
