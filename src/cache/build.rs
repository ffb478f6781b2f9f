//! `ExpertCache::new` in steps: check the shape, size the regions, map and bind them.

use super::{CacheOptions, NodeRegions};
use crate::error::{Error, Result};
use crate::node::{Node, NodeSet};
use crate::page::page_size;
use crate::policy::{MbindFlags, MemPolicy, Placement};
use crate::region::{Advice, Region};

const OP: &str = "ExpertCache::new";
const HUGE_PAGE: usize = 2 << 20;
/// Slot ids are `u32`; `u32::MAX` stays free as a marker.
const MAX_SLOTS: usize = u32::MAX as usize - 1;

/// The sizes a cache's shape implies.
#[derive(Debug, Clone, Copy)]
pub(super) struct Geometry {
    pub weight_stride: usize,
    pub scale_stride: usize,
    pub total_slots: usize,
    pub weights_len: usize,
    pub scales_len: usize,
}

/// Checks the shape and computes strides and region lengths, without allocating.
pub(super) fn geometry(
    nodes: &NodeSet,
    slots_per_node: usize,
    weight_bytes: usize,
    scale_bytes: usize,
) -> Result<Geometry> {
    if nodes.is_empty() {
        return Err(Error::empty(OP, "nodes in the cache's node set"));
    }
    if slots_per_node == 0 {
        return Err(Error::empty(
            OP,
            "slots per node (capacity 0): a cache needs at least one slot per node",
        ));
    }
    if weight_bytes == 0 {
        return Err(Error::empty(OP, "weight bytes (weight_bytes is 0)"));
    }
    let page = page_size();
    let stride = |bytes: usize, what: &str| {
        bytes
            .checked_next_multiple_of(page)
            .ok_or_else(|| Error::overflow(OP, format!("{what} {bytes} rounded to pages")))
    };
    let weight_stride = stride(weight_bytes, "weight_bytes")?;
    let scale_stride = stride(scale_bytes, "scale_bytes")?;
    let total_slots = slots_per_node
        .checked_mul(nodes.len())
        .filter(|&n| n <= MAX_SLOTS)
        .ok_or_else(|| {
            Error::overflow(
                OP,
                format!(
                    "the slot count, {slots_per_node} slots on each of {} nodes (at most \
                     {MAX_SLOTS} in all),",
                    nodes.len(),
                ),
            )
        })?;
    let region_len = |stride: usize, what: &str| {
        stride.checked_mul(slots_per_node).ok_or_else(|| {
            Error::overflow(
                OP,
                format!("{slots_per_node} slots × {what} stride {stride}"),
            )
        })
    };
    Ok(Geometry {
        weight_stride,
        scale_stride,
        total_slots,
        weights_len: region_len(weight_stride, "weight")?,
        scales_len: region_len(scale_stride, "scale")?,
    })
}

/// Each node's weights region (and scales region unless `with_scales` is false), bound.
pub(super) fn node_regions(
    nodes: &NodeSet,
    geometry: &Geometry,
    with_scales: bool,
    options: CacheOptions,
) -> Result<Vec<NodeRegions>> {
    let mut regions = Vec::with_capacity(nodes.len());
    for node in nodes.iter() {
        let (weights, placement) = node_region(geometry.weights_len, node, options)?;
        let scales = if with_scales {
            Some(node_region(geometry.scales_len, node, options)?.0)
        } else {
            None
        };
        regions.push(NodeRegions {
            node,
            weights,
            scales,
            placement,
        });
    }
    Ok(regions)
}

/// A region of `len` bytes bound to `node` before anything touches it.
fn node_region(len: usize, node: Node, options: CacheOptions) -> Result<(Region, Placement)> {
    let huge = options.huge_pages && len >= HUGE_PAGE;
    let align = if huge { HUGE_PAGE } else { page_size() };
    let mut region = Region::anonymous_aligned(len, align)?;
    let mut set = NodeSet::new();
    set.insert(node);
    let placement = region.bind(&MemPolicy::Bind(set), MbindFlags::empty())?;
    if huge {
        region.advise(Advice::HugePage)?;
    }
    if options.populate {
        region.populate_write()?;
    }
    if !options.writable {
        // Loads open the region for their fill (see `miss.rs`).
        region.set_read_only(true)?;
    }
    Ok((region, placement))
}
