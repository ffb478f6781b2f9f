//! One bound region holding the same kind of tensor (weights or scales) of every expert of
//! a layer, at a fixed stride.

use std::fs::File;
use std::ops::Range;

use super::manifest::ManifestRegion;
use crate::error::{Error, Result};
use crate::policy::{MbindFlags, MemPolicy, Observed, Placement};
use crate::region::{Advice, Region};
use crate::source::Kind;

/// Transparent huge page size on x86-64 and most arm64 kernels.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// What an arena's region is made of.
pub(crate) enum Backing {
    /// Private anonymous memory, with or without transparent huge pages.
    Anonymous { huge_pages: bool },
    /// A memfd that other processes can attach.
    Memfd { name: String },
}

impl Backing {
    pub(crate) fn of(options: &super::StoreOptions, layer: usize) -> Backing {
        if options.shared {
            Backing::Memfd {
                name: format!("numapin-layer{layer}"),
            }
        } else {
            Backing::Anonymous {
                huge_pages: options.huge_pages,
            }
        }
    }
}

/// A region with `slots` slots of `stride` bytes, each holding up to `slot_bytes`.
#[derive(Debug)]
pub(crate) struct Arena {
    region: Region,
    stride: usize,
    slot_bytes: usize,
    /// Bytes loaded in each slot (by position); `None` when never loaded or released.
    loaded: Vec<Option<usize>>,
    /// Where expert `i`'s slot is, when not at `i` (a split by an
    /// [`ExpertAssignment`](super::ExpertAssignment): the slots go node by node);
    /// [`ABSENT`] marks an expert the arena does not hold (a hybrid layer's copies of its
    /// hot experts). Every method takes expert numbers; only [`Arena::bind_slots`] takes
    /// slot positions.
    order: Option<std::sync::Arc<[usize]>>,
}

/// In an arena's slot order: the arena holds no slot for this expert.
pub(crate) const ABSENT: usize = usize::MAX;

/// The stride for slots of `slot_bytes`: the size rounded up to `align` (a power of two
/// at least the page size; see [`SlotAlign`](super::SlotAlign)). `None` on overflow.
pub(crate) fn stride_for(slot_bytes: usize, align: usize) -> Option<usize> {
    slot_bytes.checked_next_multiple_of(align)
}

impl Arena {
    /// Reserves the region: `slots` slots of `slot_bytes` rounded up to `align`, with the
    /// region 2 MiB-aligned and `MADV_HUGEPAGE` when huge pages are on, so that THP backs
    /// the region whatever the slot size (padding each slot to 2 MiB would make a store of
    /// 2.65 MB experts 1.6× the model). Nothing is touched: the caller binds before
    /// populating.
    pub(crate) fn reserve(
        kind: Kind,
        slots: usize,
        slot_bytes: usize,
        align: usize,
        backing: &Backing,
    ) -> Result<Arena> {
        let huge_pages = matches!(backing, Backing::Anonymous { huge_pages: true });
        let overflow = || {
            Error::overflow(
                "PinStore::pack_layer",
                format!(
                    "the address space of {slots} {} slots of {slot_bytes} bytes",
                    kind.name()
                ),
            )
        };
        let stride = stride_for(slot_bytes, align).ok_or_else(overflow)?;
        let len = stride.checked_mul(slots).ok_or_else(overflow)?;
        let region = if let Backing::Memfd { name } = backing {
            Region::memfd(&format!("{name}-{}", kind.name()), len)?
        } else if huge_pages {
            let region = Region::anonymous_aligned(len, HUGE_PAGE)?;
            region.advise(Advice::HugePage)?;
            region
        } else {
            // Explicitly small pages, also where THP is `always`: one huge page lands on
            // one node, which coarsens interleaving to 2 MiB.
            let region = Region::anonymous(len)?;
            region.advise(Advice::NoHugePage)?;
            region
        };
        Ok(Arena {
            region,
            stride,
            slot_bytes,
            loaded: vec![None; slots],
            order: None,
        })
    }

    /// An attached arena: a sealed memfd mapped read-only, described by `r`.
    pub(crate) fn attach(r: &ManifestRegion, file: File) -> Result<Arena> {
        Ok(Arena {
            region: Region::attach_shared(file, r.len)?,
            stride: r.stride,
            slot_bytes: r.slot_bytes,
            loaded: r.loaded.clone(),
            order: None,
        })
    }

    /// The manifest line of this arena.
    pub(crate) fn to_manifest(&self, layer: usize, kind: Kind) -> ManifestRegion {
        ManifestRegion {
            layer,
            kind,
            len: self.region.len(),
            stride: self.stride,
            slot_bytes: self.slot_bytes,
            loaded: self.loaded.clone(),
        }
    }

    /// Lays expert `i` at slot `order[i]` ([`ABSENT`]: not held), each slot used once
    /// (checked by the caller: [`SlotOrder`](super::assign::SlotOrder)).
    pub(crate) fn with_order(mut self, order: std::sync::Arc<[usize]>) -> Arena {
        self.order = Some(order);
        self
    }

    /// The slot position of expert `i` (`None`: the arena does not hold it).
    fn position(&self, i: usize) -> Option<usize> {
        match &self.order {
            Some(o) => o.get(i).copied().filter(|&p| p != ABSENT),
            None => Some(i),
        }
    }

    /// Whether the arena has a slot for expert `i`.
    pub(crate) fn holds(&self, i: usize) -> bool {
        self.position(i).is_some_and(|p| p < self.loaded.len())
    }

    pub(crate) fn bind(&self, policy: &MemPolicy) -> Result<Placement> {
        self.region.bind(policy, MbindFlags::empty())
    }

    /// Binds slots `slots` only (one `mbind` over their strides).
    pub(crate) fn bind_slots(&self, slots: Range<usize>, policy: &MemPolicy) -> Result<Placement> {
        let range = slots.start * self.stride..slots.end * self.stride;
        self.region.bind_part(range, policy, MbindFlags::empty())
    }

    /// Copies slot `i` of `from` (an arena of the same shape) into slot `i`, and marks
    /// it loaded with the same length; a released slot of `from` is an error. Returns
    /// the bytes copied.
    pub(crate) fn copy_slot_from(&mut self, from: &Arena, i: usize) -> Result<usize> {
        let src = from.slot(i).ok_or_else(|| {
            Error::invalid(
                "PinStore replica",
                format!("slot {i} of the first replica is not loaded"),
            )
        })?;
        let len = src.len();
        let dest = self.slot_mut(i)?;
        let room = dest.len();
        let dest = dest.get_mut(..len).ok_or_else(|| {
            Error::too_large(
                "PinStore replica",
                format!("slot {i}"),
                len,
                room,
                "a replica's slot",
            )
        })?;
        dest.copy_from_slice(src);
        self.mark_loaded(i, len);
        Ok(len)
    }

    /// Makes the region read-only at rest (`mprotect(PROT_READ)` of the whole region),
    /// or writable again.
    pub(crate) fn set_read_only(&mut self, read_only: bool) -> Result<()> {
        self.region.set_read_only(read_only)
    }

    /// Runs `fill` with the region writable, the whole region opened for it and closed
    /// after (also when `fill` fails), so that it never splits into more mappings. A
    /// region writable at rest is left as it is.
    pub(crate) fn writing<T>(&mut self, fill: impl FnOnce(&mut Arena) -> Result<T>) -> Result<T> {
        if !self.region.is_read_only() {
            return fill(self);
        }
        self.region.set_read_only(false)?;
        let filled = fill(self);
        let closed = self.region.set_read_only(true);
        let value = filled?;
        closed?;
        Ok(value)
    }

    pub(crate) fn populate(&mut self) -> Result<()> {
        self.region.populate_write()
    }

    /// The region, for read-only queries (placement, memory figures).
    pub(crate) fn region(&self) -> &Region {
        &self.region
    }

    pub(crate) fn stride(&self) -> usize {
        self.stride
    }

    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Slots in the arena.
    pub(crate) fn slots(&self) -> usize {
        self.loaded.len()
    }

    /// Bytes loaded in expert `i`'s slot (`None`: released, not held or out of range).
    pub(crate) fn loaded(&self, i: usize) -> Option<usize> {
        *self.loaded.get(self.position(i)?)?
    }

    /// Slots that hold data.
    pub(crate) fn loaded_count(&self) -> usize {
        self.loaded.iter().flatten().count()
    }

    /// Bytes loaded in all slots.
    pub(crate) fn loaded_bytes(&self) -> u64 {
        self.loaded.iter().flatten().map(|&n| n as u64).sum()
    }

    /// Byte range of expert `i`'s slot within the region (the whole stride).
    pub(crate) fn slot_range(&self, i: usize) -> Range<usize> {
        match self.position(i) {
            Some(p) => p * self.stride..(p + 1) * self.stride,
            None => 0..0,
        }
    }

    /// The loaded bytes of expert `i`'s slot.
    pub(crate) fn slot(&self, i: usize) -> Option<&[u8]> {
        let len = self.loaded(i)?;
        let start = self.position(i)?.checked_mul(self.stride)?;
        self.region.as_slice().get(start..start.checked_add(len)?)
    }

    /// Slots `first..first + count` as one run of bytes: each slot but the last loaded
    /// to its whole stride, all at consecutive positions (`None` otherwise: padding, a
    /// slot order, a released slot), so the run is their loaded bytes back to back.
    pub(crate) fn run(&self, first: usize, count: usize) -> Option<&[u8]> {
        let last = first.checked_add(count)?.checked_sub(1)?;
        let at = self.position(first)?;
        for (k, i) in (first..=last).enumerate() {
            let len = self.loaded(i)?;
            if self.position(i)? != at.checked_add(k)? || (i < last && len != self.stride) {
                return None;
            }
        }
        let start = at.checked_mul(self.stride)?;
        let len = (count - 1)
            .checked_mul(self.stride)?
            .checked_add(self.loaded(last)?)?;
        self.region.as_slice().get(start..start.checked_add(len)?)
    }

    /// Every slot, writable, in expert order (each the whole stride).
    pub(crate) fn slots_mut(&mut self) -> Result<Vec<&mut [u8]>> {
        let stride = self.stride.max(1);
        let order = self.order.clone();
        let chunks = self.region.as_mut_slice()?.chunks_mut(stride);
        let Some(order) = order else {
            return Ok(chunks.collect());
        };
        let mut by_slot: Vec<Option<&mut [u8]>> = chunks.map(Some).collect();
        order
            .iter()
            .map(|&p| by_slot.get_mut(p).and_then(Option::take))
            .collect::<Option<Vec<_>>>()
            .filter(|slots| slots.len() == self.loaded.len())
            .ok_or_else(|| Error::invalid("PinStore", "an arena's slot order is not a permutation"))
    }

    /// Slot `i`, writable (the whole stride).
    pub(crate) fn slot_mut(&mut self, i: usize) -> Result<&mut [u8]> {
        let range = self.slot_range(i);
        let len = self.region.len();
        self.region
            .as_mut_slice()?
            .get_mut(range.clone())
            .ok_or_else(|| {
                Error::out_of_bounds(
                    "PinStore",
                    format!("slot {i} range"),
                    range.start as u64..range.end as u64,
                    len,
                    "the region",
                )
            })
    }

    /// Records that slot `i` holds `len` bytes.
    pub(crate) fn mark_loaded(&mut self, i: usize, len: usize) {
        if let Some(slot) = self.position(i).and_then(|p| self.loaded.get_mut(p)) {
            *slot = Some(len);
        }
    }

    /// Gives slot `i`'s pages back (its addresses and the region's policy stay).
    pub(crate) fn release_slot(&mut self, i: usize) -> Result<()> {
        let Some(p) = self.position(i) else {
            return Ok(()); // not held here (a hybrid layer's hot copy of a cold expert)
        };
        let range = self.slot_range(i);
        self.region.release(range)?;
        if let Some(slot) = self.loaded.get_mut(p) {
            *slot = None;
        }
        Ok(())
    }

    /// The policy the kernel holds for slot `i`.
    pub(crate) fn slot_policy(
        &self,
        i: usize,
    ) -> Result<Observed<(MemPolicy, crate::policy::ModeFlags)>> {
        self.region.policy_at(self.slot_range(i).start)
    }

    /// Whether its slots are in an assigned order rather than by index.
    pub(crate) fn has_order(&self) -> bool {
        self.order.is_some()
    }

    /// Whether the arena is frozen (sealed) already.
    pub(crate) fn is_frozen(&self) -> bool {
        self.region.sealed_file().is_some()
    }

    /// Its slot order for an export: expert → slot position (`None`: not held); `None`
    /// where slot `i` is expert `i`.
    pub(crate) fn order_part(&self) -> Option<Vec<Option<usize>>> {
        let order = self.order.as_ref()?;
        Some(order.iter().map(|&p| (p != ABSENT).then_some(p)).collect())
    }

    /// The sealed file behind a frozen or attached arena.
    pub(crate) fn sealed_file(&self) -> Option<&File> {
        self.region.sealed_file()
    }

    /// The address range the region spans.
    pub(crate) fn span(&self) -> (usize, usize) {
        let start = self.region.as_ptr() as usize;
        (start, start + self.region.len())
    }

    /// Makes the arena immutable and shareable (see `Region::freeze_shared`), then maps
    /// every loaded slot's pages in this process, so that they are resident in its page
    /// tables (and `numa_maps`) as before the remap. `Err(_, true)` when the region's
    /// mapping was lost on the way.
    pub(crate) fn freeze(&mut self) -> std::result::Result<(), (Error, bool)> {
        self.region
            .freeze_shared()
            .map_err(|e| (e, self.region.is_empty()))?;
        for (p, len) in self.loaded.iter().enumerate() {
            if let Some(len) = *len {
                let start = p * self.stride;
                self.region
                    .populate_read(start..start + len)
                    .map_err(|e| (e, false))?;
            }
        }
        Ok(())
    }
}
