//! Sharing a loaded store: one process loads and places the model once into memfd
//! arenas, exports their fds and a manifest, and worker processes attach them read-only,
//! serving the same pages without copying or re-reading the file.

use std::fmt::Write as _;
use std::fs::File;

use super::arena::{Arena, Kind};
use super::{Layer, Layout, PinStore, StoreOptions};
use crate::error::{Error, Result};
use crate::region::{Region, Seals};

/// One exported region: which layer and tensor, its length, stride, slot size, and the
/// bytes loaded in each slot (`None`: released).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ManifestRegion {
    /// The layer.
    pub layer: usize,
    /// Weights or scales.
    pub kind: Kind,
    /// Bytes of the region (and at most of its file).
    pub len: usize,
    /// Distance between slots.
    pub stride: usize,
    /// The most bytes a slot holds.
    pub slot_bytes: usize,
    /// Loaded bytes per slot.
    pub loaded: Vec<Option<usize>>,
}

/// The layout of an exported store, in the order of [`Export::files`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Manifest {
    /// The regions.
    pub regions: Vec<ManifestRegion>,
}

const HEADER: &str = "numapin-store 1";

impl Manifest {
    /// A line-based text form, for a file or a pipe to the workers.
    pub fn to_text(&self) -> String {
        let mut out = format!("{HEADER}\n");
        for r in &self.regions {
            let loaded: Vec<String> = r
                .loaded
                .iter()
                .map(|l| l.map_or("-".to_string(), |n| n.to_string()))
                .collect();
            let _ = writeln!(
                out,
                "region {} {} len={} stride={} slot_bytes={} loaded={}",
                r.layer,
                r.kind.name(),
                r.len,
                r.stride,
                r.slot_bytes,
                loaded.join(",")
            );
        }
        out
    }

    /// Parses [`Manifest::to_text`].
    ///
    /// # Errors
    /// Any line that is not what `to_text` writes, quoted.
    pub fn parse(text: &str) -> Result<Manifest> {
        let bad =
            |line: &str, why: &str| Error::invalid("Manifest::parse", format!("{why}: {line:?}"));
        let mut lines = text.lines();
        if lines.next() != Some(HEADER) {
            return Err(bad(
                text.lines().next().unwrap_or(""),
                "not a numapin store manifest",
            ));
        }
        let mut regions = Vec::new();
        for line in lines.filter(|l| !l.trim().is_empty()) {
            let words: Vec<&str> = line.split_whitespace().collect();
            let [_, layer, kind, len, stride, slot_bytes, loaded] = words[..] else {
                return Err(bad(line, "expected 7 fields"));
            };
            let field = |word: &str, key: &str| -> Result<usize> {
                word.strip_prefix(key)
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| bad(line, &format!("expected {key}<number>")))
            };
            let kind = match kind {
                "weights" => Kind::Weights,
                "scales" => Kind::Scales,
                _ => return Err(bad(line, "kind is weights or scales")),
            };
            let loaded = loaded
                .strip_prefix("loaded=")
                .ok_or_else(|| bad(line, "expected loaded="))?
                .split(',')
                .map(|v| match v {
                    "-" => Ok(None),
                    v => v
                        .parse()
                        .map(Some)
                        .map_err(|_| bad(line, "bad slot length")),
                })
                .collect::<Result<Vec<_>>>()?;
            regions.push(ManifestRegion {
                layer: layer.parse().map_err(|_| bad(line, "bad layer"))?,
                kind,
                len: field(len, "len=")?,
                stride: field(stride, "stride=")?,
                slot_bytes: field(slot_bytes, "slot_bytes=")?,
                loaded,
            });
        }
        Ok(Manifest { regions })
    }
}

/// What [`PinStore::export`] hands out: the manifest and one memfd per region (close on
/// exec; clear that flag on the ones a child should inherit).
#[derive(Debug)]
pub struct Export {
    /// The layout.
    pub manifest: Manifest,
    /// The memfds, in the manifest's order.
    pub files: Vec<File>,
}

impl PinStore {
    /// Hands out the store's memfd arenas for other processes to attach: duplicated fds
    /// and a manifest. Each file is sealed against growing and shrinking first, so no
    /// attached mapping can SIGBUS. Releasing or reloading a slot afterwards is visible
    /// to every process that attached it (it is the same memory).
    ///
    /// # Errors
    /// The store was not built with [`StoreOptions::shared`], or sealing or duplicating a
    /// file fails.
    pub fn export(&self) -> Result<Export> {
        let mut manifest = Manifest::default();
        let mut files = Vec::new();
        for (layer, l) in self.layers.iter() {
            for (kind, arena) in [
                (Kind::Weights, Some(&l.weights)),
                (Kind::Scales, l.scales.as_ref()),
            ] {
                let Some(arena) = arena else { continue };
                let file = arena.region.memfd_file().ok_or_else(|| {
                    Error::invalid(
                        "PinStore::export",
                        "the store is not memfd-backed: set StoreOptions::shared",
                    )
                })?;
                arena.region.seal(Seals::GROW | Seals::SHRINK)?;
                files.push(
                    file.try_clone()
                        .map_err(|e| Error::io("dup", "store memfd", e))?,
                );
                manifest.regions.push(ManifestRegion {
                    layer,
                    kind,
                    len: arena.region.len(),
                    stride: arena.stride,
                    slot_bytes: arena.slot_bytes,
                    loaded: arena.loaded.clone(),
                });
            }
        }
        Ok(Export { manifest, files })
    }

    /// Maps an exported store read-only: the same pages as the exporter's, no copy. The
    /// attached store serves [`PinStore::weights`] / [`PinStore::scales`] and
    /// [`PinStore::stats`]; release and ensure are refused (the memory is the exporter's).
    ///
    /// # Errors
    /// The manifest and files disagree (count, lengths, slots that do not fit), a layer
    /// has no weights region, or mapping fails.
    pub fn attach(manifest: &Manifest, files: Vec<File>) -> Result<PinStore> {
        const OP: &str = "PinStore::attach";
        if manifest.regions.len() != files.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} regions in the manifest but {} files",
                    manifest.regions.len(),
                    files.len()
                ),
            ));
        }
        let store = PinStore::new(
            Layout::Unplaced,
            StoreOptions {
                shared: true,
                ..StoreOptions::default()
            },
        )?;
        let mut pending: std::collections::BTreeMap<usize, (Option<Arena>, Option<Arena>)> =
            Default::default();
        for (r, file) in manifest.regions.iter().zip(files) {
            let slots = r.loaded.len();
            let fits = r.stride.checked_mul(slots).is_some_and(|n| n <= r.len)
                && r.slot_bytes <= r.stride
                && r.loaded.iter().flatten().all(|&n| n <= r.slot_bytes);
            if !fits {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "layer {} {}: slots do not fit the region",
                        r.layer,
                        r.kind.name()
                    ),
                ));
            }
            let arena = Arena {
                region: Region::attach_shared(file, r.len)?,
                stride: r.stride,
                slot_bytes: r.slot_bytes,
                loaded: r.loaded.clone(),
            };
            let entry = pending.entry(r.layer).or_default();
            match r.kind {
                Kind::Weights => entry.0 = Some(arena),
                Kind::Scales => entry.1 = Some(arena),
            }
        }
        for (layer, (weights, scales)) in pending {
            let weights = weights.ok_or_else(|| {
                Error::invalid(OP, format!("layer {layer} has no weights region"))
            })?;
            if scales
                .as_ref()
                .is_some_and(|s| s.loaded.len() != weights.loaded.len())
            {
                return Err(Error::invalid(
                    OP,
                    format!("layer {layer}: weights and scales differ in slots"),
                ));
            }
            store
                .layers
                .set(layer, Box::new(Layer { weights, scales }))
                .map_err(|_| Error::invalid(OP, format!("layer {layer} appears twice")))?;
        }
        Ok(store)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_text_round_trips_and_rejects_garbage() {
        let m = Manifest {
            regions: vec![ManifestRegion {
                layer: 3,
                kind: Kind::Scales,
                len: 8192,
                stride: 4096,
                slot_bytes: 100,
                loaded: vec![Some(100), None],
            }],
        };
        assert_eq!(Manifest::parse(&m.to_text()).unwrap(), m);
        assert!(Manifest::parse("numapin-store 2\n").is_err());
        assert!(Manifest::parse("numapin-store 1\nregion 1 weights len=1\n").is_err());
        assert!(
            Manifest::parse(
                "numapin-store 1\nregion 1 both len=1 stride=1 slot_bytes=1 loaded=1\n"
            )
            .is_err()
        );
    }
}
