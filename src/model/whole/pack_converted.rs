//! Placing a converted dense group: each tensor's file bytes read, converted
//! ([`Conversion`]) and packed as its group's slot; the report's lines for them.

use std::collections::HashMap;

use super::assign::{Assigned, Group, converted_layout};
use super::convert::Conversion;
use super::report::nanos_since;
use super::views::{DenseStore, Place};
use crate::error::{Error, Result, quote};
use crate::model::Checkpoint;
use crate::store::{ExpertSource, Kind, LayerSpec};

const OP: &str = "Checkpoint::place";

impl Checkpoint {
    /// Packs converted group `g`: each tensor's file bytes read, converted, laid out at
    /// multiples of [`DENSE_ALIGN`] in one buffer, packed as the slot; records where each
    /// tensor landed.
    pub(super) fn pack_converted(
        &self,
        assigned: &Assigned,
        g: &Group,
        stores: &mut [DenseStore],
        places: &mut HashMap<usize, Place>,
    ) -> Result<()> {
        let packed: Vec<usize> = g
            .tensors
            .iter()
            .copied()
            .filter(|&i| !self.tensors[i].is_empty())
            .collect();
        if packed.is_empty() {
            return Ok(());
        }
        let (offsets, total) = converted_layout(packed.iter().map(|&i| assigned.held_len(self, i)));
        let total = usize::try_from(total)
            .map_err(|_| Error::overflow(OP, format!("a converted group of {total} bytes")))?;
        let mut slot = Vec::with_capacity(total);
        let mut file_bytes = Vec::new();
        let started = std::time::Instant::now();
        let mut reads = 0;
        for (&i, &at) in packed.iter().zip(&offsets) {
            let t = &self.tensors[i];
            let file = self
                .files
                .get(t.file())
                .ok_or_else(|| Error::bad_value(OP, "a tensor's file", t.file(), "no such file"))?;
            let len = usize::try_from(t.len()).map_err(|_| {
                Error::overflow(OP, format!("{}: {} bytes", quote(t.name()), t.len()))
            })?;
            file_bytes.resize(len, 0);
            std::os::unix::fs::FileExt::read_exact_at(file.file(), &mut file_bytes, t.offset())
                .map_err(|e| {
                    Error::io(
                        OP,
                        format!(
                            "pread of {} ({len} bytes at {}) in {}",
                            quote(t.name()),
                            t.offset(),
                            file.path().display()
                        ),
                        e,
                    )
                })?;
            reads += 1;
            slot.resize(usize::try_from(at).unwrap_or(usize::MAX), 0);
            match assigned.converts[i] {
                Some(conversion) => conversion.apply(&file_bytes, &mut slot),
                None => slot.extend_from_slice(&file_bytes),
            }
        }
        let sources = [ExpertSource::Memory {
            weights: &slot,
            scales: &[],
        }];
        let spec = LayerSpec::fitting(&sources)?;
        let dense = &mut stores[g.store];
        let report = dense.store.pack_layer(g.slot_layer, &spec, &sources)?;
        dense.load_nanos += nanos_since(started);
        dense.reads += reads;
        let map = dense.store.slot_map(g.slot_layer)?;
        let base = map
            .pieces(0, Kind::Weights)
            .unwrap_or_default()
            .first()
            .map_or(0, |p| p.offset);
        drop(report);
        for (&i, &at) in packed.iter().zip(&offsets) {
            let len = assigned.held_len(self, i);
            places.insert(
                i,
                Place::Dense {
                    store: g.store,
                    layer: g.slot_layer,
                    offset: base + usize::try_from(at).unwrap_or(usize::MAX),
                    len: usize::try_from(len).unwrap_or(usize::MAX),
                },
            );
        }
        Ok(())
    }
}

/// The report's lines for the tensors converted at placement.
pub(super) fn report_lines(
    checkpoint: &Checkpoint,
    converts: &[Option<Conversion>],
) -> Vec<String> {
    checkpoint
        .tensors()
        .iter()
        .zip(converts)
        .filter_map(|(t, c)| {
            let c = (*c)?;
            Some(format!(
                "{} {c} ({} bytes in the file, {} placed)",
                t.name(),
                t.len(),
                c.placed_len(t.len())
            ))
        })
        .collect()
}
