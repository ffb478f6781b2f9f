//! A synthetic MoE model file with deterministic bytes, for `numapin place`, the
//! benchmark and tests (the testkit re-exports it): per layer, per expert, the weights (as three adjacent pieces:
//! gate, up, down) followed by the scales.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{Error, Invalid, Result};
use crate::store::{ExpertSource, Kind, LayerSpec, Piece};

/// The shape of a synthetic model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntheticModel {
    /// Layers.
    pub layers: usize,
    /// Experts per layer.
    pub experts: usize,
    /// Weight bytes per expert.
    pub weight_bytes: usize,
    /// Scale bytes per expert.
    pub scale_bytes: usize,
}

impl Default for SyntheticModel {
    /// 16 layers × 64 experts × (1 MiB weights + 32 KiB scales): 1.03 GiB.
    fn default() -> Self {
        SyntheticModel {
            layers: 16,
            experts: 64,
            weight_bytes: 1 << 20,
            scale_bytes: 32 << 10,
        }
    }
}

/// One 8-byte word of the stream: splitmix64 of the word's global index.
fn word(index: u64) -> u64 {
    let mut z = index.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SyntheticModel {
    /// Bytes of one expert (weights + scales).
    pub(crate) fn expert_bytes(&self) -> usize {
        self.weight_bytes + self.scale_bytes
    }

    /// Bytes of the whole model.
    ///
    /// # Errors
    /// The size overflows.
    pub fn total_bytes(&self) -> Result<u64> {
        (self.layers as u64)
            .checked_mul(self.experts as u64)
            .and_then(|n| n.checked_mul(self.expert_bytes() as u64))
            .ok_or_else(|| Error::InvalidArgument {
                op: "SyntheticModel",
                reason: Invalid::Overflow {
                    what: format!("the total size of {self:?}"),
                },
            })
    }

    /// The layer spec every layer shares.
    pub fn spec(&self) -> LayerSpec {
        LayerSpec {
            experts: self.experts,
            weight_bytes: self.weight_bytes,
            scale_bytes: self.scale_bytes,
        }
    }

    /// File offset of a tensor.
    pub fn offset(&self, layer: usize, expert: usize, kind: Kind) -> u64 {
        let expert_start = ((layer * self.experts + expert) * self.expert_bytes()) as u64;
        match kind {
            Kind::Weights => expert_start,
            Kind::Scales => expert_start + self.weight_bytes as u64,
        }
    }

    /// The byte at file offset `offset`.
    pub fn byte_at(offset: u64) -> u8 {
        word(offset / 8).to_le_bytes()[(offset % 8) as usize]
    }

    /// Fills `buf` with the file's bytes from offset `start`.
    pub fn expected_bytes(start: u64, buf: &mut [u8]) {
        let (mut i, mut offset) = (0, start);
        while i < buf.len() {
            let w = word(offset / 8).to_le_bytes();
            let skip = (offset % 8) as usize;
            let n = (8 - skip).min(buf.len() - i);
            buf[i..i + n].copy_from_slice(&w[skip..skip + n]);
            i += n;
            offset += n as u64;
        }
    }

    /// Writes the model to `path` (created or truncated).
    ///
    /// # Errors
    /// The file cannot be written, or the size overflows.
    pub fn write(&self, path: &Path) -> Result<()> {
        let total = self.total_bytes()?;
        let io = |source: std::io::Error| Error::Io {
            op: "write",
            path: path.display().to_string(),
            source: source.into(),
        };
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
        let mut chunk = vec![0u8; 1 << 20];
        let mut offset = 0u64;
        while offset < total {
            let n = chunk.len().min((total - offset) as usize);
            SyntheticModel::expected_bytes(offset, &mut chunk[..n]);
            out.write_all(&chunk[..n]).map_err(io)?;
            offset += n as u64;
        }
        out.flush().map_err(io)
    }

    /// The sources of one layer from the file: weights in three adjacent pieces (gate,
    /// up, down), which the loader coalesces into one read, and the scales.
    pub fn sources<'a>(&self, file: &'a File, layer: usize) -> Vec<ExpertSource<'a>> {
        let third = self.weight_bytes / 3;
        (0..self.experts)
            .map(|e| {
                let w = self.offset(layer, e, Kind::Weights);
                ExpertSource::File {
                    weights: vec![
                        Piece::new(file, w, third),
                        Piece::new(file, w + third as u64, third),
                        Piece::new(file, w + 2 * third as u64, self.weight_bytes - 2 * third),
                    ],
                    scales: vec![Piece::new(
                        file,
                        self.offset(layer, e, Kind::Scales),
                        self.scale_bytes,
                    )],
                }
            })
            .collect()
    }

    /// Whether `bytes` are exactly the tensor's bytes.
    pub fn verify(&self, layer: usize, expert: usize, kind: Kind, bytes: &[u8]) -> bool {
        let want = match kind {
            Kind::Weights => self.weight_bytes,
            Kind::Scales => self.scale_bytes,
        };
        let start = self.offset(layer, expert, kind);
        let mut expected = [0u8; 1 << 14];
        bytes.len() == want
            && bytes.chunks(expected.len()).enumerate().all(|(i, chunk)| {
                let buf = &mut expected[..chunk.len()];
                SyntheticModel::expected_bytes(start + (i << 14) as u64, buf);
                buf == chunk
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_holds_the_stream_and_sources_cover_it() {
        let model = SyntheticModel {
            layers: 2,
            experts: 3,
            weight_bytes: 1000,
            scale_bytes: 13,
        };
        let dir = std::env::temp_dir().join(format!("numapin-synthetic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.bin");
        model.write(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, model.total_bytes().unwrap());
        assert!(
            bytes
                .iter()
                .enumerate()
                .all(|(i, &b)| b == SyntheticModel::byte_at(i as u64))
        );
        let file = File::open(&path).unwrap();
        let sources = model.sources(&file, 1);
        let ExpertSource::File {
            weights, scales, ..
        } = &sources[2]
        else {
            panic!("file source expected")
        };
        assert_eq!(weights.iter().map(|p| p.len).sum::<usize>(), 1000);
        assert_eq!(weights[0].offset, model.offset(1, 2, Kind::Weights));
        assert_eq!(
            (scales[0].offset, scales[0].len),
            (model.offset(1, 2, Kind::Scales), 13)
        );
        let start = model.offset(1, 2, Kind::Scales) as usize;
        assert!(model.verify(1, 2, Kind::Scales, &bytes[start..start + 13]));
        assert!(!model.verify(1, 1, Kind::Scales, &bytes[start..start + 13]));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
