//! One bound region holding the same kind of tensor (weights or scales) of every expert of
//! a layer, at a fixed stride.

use crate::error::{Error, Result};
use crate::policy::{MbindFlags, MemPolicy, Placement};
use crate::region::{Advice, Region};

/// Transparent huge page size on x86-64 and most arm64 kernels.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// Which tensor of an expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
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

/// The stride for slots of `slot_bytes`: the page, or 2 MiB with huge pages when the slot
/// is at least that large (smaller slots would waste most of a huge page each).
pub(crate) fn stride_for(slot_bytes: usize, huge_pages: bool) -> Option<usize> {
    let unit = if huge_pages && slot_bytes >= HUGE_PAGE {
        HUGE_PAGE
    } else {
        crate::page_size()
    };
    slot_bytes.checked_next_multiple_of(unit)
}

impl Arena {
    /// Reserves the region (2 MiB-aligned with `MADV_HUGEPAGE` when `huge_pages`). Nothing
    /// is touched: the caller binds before populating.
    pub(crate) fn reserve(
        kind: Kind,
        slots: usize,
        slot_bytes: usize,
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
        let stride = stride_for(slot_bytes, huge_pages).ok_or_else(overflow)?;
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
        let start = i * self.stride;
        Some(&self.region.as_slice()[start..start + len])
    }

    /// The address range the region spans.
    pub(crate) fn span(&self) -> (usize, usize) {
        let start = self.region.as_ptr() as usize;
        (start, start + self.region.len())
    }
}
