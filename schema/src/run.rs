//! Run manifests and the blob references they carry.

use crate::codec::{self, DecodeError, MAX_CONTROL_MESSAGE, Message, fixed, list_len, malformed};
use crate::wire::pcp_capnp::{artifact_ref, parameter_ref, run_manifest};

/// A compiled training step for one (backend, target), stored as a blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArtifactRef {
    /// Backend name.
    pub backend: String,
    /// Target name.
    pub target: String,
    /// blake3 content id of the VMFB.
    pub blob: [u8; 32],
    /// Size in bytes.
    pub size: u64,
}

/// One shard of parameters (or of a pseudo-gradient), stored as a blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParameterRef {
    /// Parameter or group name.
    pub name: String,
    /// Shard index.
    pub shard: u32,
    /// blake3 content id.
    pub blob: [u8; 32],
    /// Size in bytes.
    pub size: u64,
}

/// Everything a worker needs to join a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunManifest {
    /// Run id.
    pub run: [u8; 32],
    /// Human-readable name.
    pub name: String,
    /// The shepherd's ed25519 public key.
    pub shepherd: [u8; 32],
    /// DiLoCo inner steps per round.
    pub inner_steps: u32,
    /// One artifact per supported (backend, target).
    pub artifacts: Vec<ArtifactRef>,
    /// Initial parameters.
    pub parameters: Vec<ParameterRef>,
}

impl ArtifactRef {
    fn write(&self, mut b: artifact_ref::Builder<'_>) {
        b.set_backend(self.backend.as_str());
        b.set_target(self.target.as_str());
        b.set_blob(&self.blob[..]);
        b.set_size(self.size);
    }

    fn read(w: &'static str, r: artifact_ref::Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            backend: codec::text(w, "backend", r.get_backend())?,
            target: codec::text(w, "target", r.get_target())?,
            blob: fixed(w, "blob", r.get_blob().map_err(|e| malformed(w, e))?)?,
            size: r.get_size(),
        })
    }
}

impl ParameterRef {
    pub(crate) fn write(&self, mut b: parameter_ref::Builder<'_>) {
        b.set_name(self.name.as_str());
        b.set_shard(self.shard);
        b.set_blob(&self.blob[..]);
        b.set_size(self.size);
    }

    pub(crate) fn read(w: &'static str, r: parameter_ref::Reader<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            name: codec::text(w, "name", r.get_name())?,
            shard: r.get_shard(),
            blob: fixed(w, "blob", r.get_blob().map_err(|e| malformed(w, e))?)?,
            size: r.get_size(),
        })
    }

    pub(crate) fn write_list(list: &[Self], mut b: capnp::struct_list::Builder<'_, parameter_ref::Owned>) {
        for (i, p) in (0..).zip(list) {
            p.write(b.reborrow().get(i));
        }
    }

    pub(crate) fn read_list(
        w: &'static str,
        r: capnp::Result<capnp::struct_list::Reader<'_, parameter_ref::Owned>>,
    ) -> Result<Vec<Self>, DecodeError> {
        let r = r.map_err(|e| malformed(w, e))?;
        let mut out = Vec::with_capacity(r.len() as usize);
        for p in r.iter() {
            out.push(Self::read(w, p)?);
        }
        Ok(out)
    }
}

impl Message for RunManifest {
    const NAME: &'static str = "RunManifest";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<run_manifest::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_name(self.name.as_str());
        root.set_shepherd(&self.shepherd[..]);
        root.set_inner_steps(self.inner_steps);
        let mut artifacts = root.reborrow().init_artifacts(list_len(self.artifacts.len()));
        for (i, a) in (0..).zip(&self.artifacts) {
            a.write(artifacts.reborrow().get(i));
        }
        ParameterRef::write_list(&self.parameters, root.init_parameters(list_len(self.parameters.len())));
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = RunManifest::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<run_manifest::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let list = r.get_artifacts().map_err(|e| malformed(W, e))?;
            let mut artifacts = Vec::with_capacity(list.len() as usize);
            for a in list.iter() {
                artifacts.push(ArtifactRef::read(W, a)?);
            }
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                name: codec::text(W, "name", r.get_name())?,
                shepherd: fixed(W, "shepherd", r.get_shepherd().map_err(|e| malformed(W, e))?)?,
                inner_steps: r.get_inner_steps(),
                artifacts,
                parameters: ParameterRef::read_list(W, r.get_parameters())?,
            })
        })
    }
}
