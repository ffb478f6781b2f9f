//! One bound region holding the same kind of tensor (weights or scales) of every expert of
//! a layer, at a fixed stride.

use crate::error::{Error, Result};
use crate::policy::{MbindFlags, MemPolicy, Placement};
use crate::region::{Advice, Region};

/// Transparent huge page size on x86-64 and most arm64 kernels.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// Which tensor of an expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// The expert's weight matrices (gate, up, down).
    Weights = 0,
    /// The expert's quantisation scales.
    Scales = 1,
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Weights => "weights",
            Kind::Scales => "scales",
        }
    }
}

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
    pub(crate) region: Region,
    pub(crate) stride: usize,
    pub(crate) slot_bytes: usize,
    /// Bytes loaded in each slot; `None` when never loaded or released.
    pub(crate) loaded: Vec<Option<usize>>,
}

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
            Error::invalid(
                "PinStore::pack_layer",
                format!(
                    "{slots} {} slots of {slot_bytes} bytes overflow the address space",
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
        })
    }

    pub(crate) fn bind(&self, policy: &MemPolicy) -> Result<Placement> {
        self.region.bind(policy, MbindFlags::empty())
    }

    /// Byte range of slot `i` within the region (the whole stride).
    pub(crate) fn slot_range(&self, i: usize) -> std::ops::Range<usize> {
        i * self.stride..(i + 1) * self.stride
    }

    /// The loaded bytes of slot `i`.
    pub(crate) fn loaded_slice(&self, i: usize) -> Option<&[u8]> {
        let len = (*self.loaded.get(i)?)?;
        let start = i.checked_mul(self.stride)?;
        self.region.as_slice().get(start..start.checked_add(len)?)
    }

    /// Makes the arena immutable and shareable (see `Region::freeze_shared`), then maps
    /// every loaded slot's pages in this process, so that they are resident in its page
    /// tables (and `numa_maps`) as before the remap.
    pub(crate) fn freeze(&mut self) -> Result<()> {
        self.region.freeze_shared()?;
        for (i, len) in self.loaded.iter().enumerate() {
            if let Some(len) = *len {
                let start = i * self.stride;
                self.region.populate_read(start..start + len)?;
            }
        }
        Ok(())
    }

    /// The address range the region spans.
    pub(crate) fn span(&self) -> (usize, usize) {
        let start = self.region.as_ptr() as usize;
        (start, start + self.region.len())
    }
}
