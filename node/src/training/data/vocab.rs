//! Character- and byte-level vocabularies.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A tokenizer's vocabulary. Tokens are `u16`, like nanoGPT's `.bin` files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", try_from = "VocabFile")]
pub(crate) enum Vocab {
    /// One token per distinct character of the corpus, in sorted order
    /// (65 tokens for tiny shakespeare).
    Char {
        /// The characters, sorted and unique; token `i` is `chars[i]`.
        chars: String,
    },
    /// One token per byte (256 tokens).
    Byte,
}

/// The unvalidated JSON form of a [`Vocab`].
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
enum VocabFile {
    Char { chars: String },
    Byte,
}

impl TryFrom<VocabFile> for Vocab {
    type Error = String;

    fn try_from(file: VocabFile) -> Result<Self, Self::Error> {
        match file {
            VocabFile::Byte => Ok(Vocab::Byte),
            VocabFile::Char { chars } => {
                let listed: Vec<char> = chars.chars().collect();
                if listed.is_empty() {
                    return Err("the character list is empty".to_owned());
                }
                if let Some(pair) = listed.windows(2).find(|pair| pair[0] >= pair[1]) {
                    return Err(format!(
                        "characters must be sorted and unique, found {:?} before {:?}",
                        pair[0], pair[1]
                    ));
                }
                if listed.len() > MAX_TOKENS {
                    return Err(format!("{} characters exceed {MAX_TOKENS} tokens", listed.len()));
                }
                Ok(Vocab::Char { chars })
            }
        }
    }
}

/// The most tokens a `u16` can name.
const MAX_TOKENS: usize = 1 << 16;

/// Why a vocabulary could not be built, saved or loaded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum VocabError {
    /// The corpus has no characters.
    #[error("cannot build a character vocabulary from an empty corpus")]
    EmptyCorpus,
    /// The corpus has more distinct characters than `u16` tokens.
    #[error("the corpus has {count} distinct characters, more than {MAX_TOKENS} tokens")]
    TooManyChars {
        /// The number of distinct characters.
        count: usize,
    },
    /// Reading or writing the file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The vocabulary file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not a vocabulary.
    #[error("{}: not a vocabulary: {source}", path.display())]
    Json {
        /// The vocabulary file.
        path: PathBuf,
        /// What is wrong with it.
        source: serde_json::Error,
    },
}

/// Text that the vocabulary cannot tokenize.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("character {ch:?} at byte {offset} is not in the {size}-token vocabulary")]
pub(crate) struct EncodeError {
    /// The unknown character.
    pub(crate) ch: char,
    /// Its byte offset in the text.
    pub(crate) offset: usize,
    /// The vocabulary size.
    pub(crate) size: usize,
}

/// A token outside the vocabulary.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("token {token} at position {position} is outside the {size}-token vocabulary")]
pub(crate) struct DecodeError {
    /// The bad token.
    pub(crate) token: u16,
    /// Its position in the input.
    pub(crate) position: usize,
    /// The vocabulary size.
    pub(crate) size: usize,
}

impl Vocab {
    /// The sorted unique characters of `text`, like nanoGPT's `shakespeare_char`.
    pub(crate) fn chars_of(text: &str) -> Result<Self, VocabError> {
        let set: BTreeSet<char> = text.chars().collect();
        if set.is_empty() {
            return Err(VocabError::EmptyCorpus);
        }
        if set.len() > MAX_TOKENS {
            return Err(VocabError::TooManyChars { count: set.len() });
        }
        Ok(Vocab::Char { chars: set.into_iter().collect() })
    }

    /// The number of tokens.
    pub(crate) fn size(&self) -> usize {
        match self {
            Vocab::Char { chars } => chars.chars().count(),
            Vocab::Byte => 256,
        }
    }

    /// Tokenizes `text`.
    pub(crate) fn encode(&self, text: &str) -> Result<Vec<u16>, EncodeError> {
        match self {
            Vocab::Byte => Ok(text.bytes().map(u16::from).collect()),
            Vocab::Char { chars } => {
                let table: Vec<char> = chars.chars().collect();
                text.char_indices()
                    .map(|(offset, ch)| {
                        table.binary_search(&ch).ok().and_then(|index| u16::try_from(index).ok()).ok_or(EncodeError {
                            ch,
                            offset,
                            size: table.len(),
                        })
                    })
                    .collect()
            }
        }
    }

    /// Turns tokens back into text; byte tokens that are not UTF-8 become U+FFFD.
    pub(crate) fn decode(&self, tokens: &[u16]) -> Result<String, DecodeError> {
        let size = self.size();
        let out_of_range = |(position, &token): (usize, &u16)| DecodeError { token, position, size };
        match self {
            Vocab::Byte => {
                let bytes = tokens
                    .iter()
                    .enumerate()
                    .map(|(position, &token)| u8::try_from(token).map_err(|_| out_of_range((position, &token))))
                    .collect::<Result<Vec<u8>, _>>()?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Vocab::Char { chars } => {
                let table: Vec<char> = chars.chars().collect();
                tokens
                    .iter()
                    .enumerate()
                    .map(|(position, &token)| {
                        table.get(usize::from(token)).copied().ok_or_else(|| out_of_range((position, &token)))
                    })
                    .collect()
            }
        }
    }

    /// Writes the vocabulary as JSON, e.g. next to a run's checkpoints.
    pub(crate) fn save(&self, path: &Path) -> Result<(), VocabError> {
        let json =
            serde_json::to_string_pretty(self).map_err(|source| VocabError::Json { path: path.to_owned(), source })?;
        std::fs::write(path, json + "\n").map_err(|source| VocabError::Io { path: path.to_owned(), source })
    }

    /// Reads a vocabulary written by [`Vocab::save`].
    pub(crate) fn load(path: &Path) -> Result<Self, VocabError> {
        let text = std::fs::read_to_string(path).map_err(|source| VocabError::Io { path: path.to_owned(), source })?;
        serde_json::from_str(&text).map_err(|source| VocabError::Json { path: path.to_owned(), source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_vocab_is_sorted_unique_chars() {
        let vocab = Vocab::chars_of("hello, world\n").unwrap();
        assert_eq!(vocab, Vocab::Char { chars: "\n ,dehlorw".to_owned() });
        assert_eq!(vocab.size(), 10);
        let tokens = vocab.encode("hold").unwrap();
        assert_eq!(tokens, vec![5, 7, 6, 3]);
        assert_eq!(vocab.decode(&tokens).unwrap(), "hold");
    }

    #[test]
    fn tiny_shakespeare_has_65_chars() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tiny_shakespeare.txt");
        let text = std::fs::read_to_string(&path).expect("the demo corpus in ../shared/data");
        let vocab = Vocab::chars_of(&text).unwrap();
        assert_eq!(vocab.size(), 65);
        let tokens = vocab.encode(&text).unwrap();
        assert_eq!(tokens.len(), text.chars().count());
        assert_eq!(vocab.decode(&tokens[..1000]).unwrap(), text.chars().take(1000).collect::<String>());
    }

    #[test]
    fn unicode_chars_are_single_tokens() {
        let vocab = Vocab::chars_of("añb€").unwrap();
        assert_eq!(vocab.encode("€ñ").unwrap(), vec![3, 2]);
        assert_eq!(vocab.size(), 4);
    }

    #[test]
    fn unknown_char_is_named() {
        let vocab = Vocab::chars_of("abc").unwrap();
        let err = vocab.encode("abz").unwrap_err();
        assert_eq!(err.to_string(), "character 'z' at byte 2 is not in the 3-token vocabulary");
        assert!(vocab.decode(&[0, 3]).is_err());
    }

    #[test]
    fn byte_vocab_round_trips_any_text() {
        let vocab = Vocab::Byte;
        assert_eq!(vocab.size(), 256);
        let tokens = vocab.encode("é!").unwrap();
        assert_eq!(tokens, vec![0xc3, 0xa9, 0x21]);
        assert_eq!(vocab.decode(&tokens).unwrap(), "é!");
        let err = vocab.decode(&[65, 256]).unwrap_err();
        assert_eq!(err.to_string(), "token 256 at position 1 is outside the 256-token vocabulary");
    }

    #[test]
    fn empty_corpus_is_rejected() {
        assert!(matches!(Vocab::chars_of(""), Err(VocabError::EmptyCorpus)));
    }

    #[test]
    fn save_and_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        for vocab in [Vocab::chars_of("First Citizen:\n\"ok\"").unwrap(), Vocab::Byte] {
            let path = dir.path().join("vocab.json");
            vocab.save(&path).unwrap();
            assert_eq!(Vocab::load(&path).unwrap(), vocab);
        }
        let text = std::fs::read_to_string(dir.path().join("vocab.json")).unwrap();
        assert_eq!(text, "{\n  \"kind\": \"byte\"\n}\n");
    }

    #[test]
    fn malformed_vocab_files_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vocab.json");
        for bad in [
            "not json",
            r#"{"kind": "char", "chars": "ba"}"#,
            r#"{"kind": "char", "chars": "aa"}"#,
            r#"{"kind": "char", "chars": ""}"#,
            r#"{"kind": "bpe"}"#,
        ] {
            std::fs::write(&path, bad).unwrap();
            let err = Vocab::load(&path).unwrap_err().to_string();
            assert!(err.starts_with(&format!("{}: not a vocabulary", path.display())), "{err}");
            assert!(!err.contains('\n'), "{err}");
        }
        let missing = dir.path().join("missing.json");
        let err = Vocab::load(&missing).unwrap_err().to_string();
        assert!(err.starts_with(&missing.display().to_string()), "{err}");
    }
}
