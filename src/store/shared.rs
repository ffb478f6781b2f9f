//! Sharing a loaded store: one process loads and places the model once into memfd
//! arenas, exports their fds and a manifest, and worker processes attach them read-only,
//! serving the same pages without copying or re-reading the file.

use std::collections::BTreeMap;
use std::fs::File;

use super::arena::Arena;
use super::layer::Layer;
use super::manifest::{Manifest, ManifestRegion};
use super::{Kind, LayerSpec, Layout, PinStore, State, StoreOptions};
use crate::error::{Error, Result};

/// What [`PinStore::export`] hands out: the manifest and one sealed memfd per region
/// (close on exec; clear that flag on the ones a child should inherit). The files carry
/// `F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW`: whoever holds them can read and map them,
/// and nobody can change them.
#[derive(Debug)]
pub struct Export {
    /// The layout.
    pub manifest: Manifest,
    /// The memfds, in the manifest's order.
    pub files: Vec<File>,
}

impl PinStore {
    /// Freezes the store and hands out its memfd arenas for other processes to attach:
    /// duplicated fds and a manifest.
    ///
    /// Freezing makes the store immutable, proven by the kernel: each arena is re-mapped
    /// in place (same address, same pages) private and read-only, locked again if it was
    /// locked, its loaded slots faulted in for reading, and its file sealed with
    /// `F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW`. From then on
    /// [`PinStore::release`], [`PinStore::ensure`] and [`PinStore::pack_layer`] answer
    /// [`Error::Frozen`]; reads work as before. Exporting again hands out the same files.
    ///
    /// `export` takes `&mut self`, so no slice of the store is live while it re-maps:
    /// ```compile_fail,E0502
    /// # use numapin::store::{Layout, PinStore, StoreOptions};
    /// let mut store = PinStore::new(Layout::Unplaced, StoreOptions::default().shared(true))?;
    /// let weights = store.weights(0, 0)?;
    /// let export = store.export()?;
    /// println!("{}", weights.len());
    /// # Ok::<(), numapin::Error>(())
    /// ```
    ///
    /// # Errors
    /// The store was not built with [`StoreOptions::shared`]; or re-mapping, locking,
    /// populating, sealing or duplicating fails. A failed re-map has already unmapped
    /// that arena (the kernel's `MAP_FIXED` semantics): the store is then unusable, and
    /// every later call answers [`Error::Unusable`] rather than touching the lost range.
    pub fn export(&mut self) -> Result<Export> {
        const OP: &str = "PinStore::export";
        if self.state == State::Broken {
            return Err(super::broken(OP));
        }
        if !self.options.shared {
            return Err(Error::wrong_backing(
                OP,
                "the store is not memfd-backed",
                "memfd-backed arenas: set StoreOptions::shared",
            ));
        }
        // The manifest has no place for a share's expert ids: an attached copy would
        // answer slot numbers for global ids. Refused until it does.
        if let Some((layer, _)) = self.layers.iter().find(|(_, l)| l.ids().is_some()) {
            return Err(Error::wrong_backing(
                OP,
                format!("layer {layer} holds a share of its experts"),
                "whole layers: the store manifest carries no expert ids yet (PlacedModel's \
                 does)",
            ));
        }
        // Its manifest has no place for replicas or a slot order: PlacedModel's has.
        if let Some((layer, _)) = self
            .layers
            .iter()
            .find(|(_, l)| !l.replica_nodes().is_empty() || l.all_arenas().any(Arena::has_order))
        {
            return Err(Error::wrong_backing(
                OP,
                format!("layer {layer} has replicas or a hybrid slot order"),
                "one copy per layer in slot order, all the store manifest describes \
                 (PlacedModel::export describes replicas and hybrid orders)",
            ));
        }
        self.state = State::Frozen;
        let indices: Vec<usize> = self.layers.iter().map(|(i, _)| i).collect();
        for &layer in &indices {
            let Some(l) = self.layers.get_mut(layer) else {
                continue;
            };
            for arena in l.arenas_mut() {
                if let Err((e, lost)) = arena.freeze() {
                    if lost {
                        self.state = State::Broken;
                    }
                    return Err(e);
                }
            }
        }
        let mut manifest = Manifest::default();
        let mut files = Vec::new();
        for (layer, l) in self.layers.iter() {
            for (kind, arena) in l.arenas_by_kind() {
                let file = arena.sealed_file().ok_or_else(|| {
                    let found = format!("layer {layer} {} is not sealed", kind.name());
                    Error::wrong_backing(OP, found, "sealed regions (StoreOptions::shared)")
                })?;
                files.push(
                    file.try_clone()
                        .map_err(|e| Error::io("dup", "store memfd", e))?,
                );
                manifest.regions.push(arena.to_manifest(layer, kind));
            }
        }
        Ok(Export { manifest, files })
    }

    /// Maps an exported store read-only: the same pages as the exporter's, no copy. The
    /// attached store serves [`PinStore::weights`] / [`PinStore::scales`] and
    /// [`PinStore::stats`]; release, ensure and pack_layer answer [`Error::Frozen`].
    ///
    /// Every file must be a memfd sealed with `F_SEAL_WRITE | F_SEAL_SHRINK |
    /// F_SEAL_GROW` (as [`PinStore::export`] leaves them) and at least as long as its
    /// region: the kernel then guarantees that no process can change or truncate the
    /// bytes this store hands out as `&[u8]`. Anything else — a plain file, an unsealed
    /// or write-sealable memfd, a short one — is refused.
    ///
    /// # Errors
    /// The manifest and files disagree (count, lengths, slots that do not fit), a layer
    /// has no weights region, a file is not sealed or too short, or mapping fails.
    pub fn attach(manifest: &Manifest, files: Vec<File>) -> Result<PinStore> {
        if manifest.regions.len() != files.len() {
            return Err(Error::mismatch(
                ATTACH,
                "files, one per region of the manifest",
                manifest.regions.len(),
                files.len(),
            ));
        }
        let mut store = PinStore::new(
            Layout::Unplaced,
            StoreOptions {
                shared: true,
                ..StoreOptions::default()
            },
        )?;
        store.state = State::Frozen;
        for (layer, arenas) in attach_regions(manifest, files)? {
            let attached = attached_layer(layer, arenas)?;
            store
                .layers
                .set(layer, Box::new(attached))
                .map_err(|_| Error::bad_value(ATTACH, "layer", layer, "appears twice"))?;
        }
        Ok(store)
    }
}

const ATTACH: &str = "PinStore::attach";

/// Each region of the manifest checked ([`check_region`]) and mapped from its file,
/// gathered by layer as `[weights, scales]`; a region twice is refused.
fn attach_regions(
    manifest: &Manifest,
    files: Vec<File>,
) -> Result<BTreeMap<usize, [Option<Arena>; 2]>> {
    let mut pending: BTreeMap<usize, [Option<Arena>; 2]> = BTreeMap::new();
    for (r, file) in manifest.regions.iter().zip(files) {
        check_region(r, &file)?;
        let arena = Arena::attach(r, file)?;
        let place = &mut pending.entry(r.layer).or_default()[r.kind.index()];
        if place.replace(arena).is_some() {
            return Err(Error::bad_value(
                ATTACH,
                "layer",
                format!("{} {}", r.layer, r.kind.name()),
                "appears twice",
            ));
        }
    }
    Ok(pending)
}

/// A manifest region before its file is mapped: a layer a store can hold, slots that fit
/// the region, and the memfd export named for this region.
fn check_region(r: &ManifestRegion, file: &File) -> Result<()> {
    if r.layer >= super::table::MAX_INDEX {
        return Err(Error::OutOfRange {
            op: ATTACH,
            what: "layer".to_string(),
            index: r.layer,
            len: super::table::MAX_INDEX,
        });
    }
    check_slots(ATTACH, r)?;
    // Regions of one shape are told apart only by the memfd names export gave
    // them: a file out of the manifest's order would serve another layer's bytes.
    let expected = format!("numapin-layer{}-{}", r.layer, r.kind.name());
    if let Some(name) = memfd_name(file)
        && name.starts_with("numapin-layer")
        && name != expected
    {
        return Err(Error::bad_value(
            ATTACH,
            "file",
            format!("for layer {} {}", r.layer, r.kind.name()),
            format!(
                "it is the memfd {name:?}, not {expected:?}: the files are not in the \
                 manifest's order"
            ),
        ));
    }
    Ok(())
}

/// Refuses a region whose slots do not fit it ([`Invalid::BadValue`], what `"region"`):
/// its slot count at its stride past its length, a slot wider than the stride, or more
/// bytes loaded in a slot than it holds.
///
/// [`Invalid::BadValue`]: crate::Invalid::BadValue
pub(super) fn check_slots(op: &'static str, r: &ManifestRegion) -> Result<()> {
    let slots = r.loaded.len();
    let most = r.loaded.iter().flatten().max().copied().unwrap_or(0);
    let fits = r.stride.checked_mul(slots).is_some_and(|n| n <= r.len)
        && r.slot_bytes <= r.stride
        && most <= r.slot_bytes;
    if fits {
        return Ok(());
    }
    Err(Error::bad_value(
        op,
        "region",
        format!("layer {} {}", r.layer, r.kind.name()),
        format!(
            "slots do not fit the region: {slots} of {} bytes (at most {most} loaded) at a \
             stride of {} in {} bytes",
            r.slot_bytes, r.stride, r.len
        ),
    ))
}

/// A layer of attached regions: it has weights, and all its regions the same slots.
fn attached_layer(layer: usize, arenas: [Option<Arena>; 2]) -> Result<Layer> {
    let weights = arenas[Kind::Weights.index()]
        .as_ref()
        .ok_or_else(|| Error::empty(ATTACH, format!("weights region in layer {layer}")))?;
    let experts = weights.slots();
    if let Some(other) = arenas.iter().flatten().find(|a| a.slots() != experts) {
        return Err(Error::mismatch(
            ATTACH,
            format!("slots of layer {layer}'s regions: the weights' against another's"),
            experts,
            other.slots(),
        ));
    }
    let spec = LayerSpec {
        experts,
        weight_bytes: weights.slot_bytes(),
        scale_bytes: arenas[Kind::Scales.index()]
            .as_ref()
            .map_or(0, Arena::slot_bytes),
    };
    Ok(Layer::new(spec, arenas))
}

/// The name a memfd was created with (`/proc/self/fd/N` reads `/memfd:NAME (deleted)`);
/// `None` for other files or where `/proc` cannot tell.
fn memfd_name(file: &File) -> Option<String> {
    use std::os::fd::AsRawFd;
    let link = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).ok()?;
    let name = link.to_str()?.strip_prefix("/memfd:")?;
    Some(name.strip_suffix(" (deleted)").unwrap_or(name).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_store_answers_every_call_with_an_error() {
        let options = StoreOptions {
            shared: true,
            ..StoreOptions::default()
        };
        let mut store = PinStore::new(Layout::Unplaced, options).unwrap();
        let (w, s) = (vec![3u8; 100], vec![4u8; 10]);
        let source = crate::store::ExpertSource::Memory {
            weights: &w,
            scales: &s,
        };
        let spec = crate::store::LayerSpec {
            experts: 1,
            weight_bytes: 100,
            scale_bytes: 10,
        };
        store
            .pack_layer(0, &spec, std::slice::from_ref(&source))
            .unwrap();
        // What a failed MAP_FIXED in export leaves behind.
        store.state = State::Broken;
        let unusable = |e: Error| matches!(e, Error::Unusable { .. });
        assert!(unusable(store.weights(0, 0).unwrap_err()));
        assert!(unusable(store.scales(0, 0).unwrap_err()));
        assert!(unusable(store.stats().unwrap_err()));
        assert!(unusable(store.export().unwrap_err()));
        assert!(unusable(store.release(0, 0).unwrap_err()));
        assert!(unusable(store.ensure(0, 0, &source).unwrap_err()));
        assert!(unusable(
            store
                .pack_layer(1, &spec, std::slice::from_ref(&source))
                .unwrap_err()
        ));
    }
}
