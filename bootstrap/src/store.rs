//! The blob store on disk under `<data-dir>/blobs/`.
//!
//! * `blobs/<hex>`: a complete blob, named by its content id;
//! * `blobs/<hex>.outboard`: its size (8 bytes, little-endian) and chunk chaining values;
//! * `blobs/partial/<hex>`, `.outboard`, `.done`: a download in progress. `.done` has one
//!   byte per chunk (1 = written); chunks marked done are re-verified on resume, so a
//!   crash between writing a chunk and marking it never yields a corrupt blob.

use std::cell::RefCell;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::{Advice, Mmap};
use pcp_protocol::BlobHash;
use pcp_schema::{CHUNK_SIZE, MAX_BLOB_SIZE, chunk_count};

use crate::codec::{ChunkFrame, MappedChunk};
use crate::outboard::{Outboard, OutboardBuilder, chunk_len};

/// A failed blob store operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An I/O operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The blob is larger than the network allows.
    #[error("{path}: {size} bytes exceed the blob limit of {max} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A store file is inconsistent.
    #[error("{path}: corrupt store file: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io { op, path: path.to_owned(), source }
}

/// Whether a blob written here is on disk before it is named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Synced to disk first: it survives a crash of the machine.
    Durable,
    /// Left to the page cache: a crash of the machine may leave it torn, for blobs
    /// written again each time they are needed (a round's parameter shards, which a
    /// resumed shepherd writes anew, over any torn copy), whose readers check every
    /// chunk against its outboard. Writing gpt2-124m's shards synced took 2.6 times
    /// as long on this machine's disk (`dd` of 650 MiB: 2.17 s against 0.83 s).
    Volatile,
}

/// Content-addressed blobs on disk.
#[derive(Debug, Clone)]
pub struct BlobStore {
    dir: PathBuf,
    max_size: u64,
}

impl BlobStore {
    /// Opens (creating if needed) the store under `<data_dir>/blobs/`.
    pub fn open(data_dir: &Path) -> Result<Self, StoreError> {
        let dir = data_dir.join("blobs");
        let partial = dir.join("partial");
        fs::create_dir_all(&partial).map_err(io_err("create", &partial))?;
        Ok(Self { dir, max_size: MAX_BLOB_SIZE })
    }

    /// Lowers the maximum blob size (for tests and small nodes).
    pub fn with_max_size(mut self, max: u64) -> Self {
        self.max_size = max.min(MAX_BLOB_SIZE);
        self
    }

    /// The maximum blob size.
    pub fn max_size(&self) -> u64 {
        self.max_size
    }

    /// Where a complete blob lives.
    pub fn path(&self, hash: &BlobHash) -> PathBuf {
        self.dir.join(hash.to_hex())
    }

    fn outboard_path(&self, hash: &BlobHash) -> PathBuf {
        self.dir.join(format!("{}.outboard", hash.to_hex()))
    }

    fn partial_path(&self, hash: &BlobHash, ext: &str) -> PathBuf {
        self.dir.join("partial").join(format!("{}{ext}", hash.to_hex()))
    }

    /// Whether the blob is complete in the store.
    pub fn contains(&self, hash: &BlobHash) -> bool {
        self.outboard_path(hash).is_file() && self.path(hash).is_file()
    }

    /// The size of a complete blob, `None` if it is not here.
    pub fn size(&self, hash: &BlobHash) -> Option<u64> {
        if !self.contains(hash) {
            return None;
        }
        fs::metadata(self.path(hash)).ok().map(|m| m.len())
    }

    /// Which file holds a complete blob now (device and inode), `None` if it is not
    /// here. Adding the blob again (a put or a finished fetch renames a new file into
    /// place) changes it: a deletion decided before then must not remove the new copy.
    pub(crate) fn file_id(&self, hash: &BlobHash) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt as _;
        fs::metadata(self.path(hash)).ok().map(|m| (m.dev(), m.ino()))
    }

    /// Deletes a blob: its data, its outboard and any download of it in progress
    /// on disk. Returns the bytes freed (0 when nothing was there). The data goes
    /// first, so a crash in between leaves only an outboard, which is not a blob.
    ///
    /// Whoever calls this must know that nobody reads the blob any more: the event
    /// loop defers the removal of blobs being served or fetched (see
    /// [`crate::Node::release`]).
    pub fn remove(&self, hash: &BlobHash) -> Result<u64, StoreError> {
        let mut freed = 0;
        for path in [
            self.path(hash),
            self.outboard_path(hash),
            self.partial_path(hash, ""),
            self.partial_path(hash, ".outboard"),
            self.partial_path(hash, ".done"),
        ] {
            let len = match fs::metadata(&path) {
                Ok(m) => m.len(),
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("stat", &path)(e)),
            };
            match fs::remove_file(&path) {
                Ok(()) => freed += len,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("remove", &path)(e)),
            }
        }
        Ok(freed)
    }

    /// Every complete blob.
    pub fn list(&self) -> Result<Vec<BlobHash>, StoreError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_err("list", &self.dir))? {
            let entry = entry.map_err(io_err("list", &self.dir))?;
            let name = entry.file_name();
            let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".outboard")) else {
                continue;
            };
            if let Ok(hash) = stem.parse::<BlobHash>()
                && self.path(&hash).is_file()
            {
                out.push(hash);
            }
        }
        out.sort();
        Ok(out)
    }

    /// Copies `path` into the store, hashing it on the way, and returns its content id
    /// and size.
    pub fn put_file(&self, path: &Path) -> Result<(BlobHash, u64), StoreError> {
        let mut src = File::open(path).map_err(io_err("open", path))?;
        let size = src.metadata().map_err(io_err("stat", path))?.len();
        if size > self.max_size {
            return Err(StoreError::TooLarge { path: path.to_owned(), size, max: self.max_size });
        }
        let tmp = self
            .dir
            .join("partial")
            .join(format!("put-{}.tmp", blake3::hash(path.as_os_str().as_encoded_bytes()).to_hex()));
        let mut dst = File::create(&tmp).map_err(io_err("create", &tmp))?;
        let mut builder = OutboardBuilder::new(size);
        let mut buf = vec![0u8; CHUNK_SIZE];
        let chunks = chunk_count(size);
        for index in 0..chunks {
            let len = chunk_len(size, index as u32);
            src.read_exact(&mut buf[..len]).map_err(io_err("read", path))?;
            builder.push(&buf[..len]);
            dst.write_all(&buf[..len]).map_err(io_err("write", &tmp))?;
        }
        let (outboard, hash) = builder.finish().ok_or_else(|| StoreError::Corrupt {
            path: path.to_owned(),
            reason: "size changed while reading".into(),
        })?;
        dst.sync_all().map_err(io_err("sync", &tmp))?;
        self.write_outboard(&hash, &outboard)?;
        let final_path = self.path(&hash);
        fs::rename(&tmp, &final_path).map_err(io_err("rename", &final_path))?;
        Ok((hash, size))
    }

    /// Adds blob `hash`, complete in `from` (a store on the same filesystem), to this
    /// store without copying it: its outboard, then its data, are hard-linked, so a
    /// crash in between leaves no blob. Nodes of one process holding the same bytes
    /// (`pcp-node loadtest`'s synthetic workers) share one file.
    pub fn link_from(&self, from: &BlobStore, hash: &BlobHash) -> Result<(), StoreError> {
        if self.contains(hash) {
            return Ok(());
        }
        for (src, dst) in [(from.outboard_path(hash), self.outboard_path(hash)), (from.path(hash), self.path(hash))] {
            match fs::hard_link(&src, &dst) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io_err("link", &src)(e)),
            }
        }
        Ok(())
    }

    /// Adds bytes to the store.
    pub fn put_bytes(&self, bytes: &[u8]) -> Result<BlobHash, StoreError> {
        self.put_stream(bytes.len() as u64, &mut |w| w.write_all(bytes))
    }

    /// Adds a blob of exactly `size` bytes that `fill` writes, hashing and writing it
    /// in one pass, never holding it whole: a shepherd's gpt2-124m state (a GB) goes
    /// from its tensors to disk without a copy in memory. Fails, storing nothing, if
    /// `fill` fails or writes another size. The blob is on disk before it is named
    /// ([`Durability::Durable`]).
    pub fn put_stream(
        &self,
        size: u64,
        fill: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<BlobHash, StoreError> {
        self.put_stream_with(size, Durability::Durable, fill)
    }

    /// [`BlobStore::put_stream`], synced to disk or not as `durability` says.
    pub fn put_stream_with(
        &self,
        size: u64,
        durability: Durability,
        fill: &mut dyn FnMut(&mut dyn Write) -> std::io::Result<()>,
    ) -> Result<BlobHash, StoreError> {
        if size > self.max_size {
            return Err(StoreError::TooLarge { path: PathBuf::from("<stream>"), size, max: self.max_size });
        }
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = self.dir.join("partial").join(format!("stream-{}-{n}.tmp", std::process::id()));
        let file = File::create(&tmp).map_err(io_err("create", &tmp))?;
        let mut sink = ChunkSink {
            file: std::io::BufWriter::with_capacity(4 * CHUNK_SIZE, file),
            builder: OutboardBuilder::new(size),
            chunk: Vec::with_capacity(CHUNK_SIZE),
            written: 0,
        };
        let filled = fill(&mut sink).and_then(|()| sink.finish_chunk());
        let done = filled.and_then(|()| {
            if sink.written != size {
                return Err(std::io::Error::other(format!("{} bytes written, {size} announced", sink.written)));
            }
            sink.file.flush()?;
            match durability {
                Durability::Durable => sink.file.get_ref().sync_all(),
                Durability::Volatile => Ok(()),
            }
        });
        let ChunkSink { builder, .. } = sink;
        let finished = done.map_err(io_err("write", &tmp)).and_then(|()| {
            builder.finish().ok_or_else(|| StoreError::Corrupt { path: tmp.clone(), reason: "size changed".into() })
        });
        let (outboard, hash) = match finished {
            Ok(f) => f,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        self.write_outboard(&hash, &outboard)?;
        let final_path = self.path(&hash);
        fs::rename(&tmp, &final_path).map_err(io_err("rename", &final_path))?;
        Ok(hash)
    }

    fn write_outboard(&self, hash: &BlobHash, outboard: &Outboard) -> Result<(), StoreError> {
        write_outboard_file(&self.outboard_path(hash), outboard)
    }

    /// The outboard of a complete blob.
    pub fn outboard(&self, hash: &BlobHash) -> Result<Option<Outboard>, StoreError> {
        if !self.contains(hash) {
            return Ok(None);
        }
        read_outboard_file(&self.outboard_path(hash), self.max_size).map(Some)
    }

    /// Chunk `index` of a complete blob, or `None` if the blob or chunk is not here.
    pub fn read_chunk(&self, hash: &BlobHash, size: u64, index: u32) -> Result<Option<Vec<u8>>, StoreError> {
        if u64::from(index) >= chunk_count(size) {
            return Ok(None);
        }
        let path = self.path(hash);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("open", &path)(e)),
        };
        let mut buf = vec![0u8; chunk_len(size, index)];
        file.read_exact_at(&mut buf, u64::from(index) * CHUNK_SIZE as u64).map_err(io_err("read", &path))?;
        Ok(Some(buf))
    }

    /// Chunk `index` of a complete blob as an encoded response, read straight into the
    /// message; `None` if the blob or chunk is not here.
    pub(crate) fn read_chunk_frame(
        &self,
        hash: &BlobHash,
        size: u64,
        index: u32,
    ) -> Result<Option<ChunkFrame>, StoreError> {
        if u64::from(index) >= chunk_count(size) {
            return Ok(None);
        }
        let path = self.path(hash);
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("open", &path)(e)),
        };
        let len = chunk_len(size, index);
        file.seek(SeekFrom::Start(u64::from(index) * CHUNK_SIZE as u64)).map_err(io_err("seek", &path))?;
        // `read_to_end` reads into the message's spare capacity without zeroing it first
        let frame = ChunkFrame::build(len, |m| file.take(len as u64).read_to_end(m).map(|_| ()))
            .map_err(io_err("read", &path))?;
        Ok(Some(frame))
    }

    /// A read-only memory map of a complete blob of `size` bytes, `None` if the blob is not
    /// here (or its file is not `size` bytes long). Serve chunks from it with
    /// [`map_chunk`].
    ///
    /// A complete blob's file is never written again: it is renamed into place whole and
    /// only ever removed, which leaves an existing map intact. (Truncating it behind the
    /// node's back would fault the process that maps it, as with any mapped file.)
    pub(crate) fn map(&self, hash: &BlobHash, size: u64) -> Result<Option<Arc<Mmap>>, StoreError> {
        let path = self.path(hash);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("open", &path)(e)),
        };
        if file.metadata().map_err(io_err("stat", &path))?.len() != size || size == 0 {
            return Ok(None);
        }
        // SAFETY: see above; the store never modifies a complete blob in place.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err("map", &path))?;
        Ok(Some(Arc::new(map)))
    }

    /// Starts or resumes a download of `hash` whose verified outboard is `outboard`.
    pub fn partial(&self, hash: BlobHash, outboard: Outboard) -> Result<Partial, StoreError> {
        let data_path = self.partial_path(&hash, "");
        let done_path = self.partial_path(&hash, ".done");
        let ob_path = self.partial_path(&hash, ".outboard");
        let chunks = outboard.cvs.len();
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&data_path)
            .map_err(io_err("open", &data_path))?;
        data.set_len(outboard.size).map_err(io_err("resize", &data_path))?;
        let mut done = match fs::read(&done_path) {
            Ok(d) if d.len() == chunks => d.into_iter().map(|b| b == 1).collect(),
            Ok(_) => vec![false; chunks],
            Err(e) if e.kind() == io::ErrorKind::NotFound => vec![false; chunks],
            Err(e) => return Err(io_err("read", &done_path)(e)),
        };
        // re-verify what a previous run wrote: the marks are not synced with the data
        let mut buf = vec![0u8; CHUNK_SIZE];
        for (index, d) in (0u32..).zip(done.iter_mut()) {
            if *d {
                let len = chunk_len(outboard.size, index);
                let ok = data.read_exact_at(&mut buf[..len], u64::from(index) * CHUNK_SIZE as u64).is_ok()
                    && outboard.verify_chunk(index, &buf[..len]);
                *d = ok;
            }
        }
        let marks: Vec<u8> = done.iter().map(|d| u8::from(*d)).collect();
        fs::write(&done_path, &marks).map_err(io_err("write", &done_path))?;
        write_outboard_file(&ob_path, &outboard)?;
        let done_file = OpenOptions::new().write(true).open(&done_path).map_err(io_err("open", &done_path))?;
        let direct = open_direct(&data_path);
        let files = PartialFiles {
            data,
            direct_ok: AtomicBool::new(direct.is_some()),
            direct,
            done_file,
            data_path,
            done_path,
        };
        Ok(Partial {
            hash,
            outboard: Arc::new(outboard),
            files: Arc::new(files),
            done,
            ob_path,
            final_path: self.path(&hash),
            final_outboard: self.outboard_path(&hash),
        })
    }
}

/// Chunk `index` of a blob of `size` bytes mapped by [`BlobStore::map`], with its pages
/// read in and mapped (so that sending it faults nothing on the connection's task);
/// `None` out of range. Blocks on the disk when the blob is not in the page cache.
pub(crate) fn map_chunk(map: Arc<Mmap>, size: u64, index: u32) -> io::Result<Option<MappedChunk>> {
    if u64::from(index) >= chunk_count(size) {
        return Ok(None);
    }
    let start = usize::try_from(u64::from(index) * CHUNK_SIZE as u64).map_err(io::Error::other)?;
    let len = chunk_len(size, index);
    map.advise_range(Advice::PopulateRead, start, len)?;
    Ok(MappedChunk::new(map, start..start + len))
}

/// Alignment of buffers, offsets and lengths for direct (uncached) writes: a multiple of
/// every common logical block size.
const DIRECT_ALIGN: usize = crate::codec::CHUNK_ALIGN;

/// A second handle on a partial blob's data that bypasses the page cache, where the
/// file system supports it. Verified chunks are written once and not read again during
/// the download, so caching them only costs a copy into freshly allocated page-cache
/// pages (the largest cost of a fetch on loopback) and evicts hotter data.
#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    match OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::debug!(path = %path.display(), "direct I/O unavailable, writing through the page cache: {e}");
            None
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_: &Path) -> Option<File> {
    None
}

thread_local! {
    /// Per-thread staging buffer for direct writes (they need an aligned source).
    static DIRECT_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn write_outboard_file(path: &Path, outboard: &Outboard) -> Result<(), StoreError> {
    let mut bytes = Vec::with_capacity(8 + outboard.cvs.len() * 32);
    bytes.extend_from_slice(&outboard.size.to_le_bytes());
    bytes.extend_from_slice(outboard.cvs.as_flattened());
    fs::write(path, bytes).map_err(io_err("write", path))
}

fn read_outboard_file(path: &Path, max: u64) -> Result<Outboard, StoreError> {
    let bytes = fs::read(path).map_err(io_err("read", path))?;
    let corrupt = |reason: &str| StoreError::Corrupt { path: path.to_owned(), reason: reason.into() };
    let (size, rest) = bytes.split_at_checked(8).ok_or_else(|| corrupt("shorter than 8 bytes"))?;
    let size = u64::from_le_bytes(size.try_into().map_err(|_| corrupt("size"))?);
    if size > max || rest.len() as u64 != chunk_count(size) * 32 {
        return Err(corrupt("size does not match the chunk list"));
    }
    let cvs = rest.chunks_exact(32).map(|c| c.try_into().map_err(|_| corrupt("chunk"))).collect::<Result<_, _>>()?;
    Ok(Outboard { size, cvs })
}

/// A download in progress, on disk.
#[derive(Debug)]
pub struct Partial {
    hash: BlobHash,
    outboard: Arc<Outboard>,
    files: Arc<PartialFiles>,
    done: Vec<bool>,
    ob_path: PathBuf,
    final_path: PathBuf,
    final_outboard: PathBuf,
}

/// The open files of a download, shared with the [`ChunkWriter`]s of its chunks.
#[derive(Debug)]
struct PartialFiles {
    data: File,
    direct: Option<File>,
    /// Cleared when the file system refuses a direct write: later chunks are cached.
    direct_ok: AtomicBool,
    done_file: File,
    data_path: PathBuf,
    done_path: PathBuf,
}

impl PartialFiles {
    fn write_data(&self, index: u32, data: &[u8]) -> Result<(), StoreError> {
        let offset = u64::from(index) * CHUNK_SIZE as u64;
        if let Some(direct) = &self.direct
            && data.len().is_multiple_of(DIRECT_ALIGN)
            && self.direct_ok.load(Ordering::Relaxed)
        {
            let written = if data.as_ptr().align_offset(DIRECT_ALIGN) == 0 {
                // received in place (see `codec::CHUNK_ALIGN`)
                direct.write_all_at(data, offset)
            } else {
                DIRECT_BUF.with_borrow_mut(|buf| {
                    if buf.len() < CHUNK_SIZE + DIRECT_ALIGN {
                        *buf = vec![0; CHUNK_SIZE + DIRECT_ALIGN];
                    }
                    let start = buf.as_ptr().align_offset(DIRECT_ALIGN);
                    let staged = &mut buf[start..start + data.len()];
                    staged.copy_from_slice(data);
                    direct.write_all_at(staged, offset)
                })
            };
            match written {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                    tracing::debug!(path = %self.data_path.display(), "direct write refused, caching: {e}");
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(io_err("write", &self.data_path)(e)),
            }
        }
        self.data.write_all_at(data, offset).map_err(io_err("write", &self.data_path))
    }
}

/// Verifies and writes chunks of one download; cheap to clone and meant for blocking
/// threads, so that hashing and disk writes stay off the swarm's event loop.
#[derive(Debug, Clone)]
pub struct ChunkWriter {
    outboard: Arc<Outboard>,
    files: Arc<PartialFiles>,
}

impl ChunkWriter {
    /// Checks `data` against the verified outboard and, if it is chunk `index`, writes it
    /// and its done mark. `Ok(false)`: it failed verification and nothing was written.
    /// The caller records success with [`Partial::mark_done`].
    pub fn verify_and_write(&self, index: u32, data: &[u8]) -> Result<bool, StoreError> {
        if !self.outboard.verify_chunk(index, data) {
            return Ok(false);
        }
        self.write(index, data)?;
        Ok(true)
    }

    /// Writes chunk `index`, which the caller has verified, and its done mark.
    fn write(&self, index: u32, data: &[u8]) -> Result<(), StoreError> {
        self.files.write_data(index, data)?;
        self.files.done_file.write_all_at(&[1], u64::from(index)).map_err(io_err("write", &self.files.done_path))
    }
}

impl Partial {
    /// The verified outboard.
    pub fn outboard(&self) -> &Outboard {
        &self.outboard
    }

    /// A handle that verifies and writes chunks from another thread.
    pub fn writer(&self) -> ChunkWriter {
        ChunkWriter { outboard: Arc::clone(&self.outboard), files: Arc::clone(&self.files) }
    }

    /// Chunks not yet written.
    pub fn missing(&self) -> Vec<u32> {
        (0u32..).zip(&self.done).filter(|(_, d)| !**d).map(|(i, _)| i).collect()
    }

    /// Whether chunk `index` is written.
    pub fn has(&self, index: u32) -> bool {
        self.done.get(index as usize).copied().unwrap_or(false)
    }

    /// Whether every chunk is written.
    pub fn is_complete(&self) -> bool {
        self.done.iter().all(|d| *d)
    }

    /// Records that a [`ChunkWriter`] verified and wrote chunk `index`.
    pub fn mark_done(&mut self, index: u32) {
        if let Some(d) = self.done.get_mut(index as usize) {
            *d = true;
        }
    }

    /// Writes chunk `index`, which the caller has verified, and marks it done.
    pub fn write_chunk(&mut self, index: u32, data: &[u8]) -> Result<(), StoreError> {
        self.writer().write(index, data)?;
        self.mark_done(index);
        Ok(())
    }

    /// Moves the complete blob into the store and returns its path. Blocks on an fsync:
    /// call it off the event loop.
    pub fn finish(self) -> Result<PathBuf, StoreError> {
        let files = &self.files;
        files.data.sync_all().map_err(io_err("sync", &files.data_path))?;
        write_outboard_file(&self.final_outboard, &self.outboard)?;
        fs::rename(&files.data_path, &self.final_path).map_err(io_err("rename", &files.data_path))?;
        let _ = fs::remove_file(&files.done_path);
        let _ = fs::remove_file(&self.ob_path);
        Ok(self.final_path)
    }

    /// The blob being fetched.
    pub fn hash(&self) -> BlobHash {
        self.hash
    }
}

/// A blob being written: its file, its outboard, the chunk being filled.
struct ChunkSink {
    file: std::io::BufWriter<File>,
    builder: OutboardBuilder,
    chunk: Vec<u8>,
    written: u64,
}

impl ChunkSink {
    /// Hashes the last, partial chunk.
    fn finish_chunk(&mut self) -> std::io::Result<()> {
        // an empty blob is one empty chunk
        if !self.chunk.is_empty() || self.written == 0 {
            self.builder.push(&self.chunk);
            self.chunk.clear();
        }
        Ok(())
    }
}

impl Write for ChunkSink {
    fn write(&mut self, mut buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len();
        self.file.write_all(buf)?;
        self.written += n as u64;
        while !buf.is_empty() {
            let take = (CHUNK_SIZE - self.chunk.len()).min(buf.len());
            self.chunk.extend_from_slice(&buf[..take]);
            buf = &buf[take..];
            if self.chunk.len() == CHUNK_SIZE {
                self.builder.push(&self.chunk);
                self.chunk.clear();
            }
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_streamed_blob_is_the_blob_put_whole_and_a_wrong_size_stores_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = BlobStore::open(dir.path()).expect("opens");
        for size in [0, 1, CHUNK_SIZE - 1, CHUNK_SIZE, 3 * CHUNK_SIZE + 5] {
            let bytes: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
            let file = dir.path().join(format!("whole-{size}"));
            std::fs::write(&file, &bytes).expect("writes");
            let (whole, _) = store.put_file(&file).expect("put whole");
            // in uneven pieces
            let streamed = store
                .put_stream(size as u64, &mut |w| {
                    for piece in bytes.chunks(1000) {
                        w.write_all(piece)?;
                    }
                    Ok(())
                })
                .expect("put streamed");
            assert_eq!(streamed, whole, "size {size}");
            assert_eq!(std::fs::read(store.path(&streamed)).expect("reads"), bytes);
            // left to the page cache, the same blob and outboard
            std::fs::remove_file(store.path(&streamed)).expect("removes");
            let volatile = store
                .put_stream_with(size as u64, Durability::Volatile, &mut |w| w.write_all(&bytes))
                .expect("put volatile");
            assert_eq!(volatile, whole, "size {size}");
            assert_eq!(std::fs::read(store.path(&volatile)).expect("reads"), bytes);
            assert_eq!(store.outboard(&volatile).expect("outboard").map(|o| o.size), Some(size as u64));
        }
        let partial = |store: &BlobStore| std::fs::read_dir(store.dir.join("partial")).expect("partial").count();
        let before = partial(&store);
        assert!(store.put_stream(10, &mut |w| w.write_all(&[1; 9])).is_err(), "a byte short");
        assert!(store.put_stream(10, &mut |_| Err(std::io::Error::other("the writer failed"))).is_err());
        assert_eq!(partial(&store), before, "nothing left behind");
    }

    use super::*;

    #[test]
    fn a_linked_blob_is_served_by_both_stores_and_outlives_its_source() -> anyhow::Result<()> {
        let (a_dir, b_dir) = (tempfile::tempdir()?, tempfile::tempdir()?);
        let (a, b) = (BlobStore::open(a_dir.path())?, BlobStore::open(b_dir.path())?);
        let data: Vec<u8> = (0..(CHUNK_SIZE + 3)).map(|i| (i % 241) as u8).collect();
        let hash = a.put_bytes(&data)?;
        b.link_from(&a, &hash)?;
        b.link_from(&a, &hash)?; // again: nothing to do
        assert!(b.contains(&hash));
        a.remove(&hash)?;
        let ob = b.outboard(&hash)?.ok_or_else(|| anyhow::anyhow!("no outboard"))?;
        assert_eq!(b.read_chunk(&hash, ob.size, 1)?.as_deref(), Some(&data[CHUNK_SIZE..]));
        let missing = BlobHash::of(b"not here");
        let err = b.link_from(&a, &missing).expect_err("nothing to link");
        assert!(err.to_string().contains(&missing.to_hex().to_string()), "{err}");
        assert!(!b.contains(&missing));
        Ok(())
    }

    #[test]
    fn put_read_and_resume() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let store = BlobStore::open(dir.path())?;
        let data: Vec<u8> = (0..(2 * CHUNK_SIZE + 10)).map(|i| (i % 253) as u8).collect();
        let hash = store.put_bytes(&data)?;
        assert_eq!(hash, BlobHash::of(&data));
        assert_eq!(store.list()?, vec![hash]);
        let ob = store.outboard(&hash)?.ok_or_else(|| anyhow::anyhow!("no outboard"))?;
        assert_eq!(ob.root(), Some(hash));
        let c2 = store.read_chunk(&hash, ob.size, 2)?;
        assert_eq!(c2.as_deref(), Some(&data[2 * CHUNK_SIZE..]));
        assert_eq!(store.read_chunk(&hash, ob.size, 3)?, None);

        // a second node downloads chunk 1, "crashes", and resumes
        let dir2 = tempfile::tempdir()?;
        let other = BlobStore::open(dir2.path())?;
        let mut p = other.partial(hash, ob.clone())?;
        p.write_chunk(1, &data[CHUNK_SIZE..2 * CHUNK_SIZE])?;
        drop(p);
        let mut p = other.partial(hash, ob.clone())?;
        assert_eq!(p.missing(), vec![0, 2]);
        p.write_chunk(0, &data[..CHUNK_SIZE])?;
        p.write_chunk(2, &data[2 * CHUNK_SIZE..])?;
        assert!(p.is_complete());
        let path = p.finish()?;
        assert_eq!(fs::read(path)?, data);
        assert!(other.contains(&hash));

        // a chunk marked done but corrupted on disk is fetched again
        let dir3 = tempfile::tempdir()?;
        let third = BlobStore::open(dir3.path())?;
        let mut p = third.partial(hash, ob.clone())?;
        p.write_chunk(0, &vec![0u8; CHUNK_SIZE])?;
        drop(p);
        assert_eq!(third.partial(hash, ob)?.missing(), vec![0, 1, 2]);
        Ok(())
    }

    /// Chunks served from a map are the chunks read from the file, the last one short;
    /// an index past the end, an absent blob or a file of the wrong size gives `None`.
    #[test]
    fn mapped_chunks_are_the_file_chunks() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let store = BlobStore::open(dir.path())?;
        let data: Vec<u8> = (0..(2 * CHUNK_SIZE + 10)).map(|i| (i % 251) as u8).collect();
        let hash = store.put_bytes(&data)?;
        let size = data.len() as u64;
        let map = store.map(&hash, size)?.ok_or_else(|| anyhow::anyhow!("no map"))?;
        for index in 0..3 {
            let chunk = map_chunk(Arc::clone(&map), size, index)?.ok_or_else(|| anyhow::anyhow!("no chunk"))?;
            assert_eq!(Some(chunk.data().to_vec()), store.read_chunk(&hash, size, index)?, "chunk {index}");
        }
        assert_eq!(map_chunk(Arc::clone(&map), size, 2)?.map(|c| c.data().len()), Some(10));
        assert!(map_chunk(map, size, 3)?.is_none());
        assert!(store.map(&hash, size + 1)?.is_none(), "a size that differs from the file's");
        assert!(store.map(&BlobHash::of(b"absent"), size)?.is_none());
        Ok(())
    }

    /// Removing a blob deletes its data, its outboard and a download of it in
    /// progress, and counts the bytes; removing it again, or an absent blob, frees
    /// nothing. A blob added again is a new file.
    #[test]
    fn remove_deletes_blob_outboard_and_partial() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let store = BlobStore::open(dir.path())?;
        let data: Vec<u8> = (0..(CHUNK_SIZE + 7)).map(|i| (i % 241) as u8).collect();
        let hash = store.put_bytes(&data)?;
        let kept = store.put_bytes(b"another blob")?;
        assert_eq!(store.size(&hash), Some(data.len() as u64));
        let before = store.file_id(&hash).ok_or_else(|| anyhow::anyhow!("no file"))?;
        store.put_bytes(&data)?;
        assert!(store.file_id(&hash).is_some_and(|id| id != before), "a blob added again is a new file");
        // a download of the same blob left on disk by an earlier run
        let ob = store.outboard(&hash)?.ok_or_else(|| anyhow::anyhow!("no outboard"))?;
        let mut partial = store.partial(hash, ob)?;
        partial.write_chunk(0, &data[..CHUNK_SIZE])?;
        drop(partial);
        let freed = store.remove(&hash)?;
        // data, outboard (8 + 2 × 32 bytes), and the partial data, outboard and marks
        assert_eq!(freed, data.len() as u64 + 72 + data.len() as u64 + 72 + 2);
        assert!(!store.contains(&hash));
        assert_eq!(store.size(&hash), None);
        assert_eq!(store.list()?, vec![kept]);
        let leftovers: Vec<_> = fs::read_dir(dir.path().join("blobs/partial"))?.collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        assert_eq!(store.remove(&hash)?, 0);
        assert_eq!(store.remove(&BlobHash::of(b"absent"))?, 0);
        Ok(())
    }

    #[test]
    fn oversized_file_is_refused() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let store = BlobStore::open(dir.path())?.with_max_size(10);
        let err = store.put_bytes(&[0; 11]).err();
        assert!(matches!(err, Some(StoreError::TooLarge { size: 11, max: 10, .. })));
        Ok(())
    }
}
