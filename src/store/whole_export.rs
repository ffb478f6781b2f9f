//! A store's whole state for a whole-model export (`PlacedModel::export`): every copy of
//! every layer (replicas, a hybrid layer's hot copies), a share's expert ids, the slot
//! maps, the layout and the expert assignment, so that an attached store answers the same
//! lookups as the exporter's, each reader from its own node's copy.
//!
//! [`StorePart`] is serialized inside the model manifest (serde, unknown fields refused);
//! its regions name their file by index into the export's files.

use std::fs::File;

use serde::{Deserialize, Serialize};

use super::arena::{ABSENT, Arena};
use super::layer::{Arenas, Layer};
use super::manifest::ManifestRegion;
use super::shared::check_slots;
use super::slot_map::{SlotMap, SlotPiece};
use super::{ExpertAssignment, Home, HotCopies, Kind, LayerSpec, Layout, PinStore, State};
use super::{StoreOptions, table};
use crate::error::{Error, Result};
use crate::nodeset::Node;

const EXPORT: &str = "PlacedModel::export";
const ATTACH: &str = "PlacedModel::attach";

/// One store of a placed model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StorePart {
    /// [`Layout`]'s text form (`split:0-1`).
    pub(crate) layout: String,
    /// The expert assignment of a split (hybrid) store.
    pub(crate) assignment: Option<AssignmentPart>,
    pub(crate) piece_align: usize,
    pub(crate) piece_congruence: usize,
    /// [`StoreOptions::role_major`]; absent (1) in a manifest written before it.
    #[serde(default = "one_role")]
    pub(crate) role_major: usize,
    pub(crate) layers: Vec<LayerPart>,
}

fn one_role() -> usize {
    1
}

/// An [`ExpertAssignment`]: per layer, each expert's home node (`None`: hot).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AssignmentPart {
    pub(crate) per_domain: bool,
    pub(crate) layers: Vec<(usize, Vec<Option<u16>>)>,
}

/// One layer: its spec, its copies (the first copy first), ids and slot map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LayerPart {
    pub(crate) layer: usize,
    pub(crate) experts: usize,
    pub(crate) weight_bytes: usize,
    pub(crate) scale_bytes: usize,
    pub(crate) ids: Option<Vec<usize>>,
    /// The first copy, then the other replicas; `node` is `None` for a layer that is not
    /// replicated (then one copy).
    pub(crate) copies: Vec<CopyPart>,
    pub(crate) slot_map: Option<SlotMapPart>,
}

/// One copy of a layer: the node it is known by and its regions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CopyPart {
    pub(crate) node: Option<u16>,
    pub(crate) regions: Vec<RegionPart>,
}

/// One region: the store manifest's figures, its file's index and its slot order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RegionPart {
    pub(crate) file: usize,
    pub(crate) kind: String,
    pub(crate) len: usize,
    pub(crate) stride: usize,
    pub(crate) slot_bytes: usize,
    pub(crate) loaded: Vec<Option<usize>>,
    /// Expert → slot position (`None`: not held), where not by index.
    pub(crate) order: Option<Vec<Option<usize>>>,
}

/// A [`SlotMap`]'s tables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SlotMapPart {
    pub(crate) piece_align: usize,
    pub(crate) piece_congruence: usize,
    /// Per distinct layout, `[weights, scales]` pieces as `(offset, len)`.
    pub(crate) places: Vec<[Vec<(usize, usize)>; 2]>,
    pub(crate) of_expert: Vec<usize>,
    pub(crate) ids: Option<Vec<usize>>,
}

fn kind_of(name: &str) -> Result<Kind> {
    Kind::ALL
        .into_iter()
        .find(|k| k.name() == name)
        .ok_or_else(|| Error::bad_value(ATTACH, "region kind", name, "weights or scales"))
}

impl PinStore {
    /// Freezes every copy of every layer (as [`PinStore::export`]) and describes the
    /// store, appending its sealed files to `files`.
    pub(crate) fn export_part(&mut self, files: &mut Vec<File>) -> Result<StorePart> {
        if self.state == State::Broken {
            return Err(super::broken(EXPORT));
        }
        if !self.options.shared {
            return Err(Error::wrong_backing(
                EXPORT,
                "a store that is not memfd-backed",
                "memfd-backed arenas: place with StoreOptions::shared(true)",
            ));
        }
        self.state = State::Frozen;
        self.freeze_all()?;
        let mut layers = Vec::new();
        for (layer, l) in self.layers.iter() {
            layers.push(layer_part(layer, l, files)?);
        }
        Ok(StorePart {
            layout: self.layout.to_string(),
            assignment: self.options.assignment.as_ref().map(assignment_part),
            piece_align: self.options.piece_align,
            piece_congruence: self.options.piece_congruence,
            role_major: self.options.role_major,
            layers,
        })
    }

    /// Freezes every arena of every layer not frozen yet; a freeze that lost the arena's
    /// bytes breaks the store.
    fn freeze_all(&mut self) -> Result<()> {
        let indices: Vec<usize> = self.layers.iter().map(|(i, _)| i).collect();
        for &layer in &indices {
            let Some(l) = self.layers.get_mut(layer) else {
                continue;
            };
            for arena in l.all_arenas_mut() {
                if !arena.is_frozen()
                    && let Err((e, lost)) = arena.freeze()
                {
                    if lost {
                        self.state = State::Broken;
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// The store `part` describes, its regions mapped read-only from `files` (each taken
    /// once, by index). Every file is checked sealed and long enough before it is mapped
    /// (`Region::attach_shared`).
    pub(crate) fn attach_part(part: &StorePart, files: &mut [Option<File>]) -> Result<PinStore> {
        let layout: Layout = part.layout.parse()?;
        let assignment = part.assignment.as_ref().map(|a| {
            let shape = if a.per_domain {
                HotCopies::PerDomain
            } else {
                HotCopies::PerNode
            };
            a.layers.iter().fold(
                ExpertAssignment::new().hot_copies(shape),
                |acc, (l, homes)| {
                    let homes = homes
                        .iter()
                        .map(|h| h.map_or(Home::Hot, |n| Home::Node(Node(n))))
                        .collect();
                    acc.layer(*l, homes)
                },
            )
        });
        let options = StoreOptions {
            shared: true,
            assignment,
            piece_align: part.piece_align,
            piece_congruence: part.piece_congruence,
            // Checked by PinStore::new (0, or with an assignment: refused by name).
            role_major: part.role_major,
            ..StoreOptions::default()
        };
        let mut store = PinStore::new(layout, options)?;
        store.state = State::Frozen;
        for l in &part.layers {
            let layer = attach_layer(l, files)?;
            store
                .layers
                .set(l.layer, Box::new(layer))
                .map_err(|_| Error::bad_value(ATTACH, "layer", l.layer, "appears twice"))?;
        }
        Ok(store)
    }
}

/// Layer `layer` (`l`, frozen): its spec, ids and slot map, and every copy's regions, each
/// region's sealed file appended to `files`.
fn layer_part(layer: usize, l: &Layer, files: &mut Vec<File>) -> Result<LayerPart> {
    let replicas: Vec<(Option<Node>, &Arenas)> = if l.replica_nodes().is_empty() {
        vec![(None, l.first_copy())]
    } else {
        l.replicas().map(|(n, a)| (Some(n), a)).collect()
    };
    let mut copies = Vec::new();
    for (node, arenas) in replicas {
        let mut regions = Vec::new();
        for kind in Kind::ALL {
            let Some(arena) = arenas[kind.index()].as_ref() else {
                continue;
            };
            let file = arena.sealed_file().ok_or_else(|| {
                let found = format!("layer {layer} {} is not sealed", kind.name());
                Error::wrong_backing(EXPORT, found, "sealed regions")
            })?;
            let r = arena.to_manifest(layer, kind);
            regions.push(RegionPart {
                file: files.len(),
                kind: kind.name().to_owned(),
                len: r.len,
                stride: r.stride,
                slot_bytes: r.slot_bytes,
                loaded: r.loaded,
                order: arena.order_part(),
            });
            files.push(
                file.try_clone()
                    .map_err(|e| Error::io("dup", "store memfd", e))?,
            );
        }
        copies.push(CopyPart {
            node: node.map(|n| n.0),
            regions,
        });
    }
    let spec = l.spec();
    Ok(LayerPart {
        layer,
        experts: spec.experts,
        weight_bytes: spec.weight_bytes,
        scale_bytes: spec.scale_bytes,
        ids: l.ids().map(<[usize]>::to_vec),
        copies,
        slot_map: l.slot_map().map(SlotMap::to_part),
    })
}

/// The expert assignment of a split (hybrid) store: each expert's home node, `None` hot.
fn assignment_part(a: &ExpertAssignment) -> AssignmentPart {
    AssignmentPart {
        per_domain: a.hot_copy_shape() == HotCopies::PerDomain,
        layers: a
            .layers()
            .map(|(l, homes)| {
                let homes = homes
                    .iter()
                    .map(|h| match h {
                        Home::Node(n) => Some(n.0),
                        Home::Hot => None,
                    })
                    .collect();
                (l, homes)
            })
            .collect(),
    }
}

fn attach_layer(l: &LayerPart, files: &mut [Option<File>]) -> Result<Layer> {
    if l.layer >= table::MAX_INDEX {
        return Err(Error::OutOfRange {
            op: ATTACH,
            what: "layer".to_owned(),
            index: l.layer,
            len: table::MAX_INDEX,
        });
    }
    let spec = LayerSpec {
        experts: l.experts,
        weight_bytes: l.weight_bytes,
        scale_bytes: l.scale_bytes,
    };
    let mut copies: Vec<(Option<Node>, Arenas)> = Vec::new();
    for c in &l.copies {
        let mut arenas: Arenas = Default::default();
        for r in &c.regions {
            let kind = kind_of(&r.kind)?;
            let arena = attach_region(l, r, kind, files)?;
            if arenas[kind.index()].replace(arena).is_some() {
                return Err(Error::bad_value(
                    ATTACH,
                    "region",
                    format!("layer {} {}", l.layer, kind.name()),
                    "appears twice in one copy",
                ));
            }
        }
        copies.push((c.node.map(Node), arenas));
    }
    let mut copies = copies.into_iter();
    let Some((first_node, first)) = copies.next() else {
        return Err(Error::empty(ATTACH, format!("copies of layer {}", l.layer)));
    };
    if first[Kind::Weights.index()].is_none() {
        return Err(Error::empty(
            ATTACH,
            format!("weights region in layer {}", l.layer),
        ));
    }
    let ids = match &l.ids {
        Some(ids) if ids.len() != l.experts || ids.windows(2).any(|w| w[0] >= w[1]) => {
            return Err(Error::bad_value(
                ATTACH,
                "layer",
                l.layer,
                format!("the share's ids are not {} increasing ids", l.experts),
            ));
        }
        ids => ids.clone().map(Vec::into_boxed_slice),
    };
    let mut layer = Layer::new(spec, first).with_ids(ids);
    let rest: Vec<(Option<Node>, Arenas)> = copies.collect();
    match first_node {
        Some(node) => {
            let mut replicas = Vec::new();
            for (n, a) in rest {
                let n = n.ok_or_else(|| {
                    Error::bad_value(ATTACH, "layer", l.layer, "a copy without its node")
                })?;
                replicas.push((n, a));
            }
            layer = layer.with_replicas(node, replicas);
        }
        None if !rest.is_empty() => {
            return Err(Error::bad_value(
                ATTACH,
                "layer",
                l.layer,
                "several copies, the first without a node",
            ));
        }
        None => {}
    }
    if let Some(map) = &l.slot_map {
        layer = layer.with_slot_map(SlotMap::from_part(l.layer, map, l.experts)?);
    }
    Ok(layer)
}

/// One region checked against its layer and mapped from its file (taken).
fn attach_region(
    l: &LayerPart,
    r: &RegionPart,
    kind: Kind,
    files: &mut [Option<File>],
) -> Result<Arena> {
    let what = || format!("layer {} {}", l.layer, kind.name());
    let m = ManifestRegion {
        layer: l.layer,
        kind,
        len: r.len,
        stride: r.stride,
        slot_bytes: r.slot_bytes,
        loaded: r.loaded.clone(),
    };
    check_slots(ATTACH, &m)?;
    let slots = r.loaded.len();
    let order = match &r.order {
        None if slots == l.experts => None,
        None => {
            return Err(Error::mismatch(
                ATTACH,
                format!("{}: slots", what()),
                l.experts,
                slots,
            ));
        }
        Some(order) => {
            let mut seen = vec![false; slots];
            let mut positions = Vec::with_capacity(order.len());
            for p in order {
                match *p {
                    None => positions.push(ABSENT),
                    Some(p) if p < slots && !seen[p] => {
                        seen[p] = true;
                        positions.push(p);
                    }
                    Some(p) => {
                        let why = match p < slots {
                            true => format!("slot {p} twice"),
                            false => format!("slot {p} out of range (it has {slots})"),
                        };
                        return Err(Error::bad_value(ATTACH, "slot order", what(), why));
                    }
                }
            }
            if order.len() != l.experts {
                return Err(Error::mismatch(
                    ATTACH,
                    format!("{}: its slot order's experts", what()),
                    l.experts,
                    order.len(),
                ));
            }
            Some(std::sync::Arc::<[usize]>::from(positions))
        }
    };
    let file = files
        .get_mut(r.file)
        .ok_or(Error::OutOfRange {
            op: ATTACH,
            what: format!("{}: file index", what()),
            index: r.file,
            len: 0,
        })?
        .take()
        .ok_or_else(|| Error::bad_value(ATTACH, "file index", r.file, "used by two regions"))?;
    let arena = Arena::attach(&m, file)?;
    Ok(match order {
        Some(o) => arena.with_order(o),
        None => arena,
    })
}

impl SlotMap {
    fn to_part(&self) -> SlotMapPart {
        let (piece_align, piece_congruence, places, of_expert, ids) = self.tables();
        SlotMapPart {
            piece_align,
            piece_congruence,
            places: places
                .iter()
                .map(|p| {
                    p.clone()
                        .map(|ps| ps.iter().map(|s| (s.offset, s.len)).collect())
                })
                .collect(),
            of_expert: of_expert.to_vec(),
            ids: ids.map(<[usize]>::to_vec),
        }
    }

    fn from_part(layer: usize, part: &SlotMapPart, experts: usize) -> Result<SlotMap> {
        if part.of_expert.len() != experts {
            return Err(Error::mismatch(
                ATTACH,
                format!("layer {layer}'s slot map: entries, one per slot"),
                experts,
                part.of_expert.len(),
            ));
        }
        if let Some(&i) = part.of_expert.iter().find(|&&i| i >= part.places.len()) {
            return Err(Error::bad_value(
                ATTACH,
                "slot map",
                format!("of layer {layer}"),
                format!(
                    "a slot names layout {i}, which it does not have (it has {})",
                    part.places.len()
                ),
            ));
        }
        let places = part
            .places
            .iter()
            .map(|p| {
                p.clone().map(|ps| {
                    ps.into_iter()
                        .map(|(offset, len)| SlotPiece { offset, len })
                        .collect::<Box<[SlotPiece]>>()
                })
            })
            .collect();
        Ok(SlotMap::from_tables(
            (part.piece_align, part.piece_congruence),
            places,
            part.of_expert.clone(),
            part.ids.clone().map(Vec::into_boxed_slice),
        ))
    }
}
