//! The node key at `<data-dir>/identity.key`: 32 secret bytes, mode 0600.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use pcp_protocol::Identity;
use rand::RngCore;

/// Why the identity could not be loaded or created.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// Reading or writing the key file failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The key file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The key file does not hold 32 bytes.
    #[error("{path}: identity key must be 32 bytes, found {len}")]
    Length {
        /// The key file.
        path: PathBuf,
        /// Its length.
        len: usize,
    },
    /// Others can read the key file.
    #[error("{path}: identity key is readable by others (mode {mode:o}); run chmod 600")]
    Permissions {
        /// The key file.
        path: PathBuf,
        /// Its mode.
        mode: u32,
    },
}

/// Loads `<data_dir>/identity.key`, creating it (mode 0600) with a fresh key if absent.
pub fn load_or_create(data_dir: &Path) -> Result<Identity, IdentityError> {
    let path = data_dir.join("identity.key");
    let io = |op| {
        let path = path.clone();
        move |source| IdentityError::Io { op, path, source }
    };
    match fs::read(&path) {
        Ok(bytes) => {
            let mode = fs::metadata(&path).map_err(io("stat"))?.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(IdentityError::Permissions { path, mode });
            }
            let secret: [u8; 32] = bytes
                .as_slice()
                .try_into()
                .map_err(|_| IdentityError::Length { path: path.clone(), len: bytes.len() })?;
            Ok(Identity::from_secret(secret))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir_all(data_dir).map_err(io("create"))?;
            let mut secret = [0u8; 32];
            rand::rngs::OsRng.fill_bytes(&mut secret);
            let mut file =
                OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).map_err(io("create"))?;
            file.write_all(&secret).map_err(io("write"))?;
            file.sync_all().map_err(io("sync"))?;
            Ok(Identity::from_secret(secret))
        }
        Err(e) => Err(io("read")(e)),
    }
}

/// The libp2p keypair of an identity: the same ed25519 key, so the PeerId and the
/// envelope signer name the same node.
pub fn keypair(identity: &Identity) -> libp2p::identity::Keypair {
    let mut secret = identity.secret();
    let key = libp2p::identity::ed25519::SecretKey::try_from_bytes(&mut secret)
        .expect("any 32 bytes are an ed25519 secret key");
    libp2p::identity::Keypair::from(libp2p::identity::ed25519::Keypair::from(key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_with_0600_reloaded_and_matches_peer_id() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let a = load_or_create(dir.path())?;
        let mode = fs::metadata(dir.path().join("identity.key"))?.permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let b = load_or_create(dir.path())?;
        assert_eq!(a.public(), b.public());
        let kp = keypair(&a);
        let libp2p_pub = kp.public().try_into_ed25519()?.to_bytes();
        assert_eq!(libp2p_pub, a.public().0);
        Ok(())
    }

    #[test]
    fn bad_key_files_are_refused() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("identity.key");
        fs::write(&path, b"short")?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600))?;
        assert!(matches!(load_or_create(dir.path()), Err(IdentityError::Length { len: 5, .. })));
        fs::write(&path, [0u8; 32])?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644))?;
        assert!(matches!(load_or_create(dir.path()), Err(IdentityError::Permissions { .. })));
        Ok(())
    }
}
