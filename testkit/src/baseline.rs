//! The strategy [`PinStore`](numapin::store::PinStore) replaces, kept to measure against: every
//! expert tensor in its own `posix_memalign` allocation, bound on its own with `mbind`.
//!
//! Each bound slab is a mapping of its own that cannot merge with its unbound
//! neighbours (the allocator's headers), so the process spends about two mappings per
//! slab and crosses `vm.max_map_count` at around 32k slabs: the allocation or the
//! `mbind` then fails with `ENOMEM` on a machine with plenty of free memory.
//!
//! # Safety
//!
//! This module owns `posix_memalign` blocks: each is written only through the `&mut`
//! slice made right after allocation and freed exactly once on drop.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use numapin::store::{ExpertSource, Kind, LayerSpec};
use numapin::{Errno, Error, Invalid, Node, Result};

use numapin::policy::{MbindFlags, MemPolicy, Observed, Placement};

/// One `posix_memalign` block.
struct Slab {
    ptr: *mut u8,
    len: usize,
}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from posix_memalign and is freed once, here.
        unsafe { libc::free(self.ptr.cast()) };
    }
}

/// Slabs, one per expert tensor, each allocated and bound on its own.
pub struct SlabPerExpert {
    slabs: Vec<Slab>,
    mbind_calls: AtomicUsize,
    degraded: Option<Placement>,
}

// SAFETY: the slabs are owned exclusively; the raw pointers are not shared elsewhere.
unsafe impl Send for SlabPerExpert {}

impl Default for SlabPerExpert {
    fn default() -> Self {
        SlabPerExpert::new()
    }
}

impl SlabPerExpert {
    /// No slabs yet.
    pub fn new() -> Self {
        SlabPerExpert {
            slabs: Vec::new(),
            mbind_calls: AtomicUsize::new(0),
            degraded: None,
        }
    }

    /// Allocates, binds (when `policy` is given) and fills one slab per tensor of the
    /// layer, on the calling thread.
    ///
    /// # Errors
    /// The sources do not fit the spec, `posix_memalign` fails (`ENOMEM` once the map
    /// limit is reached), or `mbind` fails.
    pub fn load_layer(
        &mut self,
        layer: usize,
        spec: &LayerSpec,
        sources: &[ExpertSource<'_>],
        policy: Option<&MemPolicy>,
    ) -> Result<()> {
        let page = numapin::page_size();
        for (expert, source) in sources.iter().enumerate() {
            for kind in Kind::ALL {
                let len = source.bytes(kind)?;
                if len > spec.bytes(kind) {
                    return Err(Error::InvalidArgument {
                        op: "SlabPerExpert::load_layer",
                        reason: Invalid::TooLarge {
                            what: format!("layer {layer} expert {expert} {}", kind.name()),
                            size: len as u64,
                            max: spec.bytes(kind) as u64,
                            within: "a slab",
                        },
                    });
                }
                if len == 0 {
                    continue;
                }
                let mut raw: *mut libc::c_void = std::ptr::null_mut();
                // SAFETY: a valid out-pointer; alignment is a power of two multiple of
                // the pointer size.
                let rc = unsafe { libc::posix_memalign(&mut raw, page, len) };
                if rc != 0 {
                    return Err(Error::Os {
                        op: "posix_memalign",
                        errno: Errno::from_raw_os_error(rc),
                        args: format!(
                            "align={page} size={len} (slab {} of this store, layer {layer} expert {expert})",
                            self.slabs.len()
                        ),
                    });
                }
                let slab = Slab {
                    ptr: raw.cast(),
                    len,
                };
                self.slabs.push(slab);
                let slab = &self.slabs[self.slabs.len() - 1];
                if let Some(policy) = policy {
                    // SAFETY: our own fresh block; the kernel rounds `len` up to the
                    // page, which stays inside the allocator's page-granular block.
                    let p =
                        unsafe { numapin::bind_range(slab.ptr, len, policy, MbindFlags::empty()) }?;
                    self.mbind_calls.fetch_add(1, Ordering::Relaxed);
                    if !p.is_bound() {
                        self.degraded = Some(p);
                    }
                }
                // SAFETY: the block holds `len` bytes and nothing else refers to it yet.
                let dest = unsafe { std::slice::from_raw_parts_mut(slab.ptr, slab.len) };
                source.read_tensor(kind, dest)?;
            }
        }
        Ok(())
    }

    /// Mappings the slabs occupy (page-rounded spans, counted in `/proc/self/maps`).
    ///
    /// # Errors
    /// `/proc/self/maps` cannot be read.
    pub fn vmas(&self) -> Result<usize> {
        let page = numapin::page_size();
        let spans: Vec<(usize, usize)> = self
            .slabs
            .iter()
            .map(|s| {
                let start = s.ptr as usize / page * page;
                (start, (s.ptr as usize + s.len).next_multiple_of(page))
            })
            .collect();
        numapin::diag::maps_overlapping(&spans)
    }

    /// Slabs allocated.
    pub fn slabs(&self) -> usize {
        self.slabs.len()
    }

    /// `mbind` calls made.
    pub fn mbind_calls(&self) -> usize {
        self.mbind_calls.load(Ordering::Relaxed)
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.slabs.iter().map(|s| s.len as u64).sum()
    }

    /// The degradation met, if any.
    pub fn placement(&self) -> Option<Placement> {
        self.degraded
    }

    /// Present pages per node over all slabs (`move_pages`, nothing faulted in);
    /// `Degraded` where the call is denied or unsupported.
    ///
    /// # Errors
    /// `move_pages` fails with another errno.
    pub fn pages_per_node(&self) -> Result<Observed<BTreeMap<Node, u64>>> {
        let page = numapin::page_size();
        let mut total = BTreeMap::new();
        for slab in &self.slabs {
            let start = slab.ptr as usize / page * page;
            let end = (slab.ptr as usize + slab.len).next_multiple_of(page);
            // SAFETY: the pages of our own live block (the allocator's block covers the
            // page-rounded range, which move_pages only queries).
            match unsafe { numapin::range_placement(start as *const u8, end - start)? } {
                Observed::Known(h) => {
                    for (node, n) in h.pages {
                        *total.entry(node).or_insert(0) += n as u64;
                    }
                }
                Observed::Degraded(reason) => return Ok(Observed::Degraded(reason)),
            }
        }
        Ok(Observed::Known(total))
    }

    /// The bytes of slab `i` (in load order: expert 0 weights, expert 0 scales, ...).
    pub fn slab(&self, i: usize) -> Option<&[u8]> {
        let s = self.slabs.get(i)?;
        // SAFETY: the block lives as long as `self` and was fully written at load.
        Some(unsafe { std::slice::from_raw_parts(s.ptr, s.len) })
    }
}
