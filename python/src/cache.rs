//! `numapin.ExpertCache`: fixed slots per node, LRU, for callers with their own sources;
//! each `CacheEntry` (and every view of it) pins its slot.
#![allow(unsafe_code)]

use std::sync::Arc;

use numapin::NodeSet;
use numapin::cache::{CacheOptions, Entry};
use numapin::store::ExpertSource;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::IntoPy;
use crate::store::{buffers, bytes};
use crate::view::{RAW, View};

/// A pinned entry and the cache it lives in. Field order matters: the entry (whose drop
/// unpins the slot, touching the cache) drops before the cache's `Arc`.
struct Held {
    entry: Entry<'static>,
    _cache: Arc<numapin::cache::ExpertCache>,
}

impl Held {
    fn new(cache: &Arc<numapin::cache::ExpertCache>, entry: Entry<'_>) -> Held {
        // SAFETY: the entry borrows the cache inside the `Arc` stored beside it, which
        // drops after it (field order); an `Arc`'s contents never move.
        let entry = unsafe { std::mem::transmute::<Entry<'_>, Entry<'static>>(entry) };
        Held {
            entry,
            _cache: cache.clone(),
        }
    }
}

/// An LRU of experts in fixed slots, one weights region and one scales region per node,
/// each bound to its node once: evictions reuse pages in place (no new mappings, no
/// `mbind` per fill).
#[pyclass(frozen, module = "numapin")]
pub struct ExpertCache {
    cache: Arc<numapin::cache::ExpertCache>,
}

/// One cached expert: `weights` and `scales` views, its `node` and `key`. The slot stays
/// pinned (never evicted or written) while this entry or a view of it lives.
#[pyclass(frozen, module = "numapin")]
pub struct CacheEntry {
    held: Arc<Held>,
}

#[pymethods]
impl ExpertCache {
    /// A cache of `slots_per_node` slots on each node of `nodes` (numactl syntax), each
    /// slot holding `weight_bytes` of weights and `scale_bytes` of scales. The slots are
    /// read-only between loads unless `writable=True`.
    #[new]
    #[pyo3(signature = (slots_per_node, weight_bytes, scale_bytes = 0, *, nodes = "all",
                        populate = false, huge_pages = false, writable = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        slots_per_node: usize,
        weight_bytes: usize,
        scale_bytes: usize,
        nodes: &str,
        populate: bool,
        huge_pages: bool,
        writable: bool,
    ) -> PyResult<ExpertCache> {
        let nodes = NodeSet::parse(nodes).py_err()?;
        let options = CacheOptions::default()
            .populate(populate)
            .huge_pages(huge_pages)
            .writable(writable);
        let cache = py
            .detach(|| {
                numapin::cache::ExpertCache::new(
                    nodes,
                    slots_per_node,
                    weight_bytes,
                    scale_bytes,
                    options,
                )
            })
            .py_err()?;
        Ok(ExpertCache {
            cache: Arc::new(cache),
        })
    }

    /// The cached entry for `(layer, expert)`, or None (this never loads or waits).
    fn get(&self, layer: usize, expert: usize) -> Option<CacheEntry> {
        let entry = self.cache.get(layer, expert)?;
        Some(CacheEntry {
            held: Arc::new(Held::new(&self.cache, entry)),
        })
    }

    /// The entry for `(layer, expert)`, loaded from `weights` (and `scales`), objects with
    /// the buffer protocol, on a miss; on the node `hint` when given. Raises `CacheFull`
    /// when every slot of the node is pinned by live entries or views.
    #[pyo3(signature = (layer, expert, weights, scales = None, *, hint = None))]
    fn get_or_load(
        &self,
        py: Python<'_>,
        layer: usize,
        expert: usize,
        weights: Bound<'_, PyAny>,
        scales: Option<Bound<'_, PyAny>>,
        hint: Option<u16>,
    ) -> PyResult<CacheEntry> {
        let w = buffers(&[weights])?;
        let s = buffers(&scales.into_iter().collect::<Vec<_>>())?;
        let source = ExpertSource::Memory {
            weights: bytes(&w[0]),
            scales: s.first().map_or(&[][..], bytes),
        };
        let hint = hint.map(numapin::Node);
        let cache = &self.cache;
        let held = py
            .detach(|| {
                cache
                    .get_or_load(layer, expert, &source, hint)
                    .map(|entry| Held::new(cache, entry))
            })
            .py_err()?;
        Ok(CacheEntry {
            held: Arc::new(held),
        })
    }

    /// Evicts unpinned entries until each node keeps at most `keep_per_node`; returns
    /// how many were evicted.
    fn shrink(&self, keep_per_node: usize) -> PyResult<usize> {
        self.cache.shrink(keep_per_node).py_err()
    }

    /// Slots per node.
    #[getter]
    fn slots_per_node(&self) -> usize {
        self.cache.slots_per_node()
    }

    /// Counters and per-node figures as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.cache.stats().py_err()?;
        let dict = PyDict::new(py);
        dict.set_item("hits", stats.hits)?;
        dict.set_item("misses", stats.misses)?;
        dict.set_item("evictions", stats.evictions)?;
        dict.set_item("loads", stats.loads)?;
        dict.set_item("load_failures", stats.load_failures)?;
        dict.set_item("bytes_loaded", stats.bytes_loaded)?;
        dict.set_item("mappings", stats.mappings)?;
        let nodes = pyo3::types::PyList::empty(py);
        for node in &stats.nodes {
            let n = PyDict::new(py);
            n.set_item("node", node.node.index())?;
            n.set_item("placement", format!("{:?}", node.placement))?;
            n.set_item("slots", node.slots)?;
            n.set_item("used", node.used)?;
            n.set_item("resident_bytes", node.resident_bytes)?;
            nodes.append(n)?;
        }
        dict.set_item("nodes", nodes)?;
        Ok(dict)
    }
}

impl CacheEntry {
    fn view(&self, bytes: &[u8]) -> View {
        let keep: crate::view::KeepAlive = self.held.clone();
        // SAFETY: the bytes are the pinned entry's slot, which the cache never evicts or
        // writes while the entry lives; `keep` holds the entry and the cache.
        unsafe { View::contiguous(bytes.as_ptr() as usize, RAW, &[bytes.len() as u64], keep) }
    }
}

#[pymethods]
impl CacheEntry {
    /// `(layer, expert)`.
    #[getter]
    fn key(&self) -> (usize, usize) {
        self.held.entry.key()
    }

    /// The node whose regions hold the entry.
    #[getter]
    fn node(&self) -> usize {
        self.held.entry.node().index()
    }

    /// The expert's weights: a read-only `uint8` view (pins the slot while it lives).
    #[getter]
    fn weights(&self) -> View {
        self.view(self.held.entry.weights())
    }

    /// The expert's scales (empty without scales).
    #[getter]
    fn scales(&self) -> View {
        self.view(self.held.entry.scales())
    }
}
