//! A checkpoint's identity, carried by a placed model and its exported manifest so that
//! [`PlacedModel::attach_checked`](super::PlacedModel::attach_checked) refuses a manifest
//! made for another model.

use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::Checkpoint;

#[cfg(doc)]
use crate::error::Invalid;

/// The most header bytes of one checkpoint file hashed into its identity.
const MAX_HEADER_HASHED: u64 = 256 << 20;

/// A checkpoint's identity: each file's length and a hash (64-bit FNV-1a) of its header
/// bytes (from 0 to its first tensor's offset), and its tensor count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Identity {
    tensors: usize,
    /// `(length, header bytes hashed, hash as 16 hex digits)` per file.
    files: Vec<(u64, u64, String)>,
}

impl Identity {
    /// The identity of `checkpoint`, reading its files' header bytes.
    pub(crate) fn of(checkpoint: &Checkpoint) -> Result<Identity> {
        let mut files = Vec::with_capacity(checkpoint.files().len());
        for (i, f) in checkpoint.files().iter().enumerate() {
            let first = checkpoint
                .tensors()
                .iter()
                .filter(|t| t.file() == i)
                .map(|t| t.offset())
                .min()
                .unwrap_or(f.len());
            let header = first.min(f.len()).min(MAX_HEADER_HASHED);
            let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
            let mut buf = vec![0u8; 1 << 20];
            let mut at = 0u64;
            while at < header {
                let n = usize::try_from((header - at).min(buf.len() as u64)).unwrap_or(0);
                let part = &mut buf[..n];
                f.file()
                    .read_exact_at(part, at)
                    .map_err(|e| Error::io("pread", f.path().display().to_string(), e))?;
                for &b in part.iter() {
                    hash = (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
                }
                at += n as u64;
            }
            files.push((f.len(), header, format!("{hash:016x}")));
        }
        Ok(Identity {
            tensors: checkpoint.tensors().len(),
            files,
        })
    }

    /// Each file's length, in the checkpoint's file order (what an attached plan's pieces
    /// are checked against).
    pub(crate) fn file_lengths(&self) -> Vec<u64> {
        self.files.iter().map(|f| f.0).collect()
    }

    /// Whether `checkpoint` has this identity (the same tensor count, file lengths and
    /// header hashes).
    ///
    /// # Errors
    /// [`Invalid::BadValue`] (what `"manifest"`, value `"for another model"`) naming the
    /// first difference; a file's header cannot be read.
    pub(crate) fn check(&self, checkpoint: &Checkpoint) -> Result<()> {
        let ours = Identity::of(checkpoint)?;
        let differ = |why: String| {
            Error::bad_value(
                "PlacedModel::attach_checked",
                "manifest",
                "for another model",
                why,
            )
        };
        if ours.tensors != self.tensors || ours.files.len() != self.files.len() {
            return Err(differ(format!(
                "{} tensors in {} files, the checkpoint has {} in {}",
                self.tensors,
                self.files.len(),
                ours.tensors,
                ours.files.len()
            )));
        }
        for (i, (a, b)) in self.files.iter().zip(&ours.files).enumerate() {
            if a != b {
                return Err(differ(format!(
                    "file {i} ({}): manifest (len {}, header {} bytes, hash {}), checkpoint \
                     (len {}, header {} bytes, hash {})",
                    checkpoint.files()[i].path().display(),
                    a.0,
                    a.1,
                    a.2,
                    b.0,
                    b.1,
                    b.2
                )));
            }
        }
        Ok(())
    }
}
